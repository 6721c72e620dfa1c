"""benchmarks/bench_serve_vllm.py's own arithmetic, without a server: the requests a 05 level
sends (checked against 05's run_level), the offline acceptance over them, the profiler trace's
split of a decode step, the table and the time lines. The served path is
tests/bench/test_serve_reference_draft.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_serve_vllm",
                                               ROOT / "benchmarks/bench_serve_vllm.py")
bench = sys.modules["bench_serve_vllm"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # registered first: dataclasses look their module up


def test_served_prompts_are_the_good_speculative_requests_of_each_level(tmp_path):
    lines = [{"role": "baseline", "prompt_set": "chat", "concurrency": 1, "prompt_index": 0},
             {"role": "speculative", "prompt_set": "chat", "concurrency": 1, "prompt_index": 0},
             {"role": "speculative", "prompt_set": "chat", "concurrency": 4, "prompt_index": 1},
             {"role": "speculative", "prompt_set": "chat", "concurrency": 4, "prompt_index": 1},
             {"role": "speculative", "prompt_set": "code", "concurrency": 4, "prompt_index": 2}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert bench.served_prompts(path) == {("chat", "1"): [0], ("chat", "4"): [1, 1],
                                          ("code", "4"): [2]}


def test_offline_acceptance_over_requests_weights_each_prompt_by_its_requests():
    lengths = [[4, 4], [1, 1, 1, 1]]  # prompt 0: 8 tokens in 2 rounds; prompt 1: 4 in 4
    assert bench.offline_over_requests(lengths, [0, 1]) == (12 / 6, 6)
    assert bench.offline_over_requests(lengths, [0, 1, 0, 1, 0]) == (pytest.approx(32 / 14), 14)


def _span(name, ts, dur, pid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": 1}


def test_parse_trace_splits_decode_steps_and_leaves_out_prefill_steps(tmp_path):
    # vLLM 0.32.0's layout: the step's span covers execute_model (preprocess, the target's
    # forward, postprocess); sample_tokens (the rejection sampler, the draft) follows outside it
    events = [
        _span("execute_context_1(40)_generation_0(0)", 0, 5000),  # prefill: not a round
        _span("gpu_model_runner: forward", 100, 4000),
        _span("gpu_model_runner: draft", 5100, 400),
        _span("execute_context_1(40)_generation_1(4)", 10000, 3000),  # mixed: left out
        _span("gpu_model_runner: forward", 10100, 2000),
        _span("execute_context_0(0)_generation_2(8)", 20000, 700),
        _span("gpu_model_runner: forward", 20050, 600),
        _span("gpu_model_runner: sample", 20710, 40),
        _span("gpu_model_runner: draft", 20760, 250),
        _span("gpu_model_runner: bookkeep", 21010, 90),  # the step ends here: 1.1 ms
        _span("gpu_model_runner: draft", 20800, 999, pid=2),  # another process: not this step
        _span("execute_context_0(0)_generation_0(0)", 25000, 10),  # nothing to decode
        _span("execute_context_0(0)_generation_2(8)", 30000, 1100),
        _span("gpu_model_runner: forward", 30000, 1000),
        _span("gpu_model_runner: sample", 31200, 100),
        _span("gpu_model_runner: draft", 31300, 750),
        _span("gpu_model_runner: ModelRunnerOutput", 32050, 850),  # the step ends: 2.9 ms
        {"ph": "i", "name": "gpu_model_runner: draft", "ts": 31400},  # an instant: no time
    ]
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    split = bench.parse_trace(path)
    assert split["decode_steps"] == 2 and split["mixed_steps_left_out"] == 1
    assert split["scheduled_tokens"] == [8]
    ms = split["ms_per_step"]
    assert ms["step"] == pytest.approx((1.1 + 2.9) / 2)
    assert ms["verify_forward"] == pytest.approx(0.8)
    assert ms["sampling"] == pytest.approx(0.07)
    assert ms["draft"] == pytest.approx(0.5)
    assert ms["other"] == pytest.approx(2.0 - 0.8 - 0.07 - 0.5)


def test_table_and_time_lines_print_every_level_and_dashes_for_missing_figures():
    rows = [{"prompt_set": "chat", "concurrency": 1, "plain_tok_s": 20.0, "spec_tok_s": 26.0,
             "ratio": 1.3, "served_acceptance": 1.8, "served_rounds": 100.0,
             "served_tokens_per_round": 1.79, "served_loop_share": 0.06, "offline_acceptance": 1.8,
             "offline_rounds": 100, "offline_loop_share": 0.06,
             "acceptance_diff": 0.0, "outputs_equal_to_plain": 4, "outputs_compared": 4,
             "plain_ms_per_step": 50.0, "spec_ms_per_round": 70.0},
            {"prompt_set": "chat", "concurrency": 4, "plain_tok_s": None, "spec_tok_s": 50.0,
             "ratio": None, "served_acceptance": None, "served_rounds": None,
             "served_loop_share": None,
             "served_tokens_per_round": None, "outputs_equal_to_plain": 0,
             "outputs_compared": 4, "plain_ms_per_step": None, "spec_ms_per_round": None,
             "acceptance_error": "the spec-decode counters went backwards"}]
    settings = {"max_new_tokens": 64, "steps": 3, "launch_args": "--x", "threads": 2}
    text = bench.table(rows, {"chat": 4}, settings)
    assert "1.30x" in text and "1.800 (100, 6%)" in text and "+0.000" in text and "4/4" in text
    assert "   4 |           - |       50.0 |      - |" in text
    assert "c=4: served acceptance left out: the spec-decode counters went backwards" in text
    split = {"1": {"decode_steps": 10, "scheduled_tokens": [4], "ms_per_step": {
        "step": 80.0, "verify_forward": 48.0, "sampling": 2.0, "draft": 24.0, "other": 6.0}}}
    lines = "\n".join(bench.time_lines(rows, split, 3))
    assert "a plain step 50.0 ms, a speculative round 70.0 ms for 1.79 tokens" in lines
    assert "break-even needs 1.40 tokens a round" in lines
    assert "draft (3 steps) 24.0 (30%)" in lines
    assert "draft 21.0 ms, verify (forward + sampling) 43.8 ms" in lines
