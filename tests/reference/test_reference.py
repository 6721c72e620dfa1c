"""The GPU reference benchmark (reference/): its parts against hand-computed cases, and the whole
flow end to end at toy sizes on CPU (`--profile smoke`, every phase)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from reference import build_corpus as bc
from reference.controls import (
    FinalStateProposer,
    detect_eagle_mistake,
    detect_shifted_layers,
    final_state_layers,
    shifted_layers,
)
from reference.loop_share import find_output_ids
from reference.run_reference import PROFILES
from reference.stages import subset_workdir
from reference.train_target import (
    PRESETS,
    ExpertBalancer,
    build_model,
    lr_at,
    packed_rows,
    parameter_counts,
)

# ---------------------------------------------------------------- loop share


def test_find_output_ids_collects_every_output_list_in_nested_results():
    results = {"a": {"output_ids": [1, 2]}, "b": [{"output_ids": [3]}, {"x": 1}]}
    assert find_output_ids(results) == [[1, 2], [3]]


# ---------------------------------------------------------------- corpus

SOURCE = '''"""A module."""
import os

X = 1


@decorator
@other
def first(a):
    return a + 1


class Second:
    def method(self):
        return 2
'''


def test_cut_points_start_a_decorated_definition_at_its_first_decorator():
    lines = SOURCE.splitlines(keepends=True)
    cuts = bc.cut_points(lines)
    assert [lines[c].strip() for c in cuts] == ["@decorator", "class Second:", "def method(self):"]


def test_file_rows_pair_the_text_before_a_cut_with_the_next_definition():
    cfg = bc.CorpusConfig(out=".", min_context_chars=10, min_continuation_chars=10,
                          max_continuation_chars=200)
    rows = bc.file_rows("pkg/mod.py", SOURCE, cfg)
    assert [r["line"] for r in rows] == [7, 13, 14]
    user, reply = (m["content"] for m in rows[0]["messages"])
    assert user.startswith(bc.INSTRUCTION.format(path="pkg/mod.py"))
    assert user.endswith('X = 1\n\n\n```')  # the whole file up to the decorator
    assert reply == "@decorator\n@other\ndef first(a):\n    return a + 1\n"
    assert rows[0]["id"] == "pkg/mod.py:7"
    assert bc.file_rows("pkg/mod.py", SOURCE, cfg, first_only=True) == rows[:1]


def test_file_rows_cap_the_context_and_the_reply_at_whole_lines():
    cfg = bc.CorpusConfig(out=".", min_context_chars=5, max_context_chars=12,
                          min_continuation_chars=5, max_continuation_chars=20)
    row = bc.file_rows("m.py", SOURCE, cfg)[0]
    context = row["messages"][0]["content"].split("```python\n")[1][:-3]
    assert context == "\nX = 1\n\n\n"  # the last whole lines within 12 characters
    assert row["messages"][1]["content"] == "@decorator\n@other\n"


def test_heldout_split_is_stable_by_path_and_near_the_share():
    paths = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    held = [p for p in paths if bc.is_heldout(p, 0.08)]
    assert held == [p for p in paths if bc.is_heldout(p, 0.08)]
    assert 0.065 < len(held) / len(paths) < 0.095


# ---------------------------------------------------------------- target training


def test_lr_at_warms_up_linearly_then_follows_the_cosine_to_the_floor():
    assert lr_at(0, 0.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(50, 0.5, 1.0, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(99, 1.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(99, 3.0, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_packed_rows_cut_one_concatenation_of_the_samples_into_overlapping_rows():
    import itertools

    samples = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    rows = packed_rows(samples, seq_len=3, seed=0, epoch=0)
    assert rows.shape == (2, 4)  # (9 - 1) // 3 rows of seq_len + 1 tokens
    assert rows[0, 3] == rows[1, 0]  # a row's last token is the next row's first input
    prefix = rows[0].tolist() + rows[1, 1:].tolist()
    orders = [sum(p, []) for p in itertools.permutations(samples)]
    assert any(o[:7] == prefix for o in orders)  # whole samples, each once, in some order
    assert torch.equal(rows, packed_rows(samples, 3, seed=0, epoch=0))  # seeded


def test_packed_rows_reshuffle_the_samples_every_epoch():
    samples = [[i, i + 100] for i in range(32)]
    assert not torch.equal(packed_rows(samples, 8, 0, 0), packed_rows(samples, 8, 0, 1))


def test_parameter_counts_match_a_count_by_hand_for_the_smoke_preset():
    s = PRESETS["smoke"]
    model = build_model(s, vocab_size=100, max_positions=64, seed=0)
    counts = parameter_counts(model)
    H, E, I, k = s.hidden_size, s.n_routed_experts, s.moe_intermediate_size, s.num_experts_per_tok
    routed_per_layer = E * 3 * H * I
    moe_layers = s.num_hidden_layers - 1  # the first layer is dense
    assert counts["routed_experts"] == routed_per_layer * moe_layers
    total = sum(p.numel() for p in model.parameters())
    assert counts["total"] == total
    assert counts["active_per_token"] == (total - routed_per_layer * moe_layers * (E - k) // E
                                          - 100 * H)


def test_expert_balancer_raises_the_bias_of_underused_experts():
    model = build_model(PRESETS["smoke"], vocab_size=50, max_positions=64, seed=0).train()
    balancer = ExpertBalancer(model, rate=0.01)
    model(input_ids=torch.randint(0, 50, (2, 16)))
    loads = [load.clone() for load in balancer.loads]
    worst = balancer.step()
    for router, load in zip(balancer.routers, loads):
        bias = router.e_score_correction_bias
        assert torch.equal(bias, 0.01 * torch.sign(load.mean() - load))
        assert load.sum() == 2 * 16 * PRESETS["smoke"].num_experts_per_tok
    assert worst == pytest.approx(max(float(x.max() / x.mean()) for x in loads))
    assert all(float(x.sum()) == 0 for x in balancer.loads)  # counts reset after a step


# ---------------------------------------------------------------- controls


def _tiny_draft(target_model, draft_vocab: int = 100):
    from eagle3.draft.model import DraftConfig, Eagle3Draft

    vocab = target_model.config.vocab_size
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      intermediate_size=128, vocab_size=vocab, draft_vocab_size=draft_vocab,
                      target_hidden_size=64, capture_layers=[2, 4, 5])
    torch.manual_seed(3)
    draft = Eagle3Draft(cfg).eval()
    hot = torch.arange(draft_vocab) * 3 + 1  # d2t: draft id i is target id 3i + 1
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab_mapping(hot - torch.arange(draft_vocab), t2d)
    return draft


def test_final_state_proposer_feeds_the_final_state_without_fc_or_d2t(tiny_target_dir,
                                                                      target_model):
    from eagle3.bench.evaluate import TargetRunner
    from eagle3.core.target import load_embedding
    from eagle3.draft.attention import StepCache

    draft = _tiny_draft(target_model)
    embed = load_embedding(tiny_target_dir)
    ids = [543, 82, 88, 431, 68, 76, 546]
    layers = final_state_layers(target_model.config.num_hidden_layers)
    _, final = TargetRunner(target_model, layers).forward(ids[:-1])
    assert final.shape == (6, 64)  # one H-wide state, not three
    with torch.no_grad():  # reference: the final state on the hidden input, argmax id as is
        out = target_model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True)
        assert torch.allclose(final, out.hidden_states[-1][0])
        logits, _ = draft.step(embed[torch.tensor(ids[1:])][None], final[None],
                               torch.arange(6)[None], StepCache())
    proposer = FinalStateProposer(draft, embed)
    tokens = proposer.propose(ids, final, 1)
    assert tokens == [int(logits[0, -1].argmax())]  # raw draft id: d2t not applied
    assert proposer.draft.fc_calls == 0


def test_shifted_layers_serve_each_capture_one_layer_deeper():
    assert shifted_layers([2, 4, 5]) == [3, 5, 6]


def test_layer_similarity_compares_the_inputs_of_adjacent_decoder_layers(target_model):
    from reference.controls import layer_similarity

    prompts = [[543, 82, 88, 431, 68], [76, 546, 12, 9]]
    inputs = {}  # reference: what enters each decoder layer, caught by hooks
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: inputs.setdefault(i, []).append(
            (kwargs.get("hidden_states", args[0] if args else None))[0].detach()),
        with_kwargs=True) for i, layer in enumerate(target_model.model.layers)]
    try:
        sim = layer_similarity(target_model, prompts, [1, 3])
    finally:
        for h in hooks:
            h.remove()
    for layer in (1, 3):
        a = torch.cat(inputs[layer]).double()
        b = torch.cat(inputs[layer + 1]).double()
        cos = ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).mean().item()
        rel = ((b - a).norm(dim=-1) / a.norm(dim=-1)).mean().item()
        got = sim[str(layer)]
        assert got["served"] == layer + 1 and got["positions"] == 9
        assert got["mean_cosine"] == pytest.approx(cos, abs=1e-5)
        assert got["mean_relative_change"] == pytest.approx(rel, abs=1e-5)
    same = layer_similarity(target_model, prompts, [2], shift=0)["2"]
    assert same["mean_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert same["mean_relative_change"] == pytest.approx(0.0, abs=1e-6)


@pytest.fixture(scope="module")
def exported_draft(tmp_path_factory, target_model):
    from eagle3.draft.export import export_sglang

    return export_sglang(_tiny_draft(target_model), tmp_path_factory.mktemp("draft") / "final")


def test_eagle_mistake_is_refused_by_the_speculative_server_preflight(exported_draft):
    result = detect_eagle_mistake(exported_draft)
    assert result["detected"] and result["correct_passes"]
    assert "EAGLE3" in result["wrong"]["message"]


def test_shifted_layer_ids_are_refused_by_the_draft_preflight(exported_draft, tmp_path,
                                                              target_model):
    result = detect_shifted_layers(exported_draft, [2, 4, 5], 64,
                                   target_model.config.vocab_size, tmp_path)
    assert result["correct_passes"], result["correct_errors"]
    assert result["detected"]
    shifted = json.loads((tmp_path / "shifted_layer_ids" / "config.json").read_text())
    assert shifted["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_subset_workdir_keeps_the_first_train_records_and_the_eval_split(tmp_path):
    src = tmp_path / "main" / "01c_merged"
    src.mkdir(parents=True)
    (src / "train.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)))
    (src / "eval.jsonl").write_text('{"e": 1}\n')
    (src / "manifest.json").write_text(json.dumps({"complete": True, "outputs": {"eval": 1}}))
    w = subset_workdir(tmp_path / "main", tmp_path / "sub", 4)
    lines = (w / "01c_merged" / "train.jsonl").read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == [0, 1, 2, 3]
    assert (w / "01c_merged" / "eval.jsonl").read_text() == '{"e": 1}\n'
    manifest = json.loads((w / "01c_merged" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["outputs"]["train"] == 4


def test_link_states_links_the_first_train_files_and_the_eval_split_with_their_index(tmp_path):
    from eagle3.core import hidden_states as hs
    from eagle3.extract.writer import INDEX_FILE
    from reference.stages import link_states

    src = tmp_path / "main" / "02b_hidden_states"
    for split, n in (("train", 6), ("eval", 2)):
        lines = []
        for i in range(n):
            path = hs.file_path(src / split, i)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"{split}{i}".encode())
            lines.append(json.dumps({"idx": i, "id": f"{split}/{i}", "bytes": 6}) + "\n")
        (src / split / INDEX_FILE).write_text("".join(lines))
    dest = tmp_path / "size_4" / "02b_hidden_states"
    assert link_states(src, dest, 4) == 4 + 2
    for split, n in (("train", 4), ("eval", 2)):
        index = [json.loads(x) for x in (dest / split / INDEX_FILE).read_text().splitlines()]
        assert [e["idx"] for e in index] == list(range(n))
        for i in range(n):  # the same file (a hard link), not a copy
            assert hs.file_path(dest / split, i).stat().st_ino == \
                hs.file_path(src / split, i).stat().st_ino
    assert not hs.file_path(dest / "train", 4).exists()
    assert link_states(src, dest, 4) == 0  # a second call links nothing again
    (dest / "manifest.json").write_text(json.dumps({"complete": True}))
    (dest / "train" / INDEX_FILE).unlink()
    assert link_states(src, dest, 4) == 0  # a complete folder is left alone
    assert not (dest / "train" / INDEX_FILE).exists()


# ---------------------------------------------------------------- command lines


def _script_config(stage: str):
    """The config dataclass a script parses its flags into."""
    import dataclasses

    from reference.stages import script_module

    (cls,) = {v for v in vars(script_module(stage)).values()
              if dataclasses.is_dataclass(v) and v.__name__.endswith("Config")
              and "workdir" in {f.name for f in dataclasses.fields(v)}}
    return cls


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_stage_command_parses_with_its_script(profile, tmp_path):
    from eagle3.core.cli import parse_config
    from reference.stages import StageRunner
    from reference.steps import SAME_STATE_RUNS, PhaseSteps

    p = PROFILES[profile]
    merged = tmp_path / "main" / "01c_merged"
    merged.mkdir(parents=True)
    (merged / "train.jsonl").write_text('{"seq_len": 700}\n' * 40)
    (tmp_path / "target").mkdir()
    for name in ("config.json", "tokenizer_config.json"):  # what the parsers look for
        (tmp_path / "target" / name).write_text("{}")
    steps = PhaseSteps(tmp_path, profile, p, StageRunner(tmp_path / "r"), 0.0)
    commands = {"01": steps.prepare_args("recipe_train.json"), "01b": steps.generate_args(),
                "merge": list(p.merge), "02b": steps.extract_args("fp8"),
                "03": steps.vocab_args(), "04": steps.train_args(tmp_path / "main"),
                "05": steps.bench_args(1.0, 8)}
    commands.update({f"04 {n}": steps.same_states_args(n) for n in SAME_STATE_RUNS
                     if n in p.phase3})
    for label, args in commands.items():
        cfg = parse_config(_script_config(label.split()[0]),
                           ["--workdir", str(tmp_path), *map(str, args)])
        assert cfg.workdir == tmp_path, label
    if "mla" in p.phase3:
        assert parse_config(_script_config("04"), ["--workdir", str(tmp_path), *map(
            str, commands["04 mla"])]).draft_arch == "mla"
    assert steps.state["steps_per_epoch"]["main"] == max(1, 40 * min(700, p.train_max_seq_len)
                                                         // p.pack_tokens)


def test_tasks_skip_past_the_budget_record_optional_failures_and_raise_required_ones(tmp_path):
    import time

    from reference.run_reference import PROFILES
    from reference.stages import StageRunner
    from reference.steps import PhaseSteps

    steps = PhaseSteps(tmp_path, "smoke", PROFILES["smoke"], StageRunner(tmp_path / "r"),
                       time.time() + 100)
    ran = []
    steps.task("cheap", lambda: ran.append("cheap"), estimate_s=1)
    steps.task("cheap", lambda: ran.append("again"), estimate_s=1)  # done: not rerun
    steps.task("long", lambda: ran.append("long"), estimate_s=1000)
    steps.task("broken", lambda: 1 / 0, estimate_s=1)
    assert ran == ["cheap"]
    assert "long" in steps.state["skipped"]
    assert "ZeroDivisionError" in steps.state["failed"]["broken"]
    with pytest.raises(ZeroDivisionError):
        steps.task("required", lambda: 1 / 0)
    saved = json.loads((tmp_path / "results" / "state.json").read_text())
    assert set(saved["done"]) == {"cheap"} and set(saved["skipped"]) == {"long"}


# ---------------------------------------------------------------- the whole flow


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    from reference.run_reference import main

    workdir = tmp_path_factory.mktemp("reference") / "run"
    out = workdir.parent / "out"
    assert main(["--profile", "smoke", "--phase", "1", "2", "3", "--workdir", str(workdir),
                 "--out", str(out)]) == 0
    return workdir, out


def test_smoke_run_completes_every_stage_and_copies_the_summary(smoke_run):
    workdir, out = smoke_run
    stages = json.loads((workdir / "results" / "stages.json").read_text())
    for label in ("corpus", "target", "01 main", "01b main", "merge main", "01 held-out",
                  "02b main (bf16)", "03 main", "04 main", "05 t0", "05 t1", "02b fp8",
                  "04 fp8", "02b fp8_all", "02b topk", "04 fp8_all", "04 topk", "04 topk_tail"):
        assert stages[label]["rc"] == 0, label
        assert stages[label]["wall_s"] > 0
    for name in ("summary.md", "summary.json", "stages.json", "bench_t0_results.json",
                 "controls.json"):
        assert (out / "reference" / name).is_file(), name
    state = json.loads((workdir / "results" / "state.json").read_text())
    assert state["skipped"] == {} and not state.get("failed")
    # Phase 3 ran its evaluations as subprocesses side by side: 05 t1 among them (its peak GPU
    # memory is not measured there, and the report says where it ran).
    (run,) = state["parallel"]["phase3_runs"]
    assert run["jobs"] >= 10 and run["eval_workers"] == 2
    assert stages["05 t1"]["peak_gpu_bytes"] is None and stages["05 t1"]["side_by_side"]
    t1 = json.loads((workdir / "bench_t1" / "05_benchmark" / "results.json").read_text())
    assert "peak_gpu_bytes" in t1 and t1["peak_gpu_bytes"] is None  # 05 reports it on CUDA
    assert stages["05 t1"]["command"].startswith("python 05_benchmark.py --workdir ")
    side = {k for k, d in state["done"].items() if d.get("side_by_side")}
    assert {"eval main", "controls", "05 t1", "eval fp8", "eval fp8_all", "eval topk",
            "eval topk_tail"} <= side
    assert "--topk-teacher tail" in stages["04 topk_tail"]["command"]
    assert len([k for k in side if k.startswith("eval size ")]) == 2
    md = (workdir / "results" / "summary.md").read_text()
    assert "| 05 t1 (side by side) |" in md and "Phase 3 (1 run)" in md


def test_smoke_target_loads_as_a_transformers_model_with_the_project_template(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.tiny.target import CHAT_TEMPLATE, END_OF_TURN, SPECIAL_TOKENS

    target = smoke_run[0] / "target"
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.model_type == "deepseek_v3" and model.config.n_routed_experts > 1
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == END_OF_TURN
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in SPECIAL_TOKENS)
    text = tok.apply_chat_template([{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": "y = 1\n"}], tokenize=False)
    assert text.endswith("<think></think>y = 1\n" + END_OF_TURN)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids(END_OF_TURN)


def test_smoke_heldout_prompts_come_only_from_heldout_files(smoke_run):
    from eagle3.core.records import read_jsonl

    workdir = smoke_run[0]
    split = json.loads((workdir / "corpus" / "split.json").read_text())
    assert split["heldout"] and not set(split["train"]) & set(split["heldout"])
    trained = {r["id"].split("/", 1)[1].rsplit(":", 1)[0]
               for s in ("train", "eval") for r in read_jsonl(workdir / "main/01c_merged" /
                                                               f"{s}.jsonl")}
    assert trained and trained <= set(split["train"])
    prompts = json.loads((workdir / "bench_t0/05_benchmark/results.json").read_text())
    used = [i.split("/", 1)[1].rsplit(":", 1)[0]
            for r in prompts["prompt_sets"].values() for i in r["prompt_ids"]]
    assert used and set(used) <= set(split["heldout"])


def test_smoke_summary_reports_every_required_figure(smoke_run):
    s = json.loads((smoke_run[0] / "results" / "summary.json").read_text())
    for t, temperature in (("t0", 0.0), ("t1", 1.0)):
        bench = s["bench"][t]
        assert bench["temperature"] == temperature
        (prompt_set,) = bench["sets"].values()
        assert set(prompt_set["steps"]) == {"3", "7"}
        for steps, m in prompt_set["steps"].items():
            assert 1.0 <= m["acceptance_length"] <= int(steps) + 1
            assert len(m["per_position_acceptance"]) == int(steps)
            assert 0.0 <= m["loop"]["share"] <= 1.0
        assert 0.0 <= prompt_set["baseline_loop"]["share"] <= 1.0
        assert prompt_set["baseline_tok_s"] > 0
    assert all(m["lossless_mismatches"] == 0
               for m in s["bench"]["t0"]["sets"]["conversations"]["steps"].values())
    sweeps = s["sweeps"]
    assert {"main", "fp8", "fp8_all", "topk", "topk_tail", "control_reference",
            "control_final_state", "control_shifted_layers"} <= set(sweeps)
    assert set(sweeps["topk_tail"]["steps"]) == {"3", "7"}
    assert len([k for k in sweeps if k.startswith("size_")]) == 2  # + main: three sizes
    assert [k for k in sweeps if k.startswith("ckpt_")]  # checkpoints before the final one
    assert sweeps["control_shifted_layers"]["capture_layers"] == shifted_layers(
        sweeps["main"]["capture_layers"])
    sim = sweeps["control_shifted_layers"]["layer_similarity"]
    assert [int(k) for k in sim] == sweeps["main"]["capture_layers"]
    assert all(-1 <= v["mean_cosine"] <= 1 and v["positions"] > 0 for v in sim.values())
    for name in ("final_state", "shifted_layers"):
        assert s["controls"][name]["detected"] is True
    two = s["stages"]["02b main (bf16)"]["throughput"]
    eight = s["stages"]["02b fp8"]["throughput"]
    assert eight["bytes_per_token"] < two["bytes_per_token"]  # fp8 aux states are smaller
    compact = [s["stages"][f"02b {n}"]["throughput"]["bytes_per_token"] for n in ("fp8_all",
                                                                                  "topk")]
    assert max(compact) < two["bytes_per_token"]  # at hidden 64 the file overhead decides
    assert s["target"]["parameters"]["total"] > 0 and math.isfinite(s["target"]["heldout_loss"])
    md = (smoke_run[0] / "results" / "summary.md").read_text()
    for heading in ("Acceptance on held-out prompts", "bf16 vs fp8", "training data size",
                    "epochs", "Controls"):
        assert heading in md


def test_smoke_rerun_redoes_nothing(smoke_run):
    from reference.run_reference import main

    workdir, _ = smoke_run
    before = json.loads((workdir / "results" / "stages.json").read_text())
    done = json.loads((workdir / "results" / "state.json").read_text())["done"]
    assert main(["--profile", "smoke", "--phase", "1", "2", "3", "--workdir", str(workdir)]) == 0
    assert json.loads((workdir / "results" / "stages.json").read_text()) == before
    assert json.loads((workdir / "results" / "state.json").read_text())["done"] == done


def test_smoke_summary_compares_every_draft_with_main_from_the_runs_own_files(smoke_run):
    from reference.compare import COMPARE_ROWS
    from reference.report import draft_params

    workdir = smoke_run[0]
    s = json.loads((workdir / "results" / "summary.json").read_text())
    rows = {r["key"]: r for r in s["comparison"]}
    assert list(rows) == list(COMPARE_ROWS)
    for key in ("main", "mla", "fp8", "fp8_all", "topk", "topk_tail"):
        row, (_, train, states) = rows[key], COMPARE_ROWS[key]
        assert row["evaluated"], key
        for steps in ("3", "7"):
            m = s["sweeps"][key]["steps"][steps]
            assert row["steps"][steps]["acceptance"] == m["acceptance_length"]
            assert 1.0 <= m["acceptance_length"] <= int(steps) + 1
            assert 0.0 <= row["steps"][steps]["loop_share"] <= 1.0
        assert row["parameters"] == draft_params(workdir / key / "04_train" / "final") > 0
        assert row["train_tok_s"] == s["stages"][train]["manifest"]["outputs"]["tok_s"] > 0
        assert row["bytes_per_token"] == s["stages"][states]["throughput"]["bytes_per_token"]
        accept = [row["steps"][k]["acceptance"] / rows["main"]["steps"][k]["acceptance"]
                  for k in ("3", "7")]
        assert [row["delta_pct"][f"acceptance_{k}"] for k in ("3", "7")] == pytest.approx(
            [100 * (a - 1) for a in accept])
    assert rows["mla"]["parameters"] != rows["main"]["parameters"]  # another architecture
    assert rows["mla"]["bytes_per_token"] == rows["main"]["bytes_per_token"]  # the same states
    assert rows["topk"]["delta_pct"]["bytes_per_token"] < 0
    assert not rows["fp8gemm"]["evaluated"]  # not in the smoke profile's phase 3
    md = (workdir / "results" / "summary.md").read_text()
    assert "### Drafts compared" in md and "| MLA, bf16 states | " in md


def test_smoke_fp8gemm_draft_trains_on_mains_states_and_joins_the_comparison(smoke_run):
    """After the smoke run: phase 3 again with only the fp8gemm draft (04 --fp8-gemm on, CPU)."""
    import dataclasses
    import time

    from reference.report import write_report
    from reference.run_reference import PROFILES
    from reference.stages import StageRunner
    from reference.steps import PhaseSteps

    workdir = smoke_run[0]
    profile = dataclasses.replace(PROFILES["smoke"], phase3=("fp8gemm",),
                                  train_precision=("--fp8-gemm", "off"),
                                  fp8gemm_train=("--fp8-gemm", "on"))
    steps = PhaseSteps(workdir, "smoke", profile, StageRunner(workdir / "results"),
                       time.time() + 3600)
    steps.run_phase(3)
    record = json.loads((workdir / "results" / "stages.json").read_text())["04 fp8gemm"]
    assert record["rc"] == 0 and "--fp8-gemm on" in record["command"]
    assert "--fp8-gemm off" not in record["command"]
    assert ((workdir / "fp8gemm" / "02b_hidden_states").resolve()
            == (workdir / "main" / "02b_hidden_states").resolve())
    rows = {r["key"]: r for r in write_report(workdir, "smoke")["comparison"]}
    assert rows["fp8gemm"]["evaluated"] and rows["fp8gemm"]["train_tok_s"] > 0
    assert rows["fp8gemm"]["parameters"] == rows["main"]["parameters"]  # the same draft shape
    assert rows["fp8gemm"]["delta_pct"]["acceptance_3"] is not None


def test_diverse_chat_profile_writes_a_steered_long_recipe_with_the_human_prompts(tmp_path):
    """h200-chat-diverse: >= 60,000 steered conversations (the axes read from the shipped
    diverse recipe), long turns with cut replies kept, the human-written training source beside
    (its path absolute), and 05 on the human-written sets by context bucket."""
    from eagle3.prepare.recipes import load_recipe
    from reference.stages import StageRunner
    from reference.steps import DATASETS_DIR, PhaseSteps

    p = PROFILES["h200-chat-diverse"]
    steps = PhaseSteps(tmp_path, "h200-chat-diverse", p, StageRunner(tmp_path / "r"), 0.0)
    recipe = load_recipe(steps.write_self_written_recipe())
    main, human = recipe.datasets
    shipped = load_recipe(DATASETS_DIR / "smollm2_self_written_diverse.json").datasets[0]
    assert main.count >= 60000 and main.self_written.steer == shipped.self_written.steer
    assert main.self_written.keep_cut_replies and main.self_written.max_turns == 6
    assert main.max_seq_len == 4096 and p.train_max_seq_len == 4096
    assert human.name == "human_train" and human.path.is_file()
    args = [str(a) for a in steps.bench_args(0.0, 8)]
    sets = args[args.index("--prompt-sets") + 1:args.index("--num-prompts")]
    assert sets[1:] == ["chat", "human_chat", "human_code"]
    assert args[args.index("--context-bucket-tokens") + 1] == "512"
