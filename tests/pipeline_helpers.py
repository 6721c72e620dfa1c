"""Stages 01 -> 05 on a chat target, a few records: every stage's own `main`, in order.

Sized for CI on 2 cores: 24 of the demo's chat prompts, replies of up to 48 tokens, a few epochs
of 04 on 512-token rows, 05 on 4 held-out prompts of prompts/chat.jsonl. SmolLM2-135M-Instruct
(tests/smollm2_helpers.py) takes about two minutes, the tiny qwen2 target (conftest.py) ~20 s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = 24


def _stage(stage: str, argv: list) -> None:
    from reference.stages import script_module

    rc = script_module(stage).main([str(a) for a in argv])
    if rc not in (0, None):
        raise AssertionError(f"stage {stage} exited with {rc}: {argv}")


def run_chat_pipeline(target: Path, root: Path, draft_vocab: int, threads: int = 1,
                      epochs: int = 3, lr: float = 1e-3) -> Path:
    """Every stage into `root/run` (03 keeps `draft_vocab` ids, 04 trains `epochs` at peak
    `lr`; `threads` intra-op threads for the stages); returns the work directory."""
    data = root / "data"
    data.mkdir(parents=True)
    lines = (ROOT / "datasets/samples/chat_prompts.jsonl").read_text().splitlines()[:PROMPTS]
    (data / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    recipe = json.loads((ROOT / "datasets/smollm2_demo.json").read_text())
    recipe["datasets"][0]["path"] = str(data / "prompts.jsonl")
    (data / "recipe.json").write_text(json.dumps(recipe))
    w = root / "run"
    before = os.environ.get("OMP_NUM_THREADS")
    import torch

    torch.set_num_threads(threads)
    try:
        _stage("01", ["--recipe", data / "recipe.json", "--workdir", w, "--target", target,
                      "--num-workers", "1"])
        _stage("01b", ["--workdir", w, "--target", target, "--backend", "hf",
                       "--max-new-tokens", "48", "--batch-size", "24"])
        _stage("merge", ["--workdir", w, "--eval-fraction", "0.2"])
        _stage("02b", ["--workdir", w, "--target", target, "--backend", "hf"])
        _stage("03", ["--workdir", w, "--target", target, "--draft-vocab", draft_vocab])
        _stage("04", ["--workdir", w, "--target", target, "--epochs", epochs, "--lr", lr,
                      "--max-seq-len", "512", "--pack-tokens", "512", "--num-workers", "0",
                      "--eval-every", "1000", "--log-every", "10"])
        _stage("05", ["--workdir", w, "--target", target, "--backend", "hf", "--steps", "3",
                      "--max-new-tokens", "24", "--num-prompts", "4", "--prompt-sets", "chat",
                      "--context-bucket-tokens", "64"])
    finally:
        torch.set_num_threads(int(before) if before else 1)
    shutil.copytree(data, w / "test_inputs")
    return w
