"""Stage 05 comparing several SGLang speculative settings against one baseline: the verdict (the
fastest setting per prompt set and concurrency, its SGLang flags, or plain), plain's own noise
across concurrencies beside the speculative outputs against plain, and the bad inputs refused
before anything is measured.

The servers are stand-ins (tests/bench_fake_server.py: each plays one setting, with its own
acceptance and round cost, and plain answers that can differ between concurrencies as bf16's
do): the real SGLang cannot serve EAGLE on these CPUs (its CPU backend serves drafts only with
the AMX attention backend; these are AVX2 machines, docs/PIPELINE.md), so what is tested here is
05's reading of the servers, not SGLang.
"""

from __future__ import annotations

import importlib
import json
import shlex

import pytest
from bench_fake_server import FakeBenchServer, level_of
from bench_helpers import fake_sglang_shim, free_port, make_tiny_draft

from eagle3.bench.compare import check_lossless
from eagle3.bench.config import SPEC_DEFAULT, BenchmarkConfig
from eagle3.bench.measure import RequestRecord, summarize_level
from eagle3.bench.prompts import load_prompt_set
from eagle3.bench.settings import label, requested_setting, serve_flags
from eagle3.core.chat import ChatRenderer
from eagle3.core.preflight import PreflightError


def _info(steps: int, topk: int, tokens: int, algo: str = "EAGLE3") -> dict:
    return {"speculative_algorithm": algo, "speculative_num_steps": steps,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}


CHAIN3, CHAIN7, TREE = _info(3, 1, 4), _info(7, 1, 8), _info(4, 2, 8)
FLAGS7 = "--speculative-num-steps 7 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8"


# ---------------------------------------------------------------- units


def test_settings_are_labelled_and_served_from_what_the_server_reports():
    assert label(CHAIN3) == "chain 3" and label(TREE) == "tree 4x2/8"
    assert serve_flags({**TREE, "speculative_draft_model_path": "/d/final"}, "/other") == (
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path /d/final "
        "--speculative-num-steps 4 --speculative-eagle-topk 2 --speculative-num-draft-tokens 8")
    assert "--speculative-draft-model-path '/my drafts/final'" in serve_flags(CHAIN3,
                                                                               "/my drafts/final")
    assert requested_setting("--speculative-num-steps=5 --speculative-eagle-topk 1 --x") == (
        "5", "1", None)


def _level(outputs: dict[int, list[int]]) -> dict:
    records = [RequestRecord(p, "r", ids, len(ids), 10, 0, None, 0.1, 1.0, 0.0)
               for p, ids in outputs.items()]
    return summarize_level(records, 1.0)


def test_plain_noise_comes_from_the_baselines_own_levels_and_bounds_the_mismatches():
    """Plain flips prompt 1 between concurrency 1 and 4 (noise 1/4 at c=4): a speculative
    server differing on one prompt at c=4 is within it; one differing at c=1, where plain
    agrees with itself by construction, is beyond it."""
    same = {0: [1], 1: [2], 2: [3], 3: [4]}
    base = {"x": {"1": _level(same), "4": _level({**same, 1: [9]})}}
    within = {"x": {"1": _level(same), "4": _level(same)}}  # = plain at c=1, not at c=4
    beyond = {"x": {"1": _level({**same, 2: [8]}), "4": _level({**same, 1: [9]})}}
    total, notes = check_lossless({"baseline": base, "speculative": within,
                                   "speculative-2": beyond}, 0.0)
    b1, b4 = base["x"]["1"], base["x"]["4"]
    assert (b1["plain_noise_share"], b4["plain_noise_share"]) == (0.0, 0.25)
    assert b4["plain_noise_reference"] == "1" and b4["plain_noise_prompts"] == 1
    assert within["x"]["4"]["mismatch_share"] == 0.25
    assert within["x"]["4"]["within_plain_noise"] is True
    assert within["x"]["1"]["within_plain_noise"] is None  # no mismatch: lossless
    assert beyond["x"]["1"]["within_plain_noise"] is False
    assert beyond["x"]["4"]["lossless_mismatches"] == 0  # it flips the same prompt as plain
    assert total == 2
    assert notes[0].startswith("error: 1 speculative outputs differ") and "1 speculative " \
        "outputs differ from the baseline's at temperature 0 within" in notes[1]


def test_config_refuses_the_same_setting_twice_and_spec_args_for_attached_servers(
        tiny_target_dir):
    w = {"workdir": "w", "backend": "sglang"}
    with pytest.raises(ValueError, match=r"--spec-args #1 .* and #2 .* start the same"):
        BenchmarkConfig(**w, launch_args="--model-path m", spec_args=[FLAGS7, FLAGS7 + " "])
    with pytest.raises(ValueError, match=r"--spec-args #1 .* and #3 .* start the same"):
        BenchmarkConfig(**w, launch_args="--model-path m", spec_args=[
            FLAGS7, SPEC_DEFAULT, FLAGS7.replace("-steps 7", "-steps=7")])
    with pytest.raises(ValueError, match="--spec-url lists http://a:1 twice"):
        BenchmarkConfig(**w, baseline_url="http://b", spec_url=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="--spec-args is for the servers 05 launches"):
        BenchmarkConfig(**w, baseline_url="http://b", spec_url=["http://a"], spec_args=[FLAGS7])
    with pytest.raises(ValueError, match="--backend vllm takes one --spec-url"):
        BenchmarkConfig(workdir="w", backend="vllm", target=tiny_target_dir, steps=[3],
                        baseline_url="http://b", spec_url=["http://a", "http://c"])


def test_fake_server_reads_the_level_from_05s_rid():
    assert level_of("bench-speculative-2-chat-c16-3-0123abcd") == 16
    assert level_of("bench-baseline-my-c4-set-c1-0-0123abcd-retry2") == 1
    assert level_of("bench-baseline-warmup-0-0123abcd") is None


# ---------------------------------------------------------------- 05_benchmark.py end to end


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir, tmp_path_factory):
    return make_tiny_draft(tiny_target_dir, tmp_path_factory.mktemp("draft") / "final")


def _bench(argv):
    return importlib.import_module("05_benchmark").main(argv)


def _argv(workdir, target, draft, *extra):
    return ["--workdir", str(workdir), "--target", str(target), "--draft", str(draft),
            "--backend", "sglang", "--prompt-sets", "chat", "math", "--num-prompts", "3",
            "--max-new-tokens", "16", "--concurrency", "1", "4", *extra]


def _first_chat_prompt(tokenizer, tmp_path) -> list[int]:
    return load_prompt_set("chat", tmp_path, ChatRenderer(tokenizer), 3).prompts[0]


# Every answer is 16 tokens (the prompts are longer than 14): plain takes 15 steps, a chain of
# 7 committing 6 a round 3 rounds, a chain of 3 committing 3 5 rounds, the tree committing 4
# 4 rounds (of 0.03 s: a wider round costs more). At concurrency 4 every speculative round
# costs 0.2 s: plain wins there.
SLOW_AT_4 = {4: 0.2}


def test_benchmark_names_the_fastest_setting_per_level_and_prints_its_flags(
        tmp_path, tiny_target_dir, tiny_draft, tokenizer, capsys):
    noisy = _first_chat_prompt(tokenizer, tmp_path)

    def plain_flips(prompt, c):  # bf16's batch-size noise: one chat prompt flips at c=4
        return c == 4 and prompt == noisy

    served = {"speculative_draft_model_path": str(tiny_draft)}
    with FakeBenchServer({}, step_s=0.02, batch_noise=plain_flips) as base, \
            FakeBenchServer({**CHAIN3, **served}, tokens_per_verify=3,
                            step_s_at=SLOW_AT_4) as chain3, \
            FakeBenchServer({**CHAIN7, **served}, tokens_per_verify=6,
                            step_s_at=SLOW_AT_4) as chain7, \
            FakeBenchServer({**TREE, **served}, tokens_per_verify=4, step_s=0.03,
                            step_s_at=SLOW_AT_4) as tree:
        capsys.readouterr()
        rc = _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                          "--spec-url", chain3, chain7, tree))
    printed = capsys.readouterr().out
    assert rc == 0, printed
    out = tmp_path / "05_benchmark"
    results = json.loads((out / "results.json").read_text())
    assert results["results_version"] == 2
    assert [(s["role"], s["label"], s["url"]) for s in results["settings"]] == [
        ("speculative", "chain 3", chain3), ("speculative-2", "chain 7", chain7),
        ("speculative-3", "tree 4x2/8", tree)]
    flags7 = (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {tiny_draft} "
              f"{FLAGS7}")
    for name in ("chat", "math"):
        v1, v4 = results["verdict"][name]["1"], results["verdict"][name]["4"]
        assert (v1["serve"], v1["label"], v1["flags"]) == ("speculative", "chain 7", flags7)
        assert v1["speedup"] == pytest.approx(
            results["prompt_sets"][name]["1"]["settings"]["speculative-2"]["speedup"])
        assert v1["speedup"] > max(x for k, x in v1["speedups"].items() if k != "chain 7")
        assert v4["serve"] == "plain" and v4["flags"] is None and v4["speedup"] < 1
        assert v4["text"].startswith("serve plain at concurrency 4")
        row = results["prompt_sets"][name]["1"]
        assert row["speculative-3"]["acceptance_length"] == pytest.approx(16 / 4)
        assert row["speculative-2"]["acceptance_length"] == pytest.approx(16 / 3)
        assert row["speculative"] is not row["speculative-2"]
    # plain against itself: one of 3 chat prompts differs between c=4 and c=1; the speculative
    # servers (no noise of their own) differ from plain at c=4 on that prompt only: within it
    chat4 = results["prompt_sets"]["chat"]["4"]
    assert chat4["baseline"]["plain_noise_share"] == pytest.approx(1 / 3)
    assert results["prompt_sets"]["math"]["4"]["baseline"]["plain_noise_share"] == 0
    for role in ("speculative", "speculative-2", "speculative-3"):
        assert chat4[role]["mismatch_share"] == pytest.approx(1 / 3)
        assert chat4[role]["within_plain_noise"] is True
    assert results["lossless_mismatches"] == 3 * 3  # 3 servers x 3 requests of it at c=4
    (serve,) = [x for x in printed.splitlines() if x.strip().startswith("serve chain")]
    assert serve.split()[:3] == ["serve", "chain", "7"]
    assert serve.endswith(f"{flags7}  (fastest at chat c=1, math c=1)")
    assert "verdict chat c=4" in printed and "serve plain at concurrency 4" in printed
    report = (out / "report.md").read_text()
    assert "## Verdict: what to serve" in report and f"    {flags7}" in report
    assert "| chat | 1 | chain 7 |" in report and "| **plain** |" in report
    assert "within plain's own 1 / 3 (33%) between concurrency 4 and 1" in report
    requests = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["role"] for r in requests} == {"baseline", "speculative", "speculative-2",
                                            "speculative-3"}


def test_benchmark_launches_one_speculative_server_per_spec_args_string(
        tmp_path, tiny_target_dir, tiny_draft, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", fake_sglang_shim(tmp_path))
    argv = _argv(tmp_path, tiny_target_dir, tiny_draft, "--launch-args", "--model-path m "
                 "--load-seconds 0.2", "--port", str(free_port()), "--ready-timeout-s", "60",
                 "--concurrency", "1", "--prompt-sets", "math",
                 "--spec-args", SPEC_DEFAULT, FLAGS7 + " --fake-tokens-per-round 6")
    assert _bench(argv) == 0
    out = tmp_path / "05_benchmark"
    for role in ("baseline", "speculative", "speculative-2"):
        assert "fake sglang starting" in (out / f"server_{role}.log").read_text()
    results = json.loads((out / "results.json").read_text())
    assert [s["label"] for s in results["settings"]] == ["chain 3", "chain 7"]
    assert results["settings"][1]["spec_args"] == FLAGS7 + " --fake-tokens-per-round 6"
    v = results["verdict"]["math"]["1"]
    assert (v["serve"], v["label"]) == ("speculative", "chain 7")
    assert shlex.split(v["flags"])[-6:] == shlex.split(FLAGS7)
    assert "verdict math c=1" in capsys.readouterr().out


def test_benchmark_with_one_spec_url_keeps_the_single_server_summary(
        tmp_path, tiny_target_dir, tiny_draft, capsys):
    with FakeBenchServer({}) as base, FakeBenchServer(CHAIN3, tokens_per_verify=3) as spec:
        capsys.readouterr()
        assert _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                            "--spec-url", spec, "--prompt-sets", "math")) == 0
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "05_benchmark/results.json").read_text())
    assert set(results["servers"]) == {"baseline", "speculative"}
    row = results["prompt_sets"]["math"]["1"]
    assert row["speedup"] == row["settings"]["speculative"]["speedup"]
    assert "  math c=1  " in printed and "math c=1 chain 3" not in printed
    assert "verdict math c=1" in printed and "serve chain 3" in printed


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad,words", [
    ({}, "runs no speculative decoding"),
    (CHAIN3, "serve the same speculative setting (chain 3"),
    (_info(3, 1, 4, algo="EAGLE"), "collapses to about 1")])
def test_benchmark_refuses_a_bad_second_spec_url_before_measuring_anything(
        tmp_path, tiny_target_dir, tiny_draft, bad, words):
    servers = [FakeBenchServer({}), FakeBenchServer(CHAIN3, tokens_per_verify=3),
               FakeBenchServer(bad, tokens_per_verify=3)]
    with servers[0] as base, servers[1] as first, servers[2] as second:
        with pytest.raises(PreflightError) as e:
            _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                         "--spec-url", first, second))
    message = str(e.value)
    assert f"{second} (--spec-url #2)" in message and words in message, message
    assert all(s.requests == [] for s in servers)  # asked their flags only: nothing measured
    assert not (tmp_path / "05_benchmark" / "results.json").exists()


@pytest.mark.parametrize("bad,words", [
    (_info(7, 1, 8, algo="EAGLE"), "--spec-url #2: speculative_algorithm='EAGLE'"),
    (CHAIN3, "(--spec-url #1) and {second} (--spec-url #2) serve the same speculative setting")])
def test_check_only_names_the_spec_url_of_a_bad_server_among_several(
        tmp_path, tiny_target_dir, tiny_draft, capsys, bad, words):
    with FakeBenchServer({}) as base, FakeBenchServer(CHAIN3) as first, \
            FakeBenchServer(bad) as second:
        assert _bench(_argv(tmp_path, tiny_target_dir, tiny_draft, "--baseline-url", base,
                            "--spec-url", first, second, "--check-only")) == 1
    printed = capsys.readouterr().out
    assert words.format(second=second) in printed, printed
    assert "--spec-url #1:" not in printed


def test_config_refuses_spec_args_that_set_the_algorithm_or_the_draft():
    """05 starts each launched speculative server with EAGLE3 and the checked draft: a flag
    string that would start EAGLE (acceptance about 1 with an EAGLE-3 draft) is refused before
    any server starts, naming the string."""
    for own in ("--speculative-algorithm EAGLE", "--speculative-draft-model-path=/x"):
        with pytest.raises(ValueError, match=rf"--spec-args #2 \('{own} .*sets "
                                             f"{own.split()[0].split('=')[0]}"):
            BenchmarkConfig(workdir="w", backend="sglang", launch_args="--model-path m",
                            spec_args=[SPEC_DEFAULT, f"{own} {FLAGS7}"])
