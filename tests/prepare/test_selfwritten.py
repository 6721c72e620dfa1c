"""Stage 01's self-written source end to end (`01_prepare_datasets.main`): the files, manifest and
summary on Kimi's and ChatML's templates, multi-turn structure, held-out prompts for 05,
determinism under a seed and resume after a kill (the tiny target through eagle3.generate.fast
on CPU), the one-line error of a template that cannot be cut, and 01b regenerating the replies.

Where the model does not matter, a scripted generator writes the turns (selfwritten_helpers).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
from selfwritten_helpers import (
    Interrupting,
    ListGenerator,
    RepliesClose,
    ScriptedGenerator,
    chatml_target,
    closing_early,
    with_template,
)

import eagle3.core.target
from eagle3.core.chat import ChatRenderer
from eagle3.core.records import read_jsonl
from eagle3.core.target import load_tokenizer
from eagle3.prepare import selfwritten_run
from eagle3.prepare.recipes import RecipeError, load_recipe
from eagle3.prepare.selfwritten import SelfWrittenError

ROOT = Path(__file__).resolve().parents[2]
TURNS = [[1, 0.4], [2, 0.3], [3, 0.3]]


@pytest.fixture(scope="module")
def targets(tiny_target_dir, tmp_path_factory) -> dict[str, Path]:
    """The embedded tiny target (Kimi's template) and a ChatML one."""
    return {"kimi": tiny_target_dir,
            "chatml": chatml_target(tmp_path_factory.mktemp("targets") / "chatml")}


def recipe(path: Path, count: int = 12, seed: int = 0, max_seq_len: int = 2048,
           **block) -> Path:
    block = {"heldout": 3, "max_user_tokens": 48, "min_user_chars": 4,
             "reply_max_new_tokens": 96, **block}
    path.write_text(json.dumps({"name": "t", "datasets": [{
        "name": "self", "count": count, "seed": seed, "max_seq_len": max_seq_len,
        "self_written": block}]}))
    return path


def run01(workdir: Path, recipe_path: Path, target: Path, *flags: str) -> int:
    main = importlib.import_module("01_prepare_datasets").main
    return main(["--recipe", str(recipe_path), "--target", str(target), "--workdir",
                 str(workdir), "--num-workers", "1", "--gen-batch-size", "4", *flags])


def scripted(monkeypatch, target: Path) -> None:
    tok = load_tokenizer(target)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    monkeypatch.setattr(selfwritten_run, "build_generator",
                        lambda cfg, renderer: ScriptedGenerator(tok, eot))


def real_model(monkeypatch, target: Path, replies_close: bool = False) -> None:
    """eagle3.generate.fast on the tiny target, its end of turn favoured (closing_early); with
    `replies_close`, its greedy replies closed after a few tokens (RepliesClose)."""
    tok = load_tokenizer(target)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    monkeypatch.setattr(eagle3.core.target, "load_hf_model",
                        closing_early(eagle3.core.target.load_hf_model, eot))
    if replies_close:
        build, reply = selfwritten_run.build_generator, tok.encode("Sure, here it is.",
                                                                   add_special_tokens=False)
        monkeypatch.setattr(selfwritten_run, "build_generator",
                            lambda cfg, renderer: RepliesClose(build(cfg, renderer), reply, eot))


def out(workdir: Path) -> Path:
    return workdir / "01_prepared" / "self"


def manifest_entry(workdir: Path) -> dict:
    m = json.loads((workdir / "01_prepared" / "manifest.json").read_text())
    return m["outputs"]["datasets"]["self"]


# ---------------------------------------------------------------- files, manifest, summary


@pytest.mark.parametrize("kind", ["kimi", "chatml"])
def test_self_written_dataset_is_prepared_with_its_counts_in_manifest_and_summary(
        targets, tmp_path, monkeypatch, capsys, kind):
    scripted(monkeypatch, targets[kind])
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", turns=TURNS), targets[kind]) == 0
    convs = list(read_jsonl(out(w) / "conversations.jsonl"))
    assert len(convs) == 12 and len({c["id"] for c in convs}) == 12
    assert all(c["id"].startswith("self/") and c["source"] == "self" for c in convs)
    entry = manifest_entry(w)
    assert entry["regenerate"] and entry["mode"] == "regenerate" and entry["records"] == 12
    sw = entry["self_written"]
    assert sw["seed"] == 0 and sw["settings"]["temperature"] == 1.0 and sw["count"] == 12
    assert sw["kept"] == 15 and sw["heldout"] == 3 and sw["conversations"] == 12
    assert set(sw["rejection_rates"]) == set(sw["rejected"])
    assert sw["keep_rate"] == round(sw["kept"] / sw["judged"], 4)
    summary = capsys.readouterr().out
    assert "self self-written" in summary and f"kept {sw['kept']} of {sw['judged']}" in summary
    assert "self rejected" in summary


def test_heldout_prompts_are_single_turn_never_trained_on_and_05_reads_them(
        targets, tmp_path, monkeypatch):
    from eagle3.bench.prompts import load_prompt_set

    scripted(monkeypatch, targets["kimi"])
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", heldout=5), targets["kimi"]) == 0
    held = list(read_jsonl(out(w) / "heldout.jsonl"))
    assert [h["id"] for h in held] == [f"self/heldout-{k:06d}" for k in range(5)]
    assert all([m["role"] for m in h["messages"]] == ["user"] for h in held)
    trained = {m["content"] for c in list(read_jsonl(out(w) / "conversations.jsonl"))
               for m in c["messages"]}
    assert not trained & {h["messages"][0]["content"] for h in held}
    renderer = ChatRenderer(load_tokenizer(targets["kimi"]), {"thinking": True})
    prompts = load_prompt_set(str(out(w) / "heldout.jsonl"), w, renderer)
    assert prompts.ids == [h["id"] for h in held]
    assert prompts.prompts[0] == renderer.prompt_ids(held[0]["messages"])


@pytest.mark.parametrize("kind", ["kimi", "chatml"])
def test_conversations_end_with_a_user_turn_and_have_the_configured_turns(
        targets, tmp_path, monkeypatch, kind):
    scripted(monkeypatch, targets[kind])
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", count=24, turns=TURNS, max_user_tokens=64),
                 targets[kind]) == 0
    convs = list(read_jsonl(out(w) / "conversations.jsonl"))
    counts = {}
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        n = roles.count("user")
        counts[n] = counts.get(n, 0) + 1
        for m in c["messages"]:
            if m["role"] == "assistant":  # the reply's <think> block moved out of its text
                assert m["reasoning_content"].startswith("They ask to")
                assert m["content"].startswith("Here is how to")
    assert set(counts) == {1, 2, 3}
    sw = manifest_entry(w)["self_written"]
    assert sw["user_turns"] == {str(n): k for n, k in sorted(counts.items())}
    assert sw["ended_early"] == {}


def test_replies_close_at_the_templates_end_of_turn_when_the_tokenizer_names_another_eos(
        targets, tmp_path, monkeypatch):
    """transformers 5.17 reads SmolLM2's GGUF with eos <|im_start|>: the replies, closed by
    <|im_end|> as the template closes them, must still count as closed (on one H200 every
    second user turn was lost to 'reply not closed')."""
    target = tmp_path / "other_eos"
    shutil.copytree(targets["chatml"], target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "eos_token": "<|im_start|>"}))
    assert load_tokenizer(target).eos_token == "<|im_start|>"
    scripted(monkeypatch, target)
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", count=24, turns=TURNS, max_user_tokens=64),
                 target) == 0
    sw = manifest_entry(w)["self_written"]
    assert sw["ended_early"] == {} and set(sw["user_turns"]) == {"1", "2", "3"}


def test_a_turn_that_would_not_fit_the_context_limit_ends_the_conversation_early(
        targets, tmp_path, monkeypatch):
    scripted(monkeypatch, targets["kimi"])
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", max_seq_len=128, turns=[[3, 1.0]],
                           reply_max_new_tokens=48), targets["kimi"]) == 0
    convs = list(read_jsonl(out(w) / "conversations.jsonl"))
    assert all([m["role"] for m in c["messages"]] == ["user"] for c in convs)
    assert manifest_entry(w)["self_written"]["ended_early"] == {"context limit": 12}


def test_two_self_written_datasets_share_one_target_and_draw_different_prompts(
        targets, tmp_path, monkeypatch):
    tok = load_tokenizer(targets["kimi"])
    built = []

    def build(cfg, renderer):
        built.append(ScriptedGenerator(tok, tok.convert_tokens_to_ids("<|im_end|>")))
        return built[-1]

    monkeypatch.setattr(selfwritten_run, "build_generator", build)
    block = {"heldout": 0, "max_user_tokens": 64}
    (tmp_path / "r.json").write_text(json.dumps({"datasets": [
        {"name": name, "count": 6, "seed": 0, "self_written": block} for name in ("a", "b")]}))
    assert run01(tmp_path / "w", tmp_path / "r.json", targets["kimi"]) == 0
    texts = {name: [c["messages"][0]["content"] for c in read_jsonl(
        tmp_path / "w" / "01_prepared" / name / "conversations.jsonl")] for name in "ab"}
    assert len(built) == 1 and len(texts["a"]) == len(texts["b"]) == 6
    assert not set(texts["a"]) & set(texts["b"])


# ---------------------------------------------------------------- determinism and resume


def test_same_seed_writes_the_same_files_and_another_seed_does_not(
        targets, tmp_path, monkeypatch):
    real_model(monkeypatch, targets["chatml"], replies_close=True)
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        w = tmp_path / name
        assert run01(w, recipe(tmp_path / f"{name}.json", count=6, heldout=2, seed=seed,
                               turns=[[1, 0.5], [2, 0.5]], reply_max_new_tokens=8),
                     targets["chatml"]) == 0
        runs[name] = [(out(w) / f).read_bytes() for f in ("conversations.jsonl",
                                                          "heldout.jsonl")]
    assert manifest_entry(tmp_path / "a")["self_written"]["user_turns"].get("2")  # multi-turn
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0] and runs["a"][1] != runs["c"][1]


def test_killed_run_resumes_to_the_conversations_of_an_uninterrupted_one(
        targets, tmp_path, monkeypatch):
    real_model(monkeypatch, targets["kimi"], replies_close=True)
    r = recipe(tmp_path / "r.json", count=10, heldout=2, turns=[[1, 0.5], [2, 0.5]],
               reply_max_new_tokens=8)
    assert run01(tmp_path / "whole", r, targets["kimi"]) == 0
    build = selfwritten_run.build_generator
    with monkeypatch.context() as m:  # the 7th generation call dies: round 2 is lost
        m.setattr(selfwritten_run, "build_generator",
                  lambda cfg, renderer: Interrupting(build(cfg, renderer), at=7))
        with pytest.raises(KeyboardInterrupt):
            run01(tmp_path / "killed", r, targets["kimi"])
    cache = next((tmp_path / "killed/01_prepared/.self_written/self").iterdir())
    assert [p.name for p in sorted(cache.glob("round_*.json"))] == ["round_0001.json"]
    assert run01(tmp_path / "killed", r, targets["kimi"]) == 0
    for f in ("conversations.jsonl", "heldout.jsonl"):
        assert (out(tmp_path / "killed") / f).read_bytes() == \
            (out(tmp_path / "whole") / f).read_bytes()
    whole, resumed = (manifest_entry(tmp_path / d)["self_written"] for d in ("whole", "killed"))
    for info in (whole, resumed):
        info.pop("seconds")
    assert resumed == whole and whole["rounds"] >= 2 and whole["user_turns"].get("2")


def test_sigterm_stops_before_the_next_batch_and_a_rerun_finishes_the_same_dataset(
        targets, tmp_path, monkeypatch):
    from eagle3.core.faults import Interrupted

    tok = load_tokenizer(targets["kimi"])
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    class Terminated(ScriptedGenerator):
        def generate_ids(self, *args, **kwargs):
            if len(self.calls) == 6:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only flags it
            return super().generate_ids(*args, **kwargs)

    r = recipe(tmp_path / "r.json", count=30, heldout=0, max_user_tokens=64)
    with monkeypatch.context() as m:
        m.setattr(selfwritten_run, "build_generator", lambda cfg, rd: Terminated(tok, eot))
        with pytest.raises(Interrupted) as e:
            run01(tmp_path / "w", r, targets["kimi"])
    assert e.value.signum == signal.SIGTERM
    scripted(monkeypatch, targets["kimi"])
    assert run01(tmp_path / "w", r, targets["kimi"]) == 0
    assert run01(tmp_path / "whole", r, targets["kimi"]) == 0
    assert (out(tmp_path / "w") / "conversations.jsonl").read_bytes() == \
        (out(tmp_path / "whole") / "conversations.jsonl").read_bytes()


def test_changed_entry_drops_the_rounds_of_the_old_one_and_a_complete_stage_is_a_no_op(
        targets, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    tok = load_tokenizer(targets["kimi"])
    scripted_gen = ScriptedGenerator(tok, tok.convert_tokens_to_ids("<|im_end|>"))
    w = tmp_path / "w"
    with monkeypatch.context() as m:  # killed in its first round: an empty cache is left
        m.setattr(selfwritten_run, "build_generator",
                  lambda cfg, renderer: Interrupting(scripted_gen, at=1))
        with pytest.raises(KeyboardInterrupt):
            run01(w, recipe(tmp_path / "r.json"), targets["kimi"])
    old = [p.name for p in (w / "01_prepared/.self_written/self").iterdir()]
    scripted(monkeypatch, targets["kimi"])
    assert run01(w, recipe(tmp_path / "r.json", temperature=0.7), targets["kimi"]) == 0
    new = [p.name for p in (w / "01_prepared/.self_written/self").iterdir()]
    assert len(old) == len(new) == 1 and old != new
    assert f"dropping the self-written rounds of {old[0]}" in caplog.text
    assert manifest_entry(w)["self_written"]["settings"]["temperature"] == 0.7
    assert run01(w, recipe(tmp_path / "r.json", temperature=0.7), targets["kimi"]) == 0
    assert "already complete" in caplog.text


# ---------------------------------------------------------------- errors


def test_template_that_cannot_be_cut_is_a_one_line_error_before_any_folder(
        targets, tmp_path, capsys):
    target = with_template(targets["kimi"], tmp_path / "t",
                           "{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
                           "{% endfor %}")
    assert run01(tmp_path / "w", recipe(tmp_path / "r.json"), target) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("01_prepare_datasets: recipe t: dataset self (self_written): ")
    assert f"the chat template of {target}" in err and "no special token closes" in err
    assert not (tmp_path / "w").exists()


def test_target_that_writes_no_usable_user_turn_stops_with_the_reasons(
        targets, tmp_path, monkeypatch):
    monkeypatch.setattr(selfwritten_run, "build_generator",
                        lambda cfg, renderer: ListGenerator([]))  # every turn runs on
    with pytest.raises(SelfWrittenError, match=r"kept 0 of 1\d\d user turns .*too long"):
        run01(tmp_path / "w", recipe(tmp_path / "r.json"), targets["kimi"])


@pytest.mark.parametrize("entry,match", [
    ({"path": "x.jsonl"}, "no `path` or `hf_id`"),
    ({"adapter": "sharegpt"}, "adapter openai"),
    ({"count": None}, "needs a count"),
    ({"regenerate": False}, "regenerate must be true"),
    ({"self_written": {"heldout": 1, "temprature": 1.0}}, r"unknown fields \['temprature'\]"),
    ({"self_written": {"turns": [[0, 1.0]]}}, "turns must list"),
    ({"self_written": {"temperature": 0}}, "temperature must be > 0"),
])
def test_bad_self_written_entry_is_a_recipe_error_naming_the_field(tmp_path, entry, match):
    base = {"name": "self", "count": 4, "self_written": {}}
    (tmp_path / "r.json").write_text(json.dumps({"datasets": [{**base, **entry}]}))
    with pytest.raises(RecipeError, match=match):
        load_recipe(tmp_path / "r.json")


def test_shipped_self_written_recipes_load_with_their_documented_settings():
    smol = load_recipe(ROOT / "datasets" / "smollm2_self_written.json").datasets
    assert len(smol) == 1 and smol[0].self_written is not None
    sw = smol[0].self_written
    assert sw.system is None and sw.temperature == 1.0 and sw.max_user_tokens == 96
    assert sw.turns == [[1, 0.6], [2, 0.25], [3, 0.15]] and sw.reply_max_new_tokens == 256
    kimi = load_recipe(ROOT / "datasets" / "kimi_k25_self_written.json").datasets
    assert all(s.self_written is not None and s.max_seq_len >= 8192 for s in kimi)


# ---------------------------------------------------------------- 01b


def test_01b_regenerates_the_last_reply_of_every_self_written_conversation(
        targets, tmp_path, monkeypatch):
    scripted(monkeypatch, targets["kimi"])
    w = tmp_path / "w"
    assert run01(w, recipe(tmp_path / "r.json", count=8, turns=TURNS), targets["kimi"]) == 0
    main01b = importlib.import_module("01b_generate_synthetic").main
    assert main01b(["--workdir", str(w), "--target", str(targets["kimi"]), "--backend", "hf",
                    "--max-new-tokens", "6", "--batch-size", "8"]) == 0
    convs = {c["id"]: c for c in list(read_jsonl(out(w) / "conversations.jsonl"))}
    records = list(read_jsonl(w / "01b_generated" / "self" / "tokenized.jsonl"))
    assert sorted(r["id"] for r in records) == sorted(convs)
    renderer = ChatRenderer(load_tokenizer(targets["kimi"]), {"thinking": True})
    for r in records:
        prompt = renderer.prompt_ids(convs[r["id"]]["messages"])
        assert r["input_ids"][:len(prompt)] == prompt and sum(r["loss_mask"]) >= 1
