"""Stage 05 against servers that misbehave on cue (tests/bench_fake_server.py): each fault kind
ends in a retry that recovers, or in a failure line for that prompt that no figure counts;
never a hang, never a cut answer measured as good, never a figure that cannot be.

| fault (FAULTS, LIES)              | once (transient)  | every time                             |
|-----------------------------------|-------------------|----------------------------------------|
| http500, hang, drop, eof, count,  | retried, figures  | failed_requests.jsonl, counted, left   |
| short; overlong, prompt_count,    | exact             | out of tokens/s and acceptance         |
| verify_excess/few/negative        |                   |                                        |
| legal SSE (CRLF, comments, ...),  | -                 | measured as the plain answers          |
| null optional counts              |                   |                                        |
| no verify rounds reported         | -                 | acceptance "-" with the reason         |
| outputs != baseline's at T = 0    | -                 | lossless_mismatches, flagged, exit 1   |
| /metrics garbage, missing, NaN,   | -                 | vLLM acceptance "-" with the reason    |
| or counts that cannot be          |                   |                                        |
| /server_info a web page           | -                 | one line, exit 1 (also --check-only)   |
| server never ready                | -                 | BenchmarkError after --ready-timeout-s |
| server down                       | -                 | BenchmarkError naming the URL          |
"""

from __future__ import annotations

import importlib
import json
import time

import pytest
from bench_fake_server import FAULTS, FakeBenchServer
from bench_helpers import fake_sglang_shim, free_port, make_tiny_draft, port_is_open

from eagle3.bench.faults import (
    AnswerCounts,
    AnswerLimits,
    BadAnswer,
    BenchmarkError,
    check_answer,
)
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
    limits = AnswerLimits(max_new_tokens=8, prompt_tokens=3)
    check_answer([1, 2], {"completion_tokens": 2, "finish_reason": {"type": "stop"}}, limits, "r")
    check_answer([1] * 8, {"completion_tokens": 8, "finish_reason": None}, limits, "r")
    for ids, meta, match in (
            ([1, 2], {"completion_tokens": 5}, "completion_tokens 5 but 2"),
            ([1, 2], {"completion_tokens": 2, "finish_reason": None}, "answer was cut"),
            ([1], {"finish_reason": {"type": "abort", "message": "x"}}, "aborted")):
        with pytest.raises(BadAnswer, match=match):
            check_answer(ids, meta, limits, "r")


def test_check_answer_holds_a_fixed_length_request_to_every_token():
    """ignore_eos sent (05 --ignore-eos): an answer that stopped early, even with a stop reason,
    is not the workload asked for."""
    limits = AnswerLimits(max_new_tokens=8, prompt_tokens=3, fixed_length=True)
    check_answer([1] * 8, {"completion_tokens": 8, "finish_reason": {"type": "length"}}, limits,
                 "r")
    with pytest.raises(BadAnswer, match="3 of 8 tokens with ignore_eos sent"):
        check_answer([1] * 3, {"completion_tokens": 3, "finish_reason": {"type": "stop"}},
                     limits, "r")


STOP = {"finish_reason": {"type": "stop"}}


def test_check_answer_refuses_every_count_that_cannot_be_and_reads_null_as_not_reported():
    limits = AnswerLimits(max_new_tokens=8, prompt_tokens=3, round_tokens=4)  # 3 steps
    counts = check_answer([1] * 8, {**STOP, "completion_tokens": None, "prompt_tokens": None,
                                    "cached_tokens": None, "spec_verify_ct": None}, limits, "r")
    assert counts == AnswerCounts(8, 3, 0, None)
    assert check_answer([1] * 8, {**STOP, "spec_verify_ct": 2}, limits, "r").spec_verify_ct == 2
    check_answer([1] * 8, {**STOP, "spec_verify_ct": 8}, limits, "r")  # 1 token a round
    for ids, meta, match in (
            ([1] * 9, {}, "9 tokens, more than max_new_tokens 8"),
            ([1, -2], {}, "not token ids"), ([1, 2.0], {}, "not token ids"),
            ([1], {"prompt_tokens": 4}, "counted 4 prompt tokens, 3 were sent"),
            ([1], {"cached_tokens": 4}, "cached_tokens 4 of a 3-token prompt"),
            ([1], {"completion_tokens": True}, "completion_tokens is True, not a count"),
            ([1], {"cached_tokens": "0"}, "cached_tokens is '0', not a count"),
            ([1] * 8, {"spec_verify_ct": -1}, "spec_verify_ct is -1, not a count"),
            ([1] * 8, {"spec_verify_ct": 2.5}, "spec_verify_ct is 2.5, not a count"),
            ([1] * 4, {"spec_verify_ct": 5}, "5 for 4 tokens: more verify rounds than tokens"),
            ([1] * 8, {"spec_verify_ct": 1}, "8 tokens in 1 verify rounds: more than 4")):
        with pytest.raises(BadAnswer, match=match):
            check_answer(ids, {**STOP, **meta}, limits, "r")
    with pytest.raises(BadAnswer, match="meta_info is None"):
        check_answer([1], None, limits, "r")


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


@pytest.mark.parametrize("dialect", [{}, {"sse_dialect": "legal"}, {"once": ["nulls"] * 50}],
                         ids=["plain", "legal SSE", "null counts"])
@pytest.mark.parametrize("stream", [True, False])
def test_vllm_acceptance_from_metrics_equals_the_scripted_rounds(dialect, stream):
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0, **dialect) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(stream=stream),
                                "fake")["toy"]["1"]
    assert s["failed_requests"] == 0 and s["completion_tokens"] == 5 + 6 + 7 + 8
    assert s["acceptance_length"] == pytest.approx((4 + 5 + 6 + 7) / (2 + 2 + 2 + 3))
    assert s.get("acceptance_error") is None


@pytest.mark.parametrize("fault,reason", [("garbage", "unusable"), ("missing", "404"),
                                          ("nan", "accepted_tokens_total is nan: not a count")])
def test_vllm_acceptance_is_left_out_when_metrics_are_garbage_or_missing(fault, reason):
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0,
                         metrics_fault=fault) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(1), "fake")["toy"]["1"]
    assert s["acceptance_length"] is None and s["tokens_per_round"] is None
    assert reason in s["acceptance_error"]
    assert s["requests"] == 4 and s["total_tok_s"] > 0  # the speed is still measured


@pytest.mark.parametrize("kind", ["count", "short", "eof"])
def test_vllm_a_failed_prompt_leaves_the_servers_counters_unused(kind):
    failed = Sink()
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0, faults={8: kind}) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(1), "fake",
                                failed_sink=failed)["toy"]["1"]
    assert s["failed_requests"] == 1 and len(failed) == 1
    assert s["acceptance_length"] is None and "1 failed" in s["acceptance_error"]


@pytest.mark.parametrize("k,reason", [
    (3, "counters that cannot be this level's (36 accepted of 27 drafted tokens"),
    (1, "more than K = 1 a round"),
])
def test_vllm_acceptance_is_left_out_when_the_counters_cannot_be_the_levels(k, reason):
    # 9 rounds of 3 drafted tokens; "inflated": each accepts 4 of them. K = 1: 3 drafted a round
    # by a server said to draft 1
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0,
                         metrics_fault="inflated" if k == 3 else None) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(), "fake",
                                num_speculative_tokens=k)["toy"]["1"]
    assert s["acceptance_length"] is None and reason in s["acceptance_error"]


def test_vllm_acceptance_names_the_reason_when_a_speculative_server_counts_no_rounds():
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=None, step_s=0.0) as url:
        s = measure_vllm_server(url, "speculative", [PROMPTS], [1], _load(), "fake",
                                num_speculative_tokens=3)["toy"]["1"]
    assert s["acceptance_length"] is None and s["requests"] == 4
    assert "no verify rounds counted over 4 answers" in s["acceptance_error"]


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


# ---------------------------------------------------------------- servers that lie


def _pair(tmp_path, target, draft, capsys, base: dict | None = None, spec: dict | None = None,
          extra: tuple[str, ...] = ()) -> tuple[int, dict | None, str, str]:
    """05 through its entry point against a baseline and a speculative fake server (`base`,
    `spec`: their FakeBenchServer arguments): (exit code, results.json, report.md, stderr)."""
    from eagle3.core.faults import script_main

    spec = {"tokens_per_verify": 3, **(spec or {})}
    with FakeBenchServer({}, step_s=0.0, **(base or {})) as b, \
            FakeBenchServer(SPEC_INFO, step_s=0.0, **spec) as s:
        capsys.readouterr()
        rc = script_main(lambda: _bench(_argv(tmp_path, target, draft, "--baseline-url", b,
                                              "--spec-url", s, *extra)), "05")
    captured = capsys.readouterr()
    print(captured.out, end="")  # the closing summary stays readable by the caller's capsys
    err = captured.err
    assert "Traceback" not in err
    out = tmp_path / "05_benchmark"
    results = json.loads((out / "results.json").read_text()) \
        if (out / "results.json").exists() else None
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    return rc, results, report, err


EVERY = 50  # cue a kind on this many requests in a row: every request of a run


@pytest.mark.parametrize("lie,words", [("overlong", "19 tokens, more than max_new_tokens 16"),
                                       ("prompt_count", "prompt tokens"),
                                       ("verify_excess", "more verify rounds than tokens"),
                                       ("verify_few", "more than 4 (steps + 1) a round"),
                                       ("verify_negative", "spec_verify_ct is -1"),
                                       ("foreign_rid", "the answer of another request"),
                                       ("out_of_vocab", "outside the target's vocabulary")])
def test_benchmark_fails_every_answer_whose_counts_cannot_be(
        tmp_path, tiny_target_dir, tiny_draft, capsys, lie, words):
    rc, results, report, _ = _pair(tmp_path, tiny_target_dir, tiny_draft, capsys,
                                   spec={"once": [lie] * EVERY})
    out = capsys.readouterr().out  # the closing summary
    assert rc == 1
    row = results["prompt_sets"]["math"]["1"]
    spec = row["speculative"]
    assert spec["failed_requests"] == 3 and spec["requests"] == 0
    assert spec["acceptance_length"] is None
    # no speculative request measured: no speedup, "-" with the reason, never "0.00x"
    assert row["speedup"] is None and "every speculative request failed" in row["speedup_error"]
    assert "speedup - (every speculative request failed (3 in failed_requests.jsonl))" in out
    assert "SLOWER" not in out and "0.00" not in out
    assert 'speedup "-": every speculative request failed' in report
    failed = [json.loads(x) for x in
              (tmp_path / "05_benchmark/failed_requests.jsonl").read_text().splitlines()]
    assert len(failed) == 3 and all(words in f["reason"] for f in failed), failed[0]["reason"]


def test_benchmark_shows_acceptance_as_dash_with_the_reason_when_no_round_is_reported(
        tmp_path, tiny_target_dir, tiny_draft, capsys):
    rc, results, report, _ = _pair(tmp_path, tiny_target_dir, tiny_draft, capsys,
                                   spec={"tokens_per_verify": None})
    spec = results["prompt_sets"]["math"]["1"]["speculative"]
    assert spec["acceptance_length"] is None and spec["requests"] == 3
    assert "3 of 3 answers of 2 or more tokens report no spec_verify_ct" in \
        spec["acceptance_error"]
    assert 'acceptance "-": 3 of 3 answers' in report


def test_benchmark_flags_a_speculative_server_whose_outputs_are_not_the_baselines(
        tmp_path, tiny_target_dir, tiny_draft, capsys):
    rc, results, report, _ = _pair(tmp_path, tiny_target_dir, tiny_draft, capsys,
                                   spec={"lossy": True})
    assert rc == 1
    assert results["lossless_mismatches"] == 3
    assert results["prompt_sets"]["math"]["1"]["speculative"]["lossless_mismatches"] == 3
    assert "3 (NOT lossless" in report and "3 outputs differ from the baseline's" in report
    assert any("not decode losslessly" in p for p in results["preflight"])


@pytest.mark.parametrize("dialect", [{"sse_dialect": "legal"}, {"once": ["nulls"] * EVERY}])
def test_benchmark_measures_every_answer_in_a_legal_dialect(
        tmp_path, tiny_target_dir, tiny_draft, capsys, dialect):
    # CRLF, comments, retry and id fields, a ping event, JSON over two data lines; or every
    # optional count null: each answer measured as the plain one would be
    rc, results, report, _ = _pair(tmp_path, tiny_target_dir, tiny_draft, capsys,
                                   base=dialect, spec=dialect)
    assert rc == 0, report
    row = results["prompt_sets"]["math"]["1"]
    assert row["baseline"]["failed_requests"] == row["speculative"]["failed_requests"] == 0
    # 16 tokens each (the prompts are longer than 14): the prefill's, then 5 rounds of 3
    assert row["speculative"]["acceptance_length"] == pytest.approx(16 / 5)
    assert row["speculative"]["completion_tokens"] == 3 * 16
    assert results["lossless_mismatches"] == 0


@pytest.mark.parametrize("check_only", [False, True])
def test_benchmark_ends_in_one_line_when_server_info_is_a_web_page(
        tmp_path, tiny_target_dir, tiny_draft, capsys, check_only):
    extra = ("--check-only",) if check_only else ()
    rc, _, _, err = _pair(tmp_path, tiny_target_dir, tiny_draft, capsys,
                          spec={"html_paths": ("/server_info",)}, extra=extra)
    assert rc == 1
    (line,) = [x for x in err.splitlines() if x.startswith("05: ")]
    assert line.startswith("05: error: ")
    assert "/server_info answered HTTP 200 with an HTML page" in line
