"""What the vLLM serving tests share: the launch flags, the server environment, work folders."""

from __future__ import annotations

from pathlib import Path

# float32 like the offline evaluator (vLLM's CPU build casts float32 checkpoints to bfloat16 by
# default, and some of these hosts have no bf16 instructions); eager (no compile: start-up in
# tens of seconds); a context the test prompts fit.
LAUNCH_ARGS = "--enforce-eager --dtype float32 --max-model-len 1024"
# MLA targets (the tiny DeepSeek-V3): on a CPU with AMX tiles (Sapphire Rapids, as some of these
# hosts are) vLLM prefers its AMX MLA kernels, which refuse the tiny target's 16-wide weights
# ("invalid weight input features 16" at start-up); the reference CPU_MLA backend serves any size.
MLA_BACKEND_ARGS = ("--attention-backend", "CPU_MLA")
MLA_LAUNCH_ARGS = f"{LAUNCH_ARGS} {' '.join(MLA_BACKEND_ARGS)}"


def server_env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


def workdir_sharing(run: Path, tmp: Path) -> Path:
    """A work directory whose upstream folders are `run`'s (its 05 folder stays its own)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for stage in ("01c_merged", "02b_hidden_states", "03_vocab", "04_train"):
        (tmp / stage).symlink_to(run / stage)
    return tmp
