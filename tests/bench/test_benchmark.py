"""Stage 05 against SGLang: figures computed exactly from known answers, servers attached or
launched, the preflight refusing a wrong speculative server; and the offline report."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
from bench_fake_server import FakeBenchServer, fake_output_ids, verify_count
from bench_helpers import make_tiny_draft

from eagle3.bench.compare import check_lossless, combine
from eagle3.bench.measure import (
    LoadSettings,
    RequestRecord,
    percentile,
    summarize_level,
)
from eagle3.bench.prompts import BUILTIN_SETS, PromptSet, load_prompt_set
from eagle3.bench.report import report_markdown
from eagle3.bench.sglang import measure_server, merge_stream_ids
from eagle3.core.launcher import LaunchedServer, LaunchError, sglang_command
from eagle3.core.preflight import PreflightError

TESTS = Path(__file__).resolve().parents[1]
SPEC_INFO = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
# Prompts of 3..6 ids: the fake answers L + 2 tokens (5..8); at 3 tokens per verify pass
# that is ceil(4/3), ceil(5/3), ceil(6/3), ceil(7/3) = 2, 2, 2, 3 verify passes.
PROMPTS = PromptSet("toy", [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [1, 1, 1, 1, 1, 1]],
                    ["a", "b", "c", "d"])
HAND_ACCEPTANCE = (5 + 6 + 7 + 8) / (2 + 2 + 2 + 3)


def _record(tokens, verify, ttft, latency) -> RequestRecord:
    return RequestRecord(0, "r", [0] * tokens, tokens, 10, 0, verify, ttft, latency, 0.0)


def test_summarize_level_matches_hand_computation_when_records_are_known():
    records = [_record(10, 4, 0.1, 1.0), _record(20, 5, 0.3, 2.0), _record(1, None, 0.2, 0.5)]
    s = summarize_level(records, wall_s=2.5)
    assert s["completion_tokens"] == 31
    assert s["total_tok_s"] == pytest.approx(31 / 2.5)
    assert s["per_request_tok_s"] == pytest.approx((10 / 1.0 + 20 / 2.0 + 1 / 0.5) / 3)
    assert s["acceptance_length"] == pytest.approx(30 / 9)  # the unverified request is left out
    assert s["requests_without_verify_ct"] == 1
    assert s["ttft_mean_s"] == pytest.approx(0.2) and s["ttft_p50_s"] == 0.2
    assert s["ttft_p90_s"] == 0.3


def test_summarize_level_reports_no_acceptance_when_server_has_no_draft():
    s = summarize_level([_record(10, None, None, 1.0)], 1.0)
    assert s["acceptance_length"] is None and s["ttft_mean_s"] is None


def test_check_lossless_compares_every_request_of_a_prompt_sent_twice():
    """A level sends a prompt twice when 2 x concurrency exceeds the prompts: the second
    speculative request is compared too (it was not while outputs were kept one a prompt)."""
    def level(*outputs):
        records = [RequestRecord(p, "r", ids, len(ids), 10, 0, None, 0.1, 1.0, 0.0)
                   for p, ids in outputs]
        return {"x": {"16": summarize_level(records, 1.0)}}

    base = level((0, [1, 2]), (1, [3, 4]), (0, [1, 2]), (1, [3, 4]))
    spec = level((0, [1, 2]), (1, [3, 9]), (0, [1, 2]), (1, [3, 4]))  # prompt 1's first differs
    total, notes = check_lossless({"baseline": base, "speculative": spec}, 0.0)
    assert total == 1 and notes
    assert spec["x"]["16"]["lossless_compared"] == 4
    assert spec["x"]["16"]["outputs"] == [[1, 2], [3, 9]]  # the JSON keeps one a prompt


def test_combine_divides_total_throughputs_when_levels_match():
    base = {"x": {"4": summarize_level([_record(10, None, 0.1, 1.0)], 2.0)}}
    spec = {"x": {"4": summarize_level([_record(10, 4, 0.1, 0.5)], 0.8)}}
    row = combine(base, spec)["x"]["4"]
    assert row["speedup"] == pytest.approx((10 / 0.8) / (10 / 2.0))
    assert row["per_request_speedup"] == pytest.approx(2.0)


def test_percentile_is_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([5, 1, 3, 2, 4], 90) == 5
    assert percentile([], 50) is None


def test_merge_stream_ids_replaces_cumulative_and_extends_deltas():
    assert merge_stream_ids([1, 2], [1, 2, 3], 3) == [1, 2, 3]
    assert merge_stream_ids([1, 2], [3], 3) == [1, 2, 3]
    assert merge_stream_ids([], [7, 8], 2) == [7, 8]


def _measure(url, stream=True, concurrency=(1, 4), incremental=False, sink=None):
    load = LoadSettings({"max_new_tokens": 64, "temperature": 0.0}, stream, incremental, 30.0)
    return measure_server(url, "r", [PROMPTS], list(concurrency), load, sink)


@pytest.mark.parametrize("incremental", [False, True])
def test_measure_server_gives_hand_computed_acceptance_when_answers_are_known(incremental):
    class Sink(list):
        write = list.append

    sink = Sink()
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, incremental=incremental) as url:
        out = _measure(url, incremental=incremental, sink=sink)
    for c, n_requests in (("1", 4), ("4", 8)):  # max(prompts, 2 x concurrency), cycled
        s = out["toy"][c]
        assert s["requests"] == n_requests
        assert s["acceptance_length"] == pytest.approx(HAND_ACCEPTANCE)
        assert s["completion_tokens"] == (5 + 6 + 7 + 8) * n_requests // 4
    for rec in sink:  # every output token id kept, exactly as the server sent it
        prompt = PROMPTS.prompts[rec["prompt_index"]]
        assert rec["output_ids"] == fake_output_ids(prompt, 64)
        assert rec["spec_verify_ct"] == verify_count(len(prompt) + 2, 3)
        assert rec["prompt_id"] == PROMPTS.ids[rec["prompt_index"]]


def test_measure_server_speedup_follows_the_scripted_timing_when_draft_commits_3_per_step():
    with FakeBenchServer({}, ttft_s=0.05, step_s=0.05) as base_url:
        base = _measure(base_url)
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, ttft_s=0.05, step_s=0.05) as spec_url:
        spec = _measure(spec_url)
    lengths = [len(p) + 2 for p in PROMPTS.prompts]
    base_s = sum(0.05 + 0.05 * (n - 1) for n in lengths)  # one token per step
    spec_s = sum(0.05 + 0.05 * verify_count(n, 3) for n in lengths)
    row = combine(base, spec)["toy"]["1"]
    assert row["baseline"]["acceptance_length"] is None
    # Batch 1: requests run one after the other, so wall time ~ the sum of scripted latencies.
    assert row["baseline"]["total_tok_s"] == pytest.approx(sum(lengths) / base_s, rel=0.25)
    assert row["speculative"]["total_tok_s"] == pytest.approx(sum(lengths) / spec_s, rel=0.25)
    assert row["speedup"] == pytest.approx(base_s / spec_s, rel=0.3)
    assert 0.05 <= row["speculative"]["ttft_mean_s"] < 0.05 + 0.05
    c4 = combine(base, spec)["toy"]["4"]  # 4 in flight: more total throughput, same per request
    assert c4["baseline"]["total_tok_s"] > 2 * row["baseline"]["total_tok_s"]


def test_measure_server_has_no_ttft_when_not_streaming():
    with FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0) as url:
        s = _measure(url, stream=False, concurrency=(2,))["toy"]["2"]
    assert s["ttft_mean_s"] is None
    assert s["acceptance_length"] == pytest.approx(HAND_ACCEPTANCE)


# ---------------------------------------------------------------- 05_benchmark.py end to end


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir, tmp_path_factory) -> Path:
    """An untrained draft for the tiny target, exported as SGLang loads it."""
    return make_tiny_draft(tiny_target_dir, tmp_path_factory.mktemp("draft") / "final")


def _bench(argv):
    return importlib.import_module("05_benchmark").main(argv)


def _sglang_argv(workdir, target, draft, *extra):
    return ["--workdir", str(workdir), "--target", str(target), "--draft", str(draft),
            "--backend", "sglang", "--prompt-sets", "chat", "math", "--num-prompts", "3",
            "--max-new-tokens", "16", "--concurrency", "1", "2", *extra]


def test_benchmark_script_writes_results_report_and_plots_when_attached(tmp_path,
                                                                        tiny_target_dir,
                                                                        tiny_draft):
    with FakeBenchServer({}, step_s=0.02) as base, \
            FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.02) as spec:
        rc = _bench(_sglang_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                                 "--spec-url", spec))
    assert rc == 0
    out = tmp_path / "05_benchmark"
    results = json.loads((out / "results.json").read_text())
    assert set(results["prompt_sets"]) == {"chat", "math"}
    for levels in results["prompt_sets"].values():
        assert set(levels) == {"1", "2"}
        for row in levels.values():
            assert 1.0 < row["speculative"]["acceptance_length"] <= 4.0
            assert row["speedup"] > 1.0
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 2 * 2 * (3 + 4)  # roles x sets x (c=1: 3, c=2: 4 requests)
    report = (out / "report.md").read_text()
    assert "| 1 |" in report and "acceptance length" in report and "SGLang 0.5.23" in report
    assert (out / "speedup_vs_concurrency.png").stat().st_size > 1000
    assert (out / "acceptance_vs_concurrency.png").stat().st_size > 1000
    assert json.loads((out / "manifest.json").read_text())["complete"]


def test_benchmark_script_refuses_eagle_when_spec_server_runs_it(tmp_path, tiny_target_dir,
                                                                tiny_draft, capsys):
    eagle = {**SPEC_INFO, "speculative_algorithm": "EAGLE"}
    with FakeBenchServer({}) as base, FakeBenchServer(eagle, tokens_per_verify=1) as spec:
        argv = _sglang_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                            "--spec-url", spec)
        with pytest.raises(PreflightError, match="--speculative-algorithm EAGLE3"):
            _bench(argv)
        assert _bench(argv + ["--check-only"]) == 1
    printed = capsys.readouterr().out
    assert "collapses to about 1" in printed and "errors" in printed


def test_benchmark_check_only_passes_when_servers_and_draft_are_right(tmp_path, tiny_target_dir,
                                                                     tiny_draft, capsys):
    with FakeBenchServer({}) as base, FakeBenchServer(SPEC_INFO, tokens_per_verify=3) as spec:
        assert _bench(_sglang_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url",
                                   base, "--spec-url", spec, "--check-only")) == 0
    assert "SGLang 0.5.23 captures" in capsys.readouterr().out
    assert not (tmp_path / "05_benchmark").exists()  # a check writes no stage folder


@pytest.fixture()
def fake_sglang_on_path(tmp_path, monkeypatch):
    """`python -m sglang.launch_server` runs the fake server (children inherit PYTHONPATH)."""
    pkg = tmp_path / "shim" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import sys\nfrom bench_fake_server import main\nmain(sys.argv[1:])\n")
    monkeypatch.setenv("PYTHONPATH", f"{pkg.parent}:{TESTS}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_benchmark_script_launches_both_servers_and_keeps_their_logs(
        tmp_path, tiny_target_dir, tiny_draft, fake_sglang_on_path):
    argv = _sglang_argv(tmp_path, tiny_target_dir, tiny_draft, "--launch-args",
                        "--model-path /models/fake --tp-size 8", "--port", str(_free_port()),
                        "--ready-timeout-s", "60")
    assert _bench(argv) == 0
    out = tmp_path / "05_benchmark"
    for role in ("baseline", "speculative"):
        assert "fake sglang starting" in (out / f"server_{role}.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert not [n for n in results["preflight"] if "cumulative" in n]  # deltas were asked for
    servers = results["servers"]
    assert servers["baseline"]["speculative"] is None
    assert servers["speculative"]["speculative"].startswith("EAGLE3, steps 3, topk 1")


def test_launched_server_reports_its_log_when_it_dies_before_ready(tmp_path,
                                                                   fake_sglang_on_path):
    command = sglang_command(sys.executable, "--crash", _free_port())
    with pytest.raises(LaunchError, match="CUDA out of memory"):
        with LaunchedServer(command, tmp_path / "s.log", "http://127.0.0.1:1", 30):
            pass


def test_launched_server_stops_its_process_when_the_block_ends(tmp_path, fake_sglang_on_path):
    port = _free_port()
    server = LaunchedServer(sglang_command(sys.executable, "--load-seconds 0.2", port),
                            tmp_path / "s.log", f"http://127.0.0.1:{port}", 30)
    with server:
        assert server.proc.poll() is None
    assert server.proc.poll() is not None


def test_launched_server_runs_with_its_env_over_this_process_environment(tmp_path):
    seen = tmp_path / "seen"
    script = ("import os, sys; open(sys.argv[1], 'w').write("
              "os.environ['EAGLE3_SERVER_T'] + ' ' + os.environ['PATH'][:1]); sys.exit(3)")
    command = [sys.executable, "-c", script, str(seen)]
    with pytest.raises(LaunchError, match="exited with status 3"):
        with LaunchedServer(command, tmp_path / "s.log", "http://127.0.0.1:1", 30,
                            env={"EAGLE3_SERVER_T": "from-env"}):
            pass
    assert seen.read_text() == "from-env " + os.environ["PATH"][:1]


def test_ignore_eos_is_for_served_backends_and_rides_in_every_request(tiny_target_dir,
                                                                     tmp_path):
    """05 --ignore-eos (fixed lengths): refused offline, where the evaluator stops at the end
    of turn; for a server it is in the sampling params of every request and its results."""
    from eagle3.bench.config import BenchmarkConfig
    from eagle3.bench.measure import measure_roles

    with pytest.raises(ValueError, match="--ignore-eos is for the served backends"):
        BenchmarkConfig(workdir=Path("w"), target=tiny_target_dir, backend="hf", ignore_eos=True)
    seen = []

    def role(name, load, sinks, bar):
        seen.append(load.sampling_params)
        return {}, {}

    for fixed in (True, False):
        cfg = BenchmarkConfig(workdir=Path("w"), target=tiny_target_dir, backend="vllm",
                              steps=[3], launch_args="", ignore_eos=fixed)
        measure_roles(cfg, [], tmp_path, role)
    assert [p.get("ignore_eos") for p in seen] == [True, True, None, None]


def test_sglang_command_refuses_a_port_in_launch_args():
    with pytest.raises(ValueError, match="--port"):
        sglang_command("python", "--model-path m --port 1", 30000)
    assert sglang_command("py", "--model-path 'a b'", 5, ["--x"]) == [
        "py", "-m", "sglang.launch_server", "--model-path", "a b", "--port", "5", "--x"]


# ---------------------------------------------------------------- prompt sets and offline


def test_builtin_prompt_sets_render_with_the_target_template(tokenizer):
    from eagle3.bench.prompts import prompt_set_path
    from eagle3.core.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    for name in BUILTIN_SETS:
        ps = load_prompt_set(name, Path("."), renderer)
        records = [json.loads(x) for x in prompt_set_path(name, Path(".")).read_text().splitlines()]
        assert len(ps.prompts) == len(records) >= 10 and len(set(ps.ids)) == len(ps.ids)
        for ids, rec in zip(ps.prompts, records):
            history = renderer.render_ids(rec["messages"], rec.get("tools"), False)
            assert ids[: len(history)] == history and len(ids) > len(history)  # + gen prompt
            assert rec["messages"][-1]["content"][-20:] in tokenizer.decode(ids)


def test_load_prompt_set_cuts_a_final_assistant_turn_and_reads_tokenized_records(tmp_path,
                                                                                 tokenizer):
    from eagle3.core.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    convo = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "c1", "messages": convo}) + "\n"
                    + json.dumps({"id": "t1", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1],
                                  "n_prompt_tokens": 2}) + "\n")
    ps = load_prompt_set(str(path), tmp_path, renderer)
    assert ps.name == "mine" and ps.ids == ["c1", "t1"]
    assert ps.prompts == [renderer.prompt_ids(convo[:1]), [5, 6]]


def test_offline_report_marks_sampling_runs_as_not_token_checked():
    results = {"backend": "hf", "draft": "d", "prompt_sets": {"eval": {
        "temperature": 1.0, "baseline_tok_s": 10.0, "steps": {"3": {
            "acceptance_length": 2.5, "per_position_acceptance": [0.9, 0.5, 0.1], "tok_s": 20.0,
            "speedup": 2.0, "lossless_mismatches": None}}}}}
    assert ("| eval | 1.0 | 3 | 2.500 | - | - (-) | 0.90, 0.50, 0.10 | 20.0 | 10.0 | 2.00 | "
            "n/a (sampling) |") \
        in report_markdown(results)


def test_benchmark_script_refuses_a_draft_before_starting_anything(tmp_path, tiny_target_dir,
                                                                   tiny_draft):
    import shutil

    bad = Path(shutil.copytree(tiny_draft, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (bad / "config.json").write_text(json.dumps(config))
    argv = _sglang_argv(tmp_path, tiny_target_dir, bad, "--launch-args", "--model-path m")
    with pytest.raises(PreflightError, match="eagle_aux_hidden_state_layer_ids"):
        _bench(argv)
    assert not (tmp_path / "05_benchmark").exists()


# Timings of one run (wall-clock speeds): the only keys of 05 --backend hf's results.json and
# manifest that may differ between two runs of the same command; and the manifest's
# disk_bytes, which counts results.json (whose speeds vary in digits).
TIMINGS = ("baseline_tok_s", "tok_s", "speedup", "disk_bytes")


def test_05_hf_folder_is_identical_when_killed_at_several_moments_and_rerun(tmp_path,
                                                                             tiny_target_dir,
                                                                             tiny_draft):
    """SIGKILL at three moments of 05 --backend hf, then a full run: the same file names, the
    plot byte for byte, results.json and the manifest equal but for TIMINGS (and the manifest's
    timestamps), and report.md exactly what results.json renders to."""
    from stage_helpers import assert_same_folder, kill_and_rerun

    root = Path(__file__).resolve().parents[2]

    def cmd(w):
        return [sys.executable, str(root / "05_benchmark.py"), "--workdir", str(tmp_path / w),
                "--target", str(tiny_target_dir), "--draft", str(tiny_draft), "--backend", "hf",
                "--prompt-sets", "chat", "--num-prompts", "3", "--steps", "2", "3",
                "--max-new-tokens", "16", "--log-level", "WARNING"]

    kill_and_rerun(cmd, lambda w: tmp_path / w / "05_benchmark", (0.05, 0.5, 0.97), root)
    for w in ("ref", "run"):
        folder = tmp_path / w / "05_benchmark"
        results = json.loads((folder / "results.json").read_text())
        assert (folder / "report.md").read_text() == report_markdown(results)
        (folder / "report.md").unlink()  # compared through results.json
        (folder / "results.json").write_text(json.dumps(results, sort_keys=True))
    assert_same_folder(tmp_path / "run/05_benchmark", tmp_path / "run",
                       tmp_path / "ref/05_benchmark", tmp_path / "ref", run_counts=TIMINGS,
                       count_files=("results.json",))
