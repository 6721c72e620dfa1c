"""The real-model path of the tests: stages 01 -> 05 on SmolLM2-135M-Instruct, a few records
(tests/pipeline_helpers.py; about two minutes on 2 cores)."""

from __future__ import annotations

from pathlib import Path

from pipeline_helpers import run_chat_pipeline


def run_smollm2_pipeline(target: Path, root: Path) -> Path:
    """Every stage's own `main`, in order, into `root/run`; returns the work directory.
    SmolLM2's GEMMs use both cores (the tiny tests keep one)."""
    return run_chat_pipeline(target, root, draft_vocab=1024, threads=2)
