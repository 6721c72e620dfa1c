"""What the vLLM serving tests share: the launch flags, the server environment, work folders."""

from __future__ import annotations

from pathlib import Path

# float32 like the offline evaluator (vLLM's CPU build casts float32 checkpoints to bfloat16 by
# default, and some of these hosts have no bf16 instructions); eager (no compile: start-up in
# tens of seconds); a context the test prompts fit; one process less (UNIPROC_ARGS).
# vLLM's `uni` executor runs the model inside the engine-core process instead of a worker
# process of its own (an import of vLLM and torch fewer per start-up); its CPU build takes it
# only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the API server and the engine core stay apart).
# Measured on 2 cores with the SmolLM2-135M target, alternating twice in one command: ready in
# 21-22 s instead of 31-37 s, 16 greedy requests of 32 tokens in 17-18 s instead of 27-29 s,
# the same outputs.
UNIPROC_ARGS = "--distributed-executor-backend uni"
UNIPROC_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
LAUNCH_ARGS = f"--enforce-eager --dtype float32 --max-model-len 1024 {UNIPROC_ARGS}"
# MLA targets (the tiny DeepSeek-V3): on a CPU with AMX tiles (Sapphire Rapids, as some of these
# hosts are) vLLM prefers its AMX MLA kernels, which refuse the tiny target's 16-wide weights
# ("invalid weight input features 16" at start-up); the reference CPU_MLA backend serves any size.
MLA_BACKEND_ARGS = ("--attention-backend", "CPU_MLA")
MLA_LAUNCH_ARGS = f"{LAUNCH_ARGS} {' '.join(MLA_BACKEND_ARGS)}"


# The environment of the tests' vLLM servers (two threads, 1 GiB of KV cache, no binding).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "2", **UNIPROC_ENV}


def server_env(monkeypatch):
    for k, v in SERVER_ENV.items():
        monkeypatch.setenv(k, v)


def workdir_sharing(run: Path, tmp: Path) -> Path:
    """A work directory whose upstream folders are `run`'s (its 05 folder stays its own)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for stage in ("01c_merged", "02b_hidden_states", "03_vocab", "04_train"):
        (tmp / stage).symlink_to(run / stage)
    return tmp
