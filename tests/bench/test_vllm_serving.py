"""vLLM serves what the pipeline built, for real: the tiny targets and the draft 04 trained.

Each server start costs 35-60 s on 2 cores, so the tests are few and share their servers:
one module-scoped `05 --backend vllm` run (a plain and a speculative server on the tiny Llama
target, the draft of the Llama demo run) and one plain server of the vLLM-shaped DeepSeek-V3
target. In CI (CI=true) a missing vLLM fails them (conftest.vllm_python).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from eagle3.bench.preflight import PreflightError

# float32 like the offline evaluator (vLLM's CPU build casts float32 checkpoints to bfloat16 by
# default); eager (no compile: start-up in tens of seconds); a context the demo prompts fit.
LAUNCH_ARGS = "--enforce-eager --dtype float32 --max-model-len 1024"
# Measured (BENCHMARKS.md, "vLLM served vs offline"): see test_served_acceptance_...
AGREEMENT_TOLERANCE = 0.02


def _server_env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


def _workdir_sharing(run: Path, tmp: Path) -> Path:
    """A work directory whose upstream folders are `run`'s (its 05 folder stays its own)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for stage in ("01c_merged", "02b_hidden_states", "03_vocab", "04_train"):
        (tmp / stage).symlink_to(run / stage)
    return tmp


@pytest.fixture(scope="module")
def vllm_bench(llama_run, vllm_python, tmp_path_factory):
    """05 --backend vllm on the Llama demo run: (workdir, results)."""
    mp = pytest.MonkeyPatch()
    _server_env(mp)
    workdir = _workdir_sharing(llama_run, tmp_path_factory.mktemp("vllm") / "run")
    argv = ["--workdir", str(workdir), "--target", str(llama_run / "target"), "--backend",
            "vllm", "--vllm-python", vllm_python, "--launch-args", LAUNCH_ARGS, "--port",
            "30123", "--steps", "3", "--prompt-sets", "eval", "--num-prompts", "8",
            "--max-new-tokens", "32", "--concurrency", "1", "4", "--ready-timeout-s", "600"]
    try:
        rc = importlib.import_module("05_benchmark").main(argv)
    finally:
        mp.undo()
    results = json.loads((workdir / "05_benchmark/results.json").read_text())
    return workdir, rc, results


def test_vllm_benchmark_serves_the_trained_draft_losslessly(vllm_bench, llama_run):
    workdir, rc, results = vllm_bench
    assert rc == 0
    assert results["lossless_mismatches"] == 0  # speculative == plain, token for token
    captures = json.loads((llama_run / "02b_hidden_states/manifest.json").read_text())[
        "capture_layers"]
    assert results["servers"]["speculative"]["layers"] == captures  # from vLLM's own log
    for c in ("1", "4"):
        row = results["prompt_sets"]["eval"][c]
        spec, base = row["speculative"], row["baseline"]
        assert spec["drafts"] > 0 and base["drafts"] == 0
        assert 1.0 < spec["acceptance_length"] <= 4.0
        assert base["total_tok_s"] > 0 and spec["ttft_mean_s"] is not None
        assert 0.0 <= spec["loop_share"] <= 1.0
    report = (workdir / "05_benchmark/report.md").read_text()
    assert "05 benchmark (vLLM)" in report
    assert (workdir / "05_benchmark/speedup_vs_concurrency.png").is_file()


def test_vllm_acceptance_length_equals_tokens_per_verify_round(vllm_bench):
    """1 + accepted / drafts (vLLM's counters) is what one verify round commits: counted from
    the outputs it is the same up to the rounds cut at max_tokens / end of turn."""
    _, _, results = vllm_bench
    spec = results["prompt_sets"]["eval"]["1"]["speculative"]
    assert spec["tokens_per_round"] == pytest.approx(spec["acceptance_length"], abs=0.1)


def test_served_acceptance_equals_the_offline_evaluators(vllm_bench, llama_run):
    """Same target, draft, prompts, chain of 3 at temperature 0: vLLM's served acceptance and
    eagle3/bench/evaluate.py's agree (the demo's 05 --backend hf ran the same 8 eval prompts,
    32 new tokens)."""
    _, _, results = vllm_bench
    offline = json.loads((llama_run / "05_benchmark/results.json").read_text())
    off = offline["prompt_sets"]["eval"]["steps"]["3"]
    served = results["prompt_sets"]["eval"]["1"]["speculative"]
    assert served["outputs"] == offline["prompt_sets"]["eval"]["baseline_outputs"]
    assert served["acceptance_length"] == pytest.approx(off["acceptance_length"],
                                                        abs=AGREEMENT_TOLERANCE)


def test_vllm_benchmark_refuses_the_sglang_draft_folder_before_starting_a_server(
        llama_run, vllm_python, tmp_path):
    """04's final/ names captures - 1 (SGLang's convention): vLLM would capture other layers."""
    workdir = _workdir_sharing(llama_run, tmp_path / "run")
    argv = ["--workdir", str(workdir), "--target", str(llama_run / "target"), "--backend",
            "vllm", "--vllm-python", vllm_python, "--launch-args", LAUNCH_ARGS, "--steps", "3",
            "--draft", str(llama_run / "04_train/final"), "--prompt-sets", "eval"]
    with pytest.raises(PreflightError, match="final_speculators"):
        importlib.import_module("05_benchmark").main(argv)
    assert not (workdir / "05_benchmark").exists()


def test_deepseek_v3_vllm_target_serves_greedy_outputs_equal_to_transformers(
        vllm_python, tmp_path, monkeypatch):
    import asyncio

    import aiohttp
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.bench.run import LoadSettings, run_level
    from eagle3.bench.vllm import READY_PATHS, completion_sender, vllm_command
    from eagle3.core.launcher import LaunchedServer
    from eagle3.tiny.target import TinyTargetConfig, make_tiny_target

    target = make_tiny_target(tmp_path / "target", TinyTargetConfig(arch="deepseek_v3_vllm"))
    prompts = [[3, 5, 100 + i, 200, 7 + i] for i in range(4)]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[
            0, len(p):].tolist() for p in prompts]
    _server_env(monkeypatch)
    url = "http://127.0.0.1:30124"
    load = LoadSettings({"max_new_tokens": 16, "temperature": 0.0}, stream=False)
    with LaunchedServer(vllm_command(vllm_python, target, LAUNCH_ARGS, 30124),
                        tmp_path / "server.log", url, 600, ready_paths=READY_PATHS):
        records, _ = asyncio.run(run_level(url, prompts, 1, load, "ds",
                                           send=completion_sender(str(target))))
    got = [r.output_ids for r in sorted(records, key=lambda r: r.prompt_index)][:4]
    assert got == want and sum(map(len, got)) > 16
