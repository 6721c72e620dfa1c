"""The comparison run of the reference benchmark (`--profile h200-compare`): which phase-3 work a
profile names and in which order, the profile's checks, the comparison table (reference/compare.py)
against hand-computed figures, and follow.py starting that profile."""

from __future__ import annotations

import dataclasses

import pytest

from reference.compare import COMPARE_ROWS, comparison_md, comparison_rows
from reference.run_reference import PROFILES

# ---------------------------------------------------------------- profiles


def test_profile_refuses_unknown_or_repeated_phase3_work():
    base = PROFILES["smoke"]
    with pytest.raises(ValueError, match="phase3"):
        dataclasses.replace(base, phase3=("mla", "nope"))
    with pytest.raises(ValueError, match="at most once"):
        dataclasses.replace(base, phase3=("mla", "mla"))


def test_profile_refuses_the_fp8gemm_draft_without_its_04_flags():
    with pytest.raises(ValueError, match="fp8gemm_train"):
        dataclasses.replace(PROFILES["smoke"], phase3=("fp8gemm",), fp8gemm_train=())


def test_compare_profile_keeps_the_h200_sizes_but_the_targets_training_time_and_prompts():
    """What fits one device session: the target trains 120 s instead of 180 s and the sweeps
    use 12 prompts instead of 16 (the profile's comment); everything else is h200's."""
    h200, compare = PROFILES["h200"], PROFILES["h200-compare"]
    for name in ("device", "corpus", "prepare", "generate", "merge", "extract",
                 "draft_vocab", "train", "epochs", "train_max_seq_len", "pack_tokens",
                 "eval_dtype", "sweep_max_new", "teacher_topk"):
        assert getattr(compare, name) == getattr(h200, name), name
    seconds = compare.target.index("--train-seconds") + 1
    assert compare.target[:seconds] + compare.target[seconds + 1:] == (
        h200.target[:seconds] + h200.target[seconds + 1:])
    assert (compare.target[seconds], h200.target[seconds]) == ("120", "180")
    assert (compare.sweep_prompts, h200.sweep_prompts) == (12, 16)


class FakePool:
    """JobPool's interface; records what was submitted, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.jobs: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def python(self, script, args):
        return ["python", str(script), *map(str, args)]

    def submit(self, name, argv, estimate_s=0.0):
        self.jobs.append(name)

    def wait(self):
        return []


def _planned(tmp_path, monkeypatch, profile_name: str):
    """(tasks run, evaluations submitted) of phase 3 under a profile, every task a no-op that
    leaves its draft folder behind."""
    import reference.phase3 as phase3
    from reference.stages import StageRunner
    from reference.steps import PhaseSteps

    pools = []
    monkeypatch.setattr(phase3, "JobPool", lambda *a, **k: pools.append(FakePool()) or pools[-1])
    merged = tmp_path / "main" / "01c_merged"
    merged.mkdir(parents=True)
    (merged / "train.jsonl").write_text('{"seq_len": 100}\n' * 8)
    steps = PhaseSteps(tmp_path, profile_name, PROFILES[profile_name],
                       StageRunner(tmp_path / "results"), 1e12)
    steps.state["seconds_per_token"] = 0.01
    tasks = []

    def task(name, fn, estimate_s=None):
        tasks.append(name)
        if name.startswith("train "):  # what 04 leaves: the draft folder that is evaluated
            (tmp_path / name.split()[1] / "04_train" / "final").mkdir(parents=True)

    monkeypatch.setattr(steps, "task", task)
    phase3.run_phase3(steps)
    return tasks, pools[0].jobs


def test_compare_phase3_trains_and_evaluates_only_the_compared_drafts_in_profile_order(
        tmp_path, monkeypatch):
    tasks, evals = _planned(tmp_path, monkeypatch, "h200-compare")
    order = ["mla", "fp8_all", "topk", "topk_tail", "fp8gemm", "fp8"]
    # 02b of the layouts first (topk_tail reads topk's files), then one 04 after another
    assert tasks == ["extract fp8_all", "extract topk", "extract fp8",
                     *[f"train {n}" for n in order]]
    assert evals == ["main", *order]  # no controls, 05 t1, checkpoints or data sizes
    assert set(evals) == set(COMPARE_ROWS) - {"perstep"}  # issue 18's row: h200-unroll


def test_unroll_phase3_trains_main_alone_beside_the_per_step_draft_on_its_states(
        tmp_path, monkeypatch):
    from reference.stages import StageRunner
    from reference.steps import PhaseSteps

    tasks, evals = _planned(tmp_path, monkeypatch, "h200-unroll")
    assert tasks == ["train perstep"] and evals == ["main", "perstep"]
    steps = PhaseSteps(tmp_path, "h200-unroll", PROFILES["h200-unroll"],
                       StageRunner(tmp_path / "r"), 1e12)
    main, perstep = steps.train_args(steps.main), steps.same_states_args("perstep")
    assert "--ttt-unroll" not in main  # main trains with 04's default, the shared unroll
    assert perstep[-2:] == ["--ttt-unroll", "per-step"]
    assert perstep[:-2] == main  # otherwise the same 04 flags (both read main's states)


def test_h200_phase3_keeps_its_controls_t1_and_sizes_before_and_after_the_drafts(
        tmp_path, monkeypatch):
    tasks, evals = _planned(tmp_path, monkeypatch, "h200")
    assert evals[:5] == ["main", "control_reference", "control_final_state",
                         "control_shifted_layers", "05 t1"]
    assert [t for t in tasks if t.startswith("train ")] == [
        "train fp8", "train fp8_all", "train topk", "train topk_tail", "train mla",
        "train size 4"]  # 8 samples: max(4, 8 / 4) and max(4, 8 / 2), one size
    assert "fp8gemm" not in evals


# ---------------------------------------------------------------- the comparison table


def _sweep(a3, a7, loop=0.1, free=None):
    return {"num_prompts": 16, "max_new_tokens": 160,
            "steps": {"3": {"acceptance_length": a3, "loop_share": loop,
                            "loop_free_acceptance": free},
                      "7": {"acceptance_length": a7, "loop_share": loop,
                            "loop_free_acceptance": free}}}


def _stage(tok_s=None, bytes_per_token=None):
    return {"manifest": {"outputs": {"tok_s": tok_s}},
            "throughput": {"bytes_per_token": bytes_per_token}}


def test_comparison_rows_set_each_draft_against_main_on_its_own_states():
    summary = {
        "sweeps": {"main": _sweep(1.5, 1.6, free=1.45), "mla": _sweep(1.65, 1.6),
                   "topk": _sweep(1.47, 1.52)},
        "stages": {"04 main": _stage(tok_s=100_000), "04 mla": _stage(tok_s=125_000),
                   "04 topk": _stage(tok_s=90_000), "02b main (bf16)": _stage(
                       bytes_per_token=4000.0), "02b topk": _stage(bytes_per_token=2500.0)},
        "draft_params": {"main": 1000, "mla": 800}}
    rows = {r["key"]: r for r in comparison_rows(summary)}
    assert list(rows) == list(COMPARE_ROWS)
    mla, topk, tail = rows["mla"], rows["topk"], rows["topk_tail"]
    assert mla["delta_pct"]["acceptance_3"] == pytest.approx(10.0)
    assert mla["delta_pct"]["acceptance_7"] == pytest.approx(0.0)
    assert mla["delta_pct"]["train_tok_s"] == pytest.approx(25.0)
    assert mla["bytes_per_token"] == 4000.0  # it trained on main's bf16 states
    assert mla["delta_pct"]["bytes_per_token"] == pytest.approx(0.0)
    assert topk["delta_pct"]["bytes_per_token"] == pytest.approx(-37.5)
    assert topk["delta_pct"]["acceptance_3"] == pytest.approx(-2.0)
    assert rows["main"]["steps"]["3"]["loop_free_acceptance"] == 1.45
    assert not tail["evaluated"] and tail["delta_pct"]["acceptance_3"] is None
    assert tail["bytes_per_token"] == 2500.0  # the topk files, measured once
    md = "\n".join(comparison_md(list(rows.values())))
    assert "| MLA, bf16 states | 1.650 (10.0%) | 1.600 (10.0%) | – / – | 800 | 125,000 | 4,000 " \
           "| +10.0% / +0.0% / +25.0% / +0.0% |" in md
    assert "| Llama, fp8-topk tail bucket | not run | not run |" in md
    assert "16 x 160 prompts x tokens" in md



def test_main_stored_in_fp8_is_named_fp8_with_its_own_files_bytes():
    """h200-chat stores main's states in fp8 (02b main (fp8)): the summary must not call them
    bf16, and main's bytes/token are those of the fp8 files."""
    from reference.report import layout_sweeps

    summary = {"sweeps": {"main": _sweep(2.3, 2.6), "mla": _sweep(2.2, 2.5)},
               "stages": {"04 main": _stage(tok_s=250_000),
                          "02b main (fp8)": _stage(bytes_per_token=2921.0)},
               "draft_params": {}}
    rows = {r["key"]: r for r in comparison_rows(summary)}
    assert rows["main"]["label"] == "Llama-style, fp8 states (main)"
    assert rows["main"]["bytes_per_token"] == 2921.0
    assert rows["mla"]["label"] == "MLA, fp8 states" and rows["mla"]["bytes_per_token"] == 2921.0
    assert rows["fp8"]["states_stage"] == "02b fp8"  # a layout run keeps its own files
    md = "\n".join(comparison_md(list(rows.values())))
    assert "bf16 states" not in md
    assert layout_sweeps(summary)[0] == ("fp8 states (main)", "main")
    bf16 = {"sweeps": {}, "stages": {"02b main (bf16)": _stage(bytes_per_token=4600.0)}}
    assert layout_sweeps(bf16)[0] == ("bf16 states", "main")
    assert comparison_rows(bf16)[0]["label"] == "Llama-style, bf16 states (main)"

# ---------------------------------------------------------------- follow.py


def test_follow_starts_the_compare_profile_with_its_deadline(tmp_path, monkeypatch):
    import reference.follow as follow
    from eagle3.core.cli import parse_config
    from reference.run_reference import ReferenceConfig

    started = []

    class Proc:
        pid = 12345

    monkeypatch.setattr(follow.subprocess, "Popen",
                        lambda argv, **kw: started.append(argv[2]) or Proc())
    monkeypatch.setattr(follow, "running", lambda pid_file: False)
    (tmp_path / "ref.rc").write_text("0\n")  # appears as if the run had ended at once
    cfg = parse_config(follow.FollowConfig, ["--workdir", str(tmp_path / "ref"), "--start",
                                             "--profile", "h200-compare", "--deadline-s", "1400"])
    follow.start(cfg, follow.paths(tmp_path / "ref"))
    (command,) = started
    argv = command.split(";")[0].split()[2:]  # after python and the script
    ref = parse_config(ReferenceConfig, argv)
    assert (ref.profile, ref.deadline_s, ref.phase) == ("h200-compare", 1400.0, [1, 2, 3])
    with pytest.raises(SystemExit):
        parse_config(follow.FollowConfig, ["--workdir", "x", "--profile", "h200-compar"])
