"""Steering the self-written source (eagle3/prepare/steer.py): draws under a seed, the steered
opening on Kimi's and ChatML's templates, the labels on the records, where the steering system
prompt goes (user turns only, or the conversation too), replies cut at the budget kept, and the
recipe errors. The turns come from a scripted generator (selfwritten_helpers) that records what
it was asked to continue."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from selfwritten_helpers import ScriptedGenerator, chatml_target

from eagle3.core.chat import ChatRenderer
from eagle3.core.records import read_jsonl
from eagle3.core.target import load_tokenizer
from eagle3.prepare import selfwritten_run
from eagle3.prepare.recipes import DatasetSpec, RecipeError, load_recipe
from eagle3.prepare.selfwritten import SelfWriter, SelfWrittenSpec
from eagle3.prepare.steer import UNSTEERED, SteerSpec

ROOT = Path(__file__).resolve().parents[2]
AXES = {"task": [["code", "for help with a Python program", 1.0],
                 ["math", "a math word problem", 1.0],
                 ["travel", "for a travel plan", 2.0]],
        "persona": [["student", "a student", 1.0], ["nurse", "a nurse", 1.0]]}
STEER = {"system": "The user is {persona} and asks {task}.", "axes": AXES}
OPENINGS = {  # the steered opening of the first draw (first option of every axis)
    "kimi": ("<|im_system|>system<|im_middle|>The user is a student and asks for help with a "
             "Python program.<|im_end|><|im_user|>user<|im_middle|>Hi,"),
    "chatml": ("<|im_start|>system\nThe user is a student and asks for help with a Python "
               "program.<|im_end|>\n<|im_start|>user\nHi,"),
}


@pytest.fixture(scope="module")
def targets(tiny_target_dir, tmp_path_factory) -> dict[str, Path]:
    return {"kimi": tiny_target_dir,
            "chatml": chatml_target(tmp_path_factory.mktemp("targets") / "chatml")}


class Recording(ScriptedGenerator):
    """ScriptedGenerator that keeps the decoded prompts of every call, with its temperature;
    with `cut_replies`, each greedy reply is cut at the budget (finish 'length')."""

    def __init__(self, tokenizer, eot_id, cut_replies: bool = False):
        super().__init__(tokenizer, eot_id)
        self.prompts: list[tuple[float, str]] = []
        self.cut_replies = cut_replies

    def generate_ids(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.prompts += [(temperature, self.tok.decode(p)) for p in prompts]
        if self.cut_replies and temperature == 0:
            words = self.tok("Here is a long answer " * 20, add_special_tokens=False)
            return [(words["input_ids"][:max_new_tokens], "length") for _ in prompts]
        return super().generate_ids(prompts, max_new_tokens, temperature, top_p, seed)


def recording(monkeypatch, target: Path, cut_replies: bool = False) -> list[Recording]:
    tok = load_tokenizer(target)
    made: list[Recording] = []

    def build(cfg, renderer):
        made.append(Recording(tok, tok.convert_tokens_to_ids("<|im_end|>"), cut_replies))
        return made[-1]

    monkeypatch.setattr(selfwritten_run, "build_generator", build)
    return made


def run01(workdir: Path, target: Path, steer: dict | None, seed: int = 0, **block) -> Path:
    block = {"heldout": 3, "max_user_tokens": 48, "min_user_chars": 4,
             "reply_max_new_tokens": 96, "turns": [[1, 0.5], [2, 0.5]], **block}
    if steer is not None:
        block["steer"] = steer
    path = workdir.parent / f"{workdir.name}.json"
    path.write_text(json.dumps({"name": "t", "datasets": [{
        "name": "self", "count": 10, "seed": seed, "self_written": block}]}))
    main = importlib.import_module("01_prepare_datasets").main
    assert main(["--recipe", str(path), "--target", str(target), "--workdir", str(workdir),
                 "--num-workers", "1", "--gen-batch-size", "4"]) == 0
    return next((workdir / "01_prepared" / ".self_written" / "self").iterdir())


def written(cache: Path) -> tuple[list[dict], list[dict]]:
    return list(read_jsonl(cache / "conversations.jsonl")), list(read_jsonl(cache /
                                                                            "heldout.jsonl"))


# ---------------------------------------------------------------- draws


def test_steer_draws_are_the_same_under_a_seed_and_differ_under_another():
    steer = SteerSpec(**STEER)
    a = [steer.draw(0, "self", 1, k) for k in range(40)]
    assert a == [steer.draw(0, "self", 1, k) for k in range(40)]
    assert a != [steer.draw(1, "self", 1, k) for k in range(40)]
    assert a != [steer.draw(0, "self", 2, k) for k in range(40)]
    assert {d.labels["task"] for d in a} == {"code", "math", "travel"}
    for d in a:  # the system prompt is the template over the drawn options' texts
        text = dict((lab, t) for lab, t, _ in AXES["task"])[d.labels["task"]]
        assert d.system.endswith(f"asks {text}.") and d.prefix == ""


def test_steer_draws_follow_the_weights_and_share():
    steer = SteerSpec(**{**STEER, "share": 0.5})
    draws = [steer.draw(7, "self", 1, k) for k in range(2000)]
    steered = [d for d in draws if d is not UNSTEERED]
    assert 0.45 < len(steered) / len(draws) < 0.55
    travel = sum(d.labels["task"] == "travel" for d in steered) / len(steered)
    assert 0.45 < travel < 0.55  # weight 2 of 4


@pytest.mark.parametrize("block,match", [
    ({"system": "asks {task} in {tone}."}, r"uses \['tone'\], which are no axes"),
    ({"system": "asks {task}."}, r"axes \['persona'\] are used by neither"),
    ({"system": None}, "set system and/or prefix"),
    ({"axes": {"task": [["code", "x", 0]]}, "system": "{task}"}, "weight > 0"),
    ({"axes": {"task": [["a", "x", 1], ["a", "y", 1]]}, "system": "{task}"}, "labels repeat"),
    ({"axes": {"task": ["code"]}, "system": "{task}"}, r"options must be \[\[label"),
    ({"share": 0}, r"share must be in \(0, 1\]"),
    ({"system": None, "prefix": "{persona} {task}", "keep_system": True},
     "keep_system needs a system template"),
    ({"system": "asks {task!r} {persona}"}, "takes no conversion"),
    ({"sytem": "x"}, r"unknown fields \['sytem'\]"),
])
def test_bad_steer_block_is_a_recipe_error_naming_the_field(tmp_path, block, match):
    steer = {**STEER, **block}
    (tmp_path / "r.json").write_text(json.dumps({"datasets": [
        {"name": "self", "count": 4, "self_written": {"steer": steer}}]}))
    with pytest.raises(RecipeError, match=f"self_written.steer.*{match}"):
        load_recipe(tmp_path / "r.json")


def test_entry_without_the_new_fields_keeps_its_fingerprint_key():
    """An existing run's rounds stay valid: the new fields at their defaults are not keyed."""
    spec = DatasetSpec(name="self", count=4, self_written={"heldout": 1})
    assert set(spec.content_key()["self_written"]) == {
        "heldout", "temperature", "top_p", "max_user_tokens", "min_user_chars",
        "reply_max_new_tokens", "turns", "near_dup_threshold", "system", "oversample",
        "max_rounds"}
    steered = DatasetSpec(name="self", count=4, self_written={"steer": STEER})
    assert steered.content_key()["self_written"]["steer"]["axes"] == AXES


# ---------------------------------------------------------------- the opening on both templates


@pytest.mark.parametrize("kind", ["kimi", "chatml"])
def test_steered_opening_holds_the_system_prompt_and_prefix_on_the_template(targets, kind,
                                                                            tmp_path):
    renderer = ChatRenderer(load_tokenizer(targets[kind]), {"thinking": True})
    spec = SelfWrittenSpec(steer={**STEER, "prefix": "Hi,"})
    writer = SelfWriter("self", spec, renderer, tmp_path, count=1, seed=0, max_seq_len=1024,
                        batch_size=4, load_generator=lambda: None)
    ids = writer.opening_ids(spec.steer.first_draw())
    assert ids == renderer.encode(OPENINGS[kind])
    assert writer.opening_ids(UNSTEERED) == writer.opening.ids  # the plain opening


@pytest.mark.parametrize("kind", ["kimi", "chatml"])
def test_steered_dataset_writes_each_user_turn_after_its_steer_and_labels_the_records(
        targets, tmp_path, monkeypatch, kind):
    made = recording(monkeypatch, targets[kind])
    cache = run01(tmp_path / "w", targets[kind], {**STEER, "prefix": "Hi,"})
    convs, heldout = written(cache)
    sampled = [p for t, p in made[0].prompts if t > 0]
    replies = [p for t, p in made[0].prompts if t == 0]
    assert len(heldout) == 3 and len(convs) == 10
    for rec in heldout + convs:
        labels = rec["steer"]
        assert set(labels) == {"task", "persona"}
        first = rec["messages"][0]
        assert first["role"] == "user" and first["content"].startswith("Hi,")
        # the steer reached the target: some first-turn prompt held this record's system text
        persona = dict((lab, t) for lab, t, _ in AXES["persona"])[labels["persona"]]
        assert any(f"The user is {persona} and asks" in p and p.endswith("Hi,")
                   for p in sampled)
    assert all("The user is" in p for p in sampled)  # later user turns too (share 1)
    assert replies and not any("The user is" in p for p in replies)  # keep_system false
    assert any(len([m for m in c["messages"] if m["role"] == "user"]) == 2 for c in convs)
    info = json.loads((cache / "stats.json").read_text())
    assert sum(info["steer_labels"]["task"].values()) == 13


def test_keep_system_puts_the_steer_in_the_conversation_and_the_replies_prompt(
        targets, tmp_path, monkeypatch):
    made = recording(monkeypatch, targets["chatml"])
    convs, heldout = written(run01(tmp_path / "w", targets["chatml"],
                                   {**STEER, "keep_system": True}))
    for rec in heldout + convs:
        assert rec["messages"][0]["role"] == "system"
        assert rec["messages"][0]["content"].startswith("The user is ")
    assert all("The user is" in p for _, p in made[0].prompts)


def test_same_seed_writes_the_same_steered_files_and_another_seed_does_not(
        targets, tmp_path, monkeypatch):
    recording(monkeypatch, targets["kimi"])
    runs = [written(run01(tmp_path / name, targets["kimi"], STEER, seed=seed))
            for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    assert runs[0] == runs[1]
    assert [r.get("steer") for r in runs[0][0]] != [r.get("steer") for r in runs[2][0]]


def test_unsteered_share_gets_the_plain_opening_and_no_labels(targets, tmp_path, monkeypatch):
    made = recording(monkeypatch, targets["kimi"])
    convs, heldout = written(run01(tmp_path / "w", targets["kimi"], {**STEER, "share": 0.5}))
    plain = [r for r in convs + heldout if "steer" not in r]
    assert plain and len(plain) < len(convs + heldout)
    assert any("The user is" not in p for t, p in made[0].prompts if t > 0)


def test_template_that_drops_the_system_prompt_is_a_one_line_error_before_any_folder(
        targets, tmp_path, capsys):
    from selfwritten_helpers import with_template

    template = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>"
                "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    target = with_template(targets["chatml"], tmp_path / "t", template)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"datasets": [{"name": "self", "count": 2,
                                              "self_written": {"steer": STEER}}]}))
    main = importlib.import_module("01_prepare_datasets").main
    assert main(["--recipe", str(path), "--target", str(target), "--workdir",
                 str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not render the steer's system prompt" in err
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- replies cut at the budget


@pytest.mark.parametrize("keep", [False, True])
def test_reply_cut_at_the_budget_ends_the_conversation_unless_kept(targets, tmp_path,
                                                                   monkeypatch, keep):
    recording(monkeypatch, targets["kimi"], cut_replies=True)
    cache = run01(tmp_path / "w", targets["kimi"], None, keep_cut_replies=keep,
                  turns=[[2, 1.0]], reply_max_new_tokens=6)
    convs, _ = written(cache)
    info = json.loads((cache / "stats.json").read_text())
    if keep:
        assert info["user_turns"] == {"2": 10} and info["replies_cut_kept"] == 10
        reply = convs[0]["messages"][1]
        assert reply["role"] == "assistant" and reply["content"].startswith("Here is a")
    else:
        assert info["user_turns"] == {"1": 10} and info["replies_cut_kept"] == 0
        assert info["ended_early"] == {"reply not closed": 10}


# ---------------------------------------------------------------- shipped recipes


def test_shipped_steered_recipes_load_and_draw_every_axis():
    for name in ("smollm2_self_written_diverse.json", "smollm2_self_written_long.json"):
        spec = load_recipe(ROOT / "datasets" / name).datasets[0]
        steer = spec.self_written.steer
        assert steer is not None and {"task", "topic", "format", "length"} <= set(steer.axes)
        draws = [steer.draw(spec.seed, spec.name, 1, k) for k in range(400)]
        for axis, options in steer.axes.items():
            assert {d.labels.get(axis) for d in draws} >= {lab for lab, _, _ in options}
    long = load_recipe(ROOT / "datasets" / "smollm2_self_written_long.json").datasets[0]
    assert long.max_seq_len >= 4096 and long.self_written.keep_cut_replies
    assert long.self_written.max_turns >= 6
