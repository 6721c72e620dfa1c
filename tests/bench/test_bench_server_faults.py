"""Stage 05 against servers that misbehave on cue (tests/bench_fake_server.py): each fault kind
ends in a retry that recovers, or in a failure line for that prompt that no figure counts;
never a hang, never a cut answer measured as good.

| fault (FAULTS)              | once (transient)       | every time (one prompt)                  |
|-----------------------------|------------------------|------------------------------------------|
| http500, hang, drop, eof,   | retried, figures exact | failed_requests.jsonl, counted, left out |
| count, short                |                        | of tokens/s and acceptance               |
| /metrics garbage or missing | -                      | vLLM acceptance None with the reason     |
| server never ready          | -                      | BenchmarkError after --ready-timeout-s   |
| server down                 | -                      | BenchmarkError naming the URL            |
"""

from __future__ import annotations

import importlib
import json
import time

import pytest
from bench_fake_server import FAULTS, FakeBenchServer
from bench_helpers import fake_sglang_shim, free_port, make_tiny_draft, port_is_open

from eagle3.bench.faults import BadAnswer, BenchmarkError, check_answer
from eagle3.bench.measure import LoadSettings
from eagle3.bench.prompts import PromptSet
from eagle3.bench.sglang import measure_server
from eagle3.bench.vllm import measure_vllm_server
from eagle3.core.stage import StageError

SPEC_INFO = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
# Prompts of 3..6 ids: the fake answers L + 2 tokens (5..8), 2, 2, 2, 3 verify rounds at 3
# tokens a round. Prompt "c" (first id 8) is the one cued to fail.
PROMPTS = PromptSet("toy", [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [1, 1, 1, 1, 1, 1]],
                    ["a", "b", "c", "d"])
ALL = (5 + 6 + 7 + 8) / (2 + 2 + 2 + 3)
WITHOUT_C = (5 + 6 + 8) / (2 + 2 + 3)


class Sink(list):
    write = list.append


def _load(retries: int = 2, timeout_s: float = 5.0, stream: bool = True) -> LoadSettings:
    return LoadSettings({"max_new_tokens": 64, "temperature": 0.0}, stream, False, timeout_s,
                        retries, 0.01)


def test_check_answer_refuses_miscounted_cut_and_aborted_answers():
    check_answer([1, 2], {"completion_tokens": 2, "finish_reason": {"type": "stop"}}, 8, "r")
    check_answer([1] * 8, {"completion_tokens": 8, "finish_reason": None}, 8, "r")  # all asked
    for ids, meta, match in (
            ([1, 2], {"completion_tokens": 5}, "completion_tokens 5 but 2"),
            ([1, 2], {"completion_tokens": 2, "finish_reason": None}, "answer was cut"),
            ([1], {"finish_reason": {"type": "abort", "message": "x"}}, "aborted")):
        with pytest.raises(BadAnswer, match=match):
            check_answer(ids, meta, 8, "r")


def test_measure_server_retries_each_transient_fault_and_measures_exactly():
    # Prompt "c" meets the six kinds in turn, then an answer: its 7th attempt is measured.
    requests = Sink()
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0,
                         faults={8: list(FAULTS)}) as url:
        s = measure_server(url, "r", [PROMPTS], [1], _load(retries=6, timeout_s=1.0),
                           requests)["toy"]["1"]
    assert s["failed_requests"] == 0 and s["requests"] == 4 and s["retried_requests"] == 1
    assert s["acceptance_length"] == pytest.approx(ALL)
    assert s["completion_tokens"] == 5 + 6 + 7 + 8
    assert [r["attempts"] for r in requests if r["prompt_id"] == "c"] == [len(FAULTS) + 1]


@pytest.mark.parametrize("kind", FAULTS)
def test_measure_server_lists_a_prompt_that_always_fails_and_counts_only_the_others(kind):
    requests, failed = Sink(), Sink()
    t0 = time.monotonic()
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0, faults={8: kind}) as url:
        out = measure_server(url, "speculative", [PROMPTS], [1], _load(1, timeout_s=0.5),
                             requests, failed_sink=failed)
    assert time.monotonic() - t0 < 10  # a hang costs (retries + 1) x the request timeout
    s = out["toy"]["1"]
    assert (s["requests"], s["failed_requests"]) == (3, 1)
    assert s["acceptance_length"] == pytest.approx(WITHOUT_C)  # the cut answer is in no figure
    assert s["completion_tokens"] == 5 + 6 + 8
    assert {r["prompt_id"] for r in requests} == {"a", "b", "d"}
    (line,) = failed
    assert line["prompt_id"] == "c" and line["attempts"] == 2 and line["role"] == "speculative"
    assert line["reason"]


def test_measure_server_gives_up_a_level_when_every_request_fails():
    with FakeBenchServer({}, once=["http500"] * 200) as url:
        failed = Sink()
        s = measure_server(url, "baseline", [PROMPTS], [2], _load(1), failed_sink=failed)
    s = s["toy"]["2"]
    assert s["requests"] == 0 and s["failed_requests"] == 4
    assert s["acceptance_length"] is None and s["completion_tokens"] == 0
    assert any(line["attempts"] == 0 for line in failed) or len(failed) == 4


def test_vllm_acceptance_from_metrics_equals_the_scripted_rounds():
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(), "fake")["toy"]["1"]
    assert s["acceptance_length"] == pytest.approx((4 + 5 + 6 + 7) / (2 + 2 + 2 + 3))
    assert s.get("metrics_error") is None


@pytest.mark.parametrize("fault,reason", [("garbage", "not Prometheus"), ("missing", "404")])
def test_vllm_acceptance_is_left_out_when_metrics_are_garbage_or_missing(fault, reason):
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0,
                         metrics_fault=fault) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(1), "fake")["toy"]["1"]
    assert s["acceptance_length"] is None and s["tokens_per_round"] is None
    assert reason in s["metrics_error"]
    assert s["requests"] == 4 and s["total_tok_s"] > 0  # the speed is still measured


@pytest.mark.parametrize("kind", ["count", "short", "eof"])
def test_vllm_a_failed_prompt_leaves_the_servers_counters_unused(kind):
    failed = Sink()
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0, faults={8: kind}) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(1), "fake",
                                failed_sink=failed)["toy"]["1"]
    assert s["failed_requests"] == 1 and len(failed) == 1
    assert s["acceptance_length"] is None and "1 failed" in s["metrics_error"]


# ---------------------------------------------------------------- 05_benchmark.py end to end


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir, tmp_path_factory):
    return make_tiny_draft(tiny_target_dir, tmp_path_factory.mktemp("draft") / "final")


def _argv(workdir, target, draft, *extra):
    return ["--workdir", str(workdir), "--target", str(target), "--draft", str(draft),
            "--backend", "sglang", "--prompt-sets", "math", "--num-prompts", "3",
            "--max-new-tokens", "16", "--concurrency", "1", "--retries", "1",
            "--retry-delay-s", "0.01", "--request-timeout-s", "2", *extra]


def _bench(argv):
    return importlib.import_module("05_benchmark").main(argv)


def test_benchmark_lists_failed_requests_and_exits_1_when_a_prompt_always_fails(
        tmp_path, tiny_target_dir, tiny_draft, tokenizer, capsys):
    from eagle3.bench.prompts import load_prompt_set
    from eagle3.core.chat import ChatRenderer

    first = load_prompt_set("math", tmp_path, ChatRenderer(tokenizer), 3).prompts
    # Every math prompt opens with the same template ids: cue the fault on all of them, once
    # each for the baseline, so that the speculative server is measured whole.
    with FakeBenchServer({}, step_s=0.0, faults={first[0][0]: "short"}) as base, \
            FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0) as spec:
        rc = _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                          "--spec-url", spec))
    assert rc == 1
    out = tmp_path / "05_benchmark"
    results = json.loads((out / "results.json").read_text())
    row = results["prompt_sets"]["math"]["1"]
    assert row["baseline"]["failed_requests"] == 3 and row["speculative"]["failed_requests"] == 0
    assert row["speedup"] is None  # no good baseline request: nothing to compare with
    assert results["failed_requests"] == 3
    failed = [json.loads(x) for x in (out / "failed_requests.jsonl").read_text().splitlines()]
    assert len(failed) == 3 and all("answer was cut" in f["reason"] for f in failed)
    assert "FAILED" in (out / "report.md").read_text()
    assert "failed requests" in capsys.readouterr().out


def test_benchmark_stops_with_one_error_when_a_server_is_down(tmp_path, tiny_target_dir,
                                                             tiny_draft):
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3) as spec:
        with pytest.raises(BenchmarkError, match="127.0.0.1"):
            _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", dead,
                         "--spec-url", spec))


def test_benchmark_gives_up_on_a_launched_server_that_never_gets_ready(
        tmp_path, tiny_target_dir, tiny_draft, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", fake_sglang_shim(tmp_path))
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(StageError, match="not ready after 2s"):
        _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--launch-args",
                     "--model-path m --load-seconds 60", "--port", str(port),
                     "--ready-timeout-s", "2"))
    assert time.monotonic() - t0 < 30
    assert not port_is_open(port)  # the server 05 started is stopped
