#!/usr/bin/env python3
"""Evaluate one draft against the reference target in a process of its own.

Batch-1 decoding of a 100M-parameter target is bound by kernel launches, not by the GPU, so the
phase-3 sweeps run several of these processes side by side (reference/parallel.py). The result
is the same JSON file `DraftEvaluator.run` writes in-process (`<cache>/eval_<name>.json`); a
spec whose file exists is not evaluated again.

    python reference/eval_worker.py --target /tmp/ref/target \
        --prompts /tmp/ref/heldout/01_prepared/stdlib_heldout/conversations.jsonl \
        --prompts-workdir /tmp/ref/heldout --limit 16 --cache /tmp/ref/results/evals \
        --spec '{"name": "main", "draft": "/tmp/ref/main/04_train/final", "steps": [3, 7]}'
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import arg, parse_config, setup_logging


@dataclass
class EvalWorkerConfig:
    target: Path = arg(help="reference target folder")
    prompts: str = arg(help="prompt set (05's --prompt-sets form: a conversations JSONL)")
    prompts_workdir: Path = arg(help="work folder the prompt set is resolved against")
    limit: int = arg(help="prompts loaded (the largest num_prompts of the run's specs)")
    cache: Path = arg(help="folder of the evaluation results (and cached baselines)")
    spec: str = arg(help="the EvalSpec as JSON (name, draft, steps, num_prompts, ...)")
    device: str = arg("cuda", "torch device")
    dtype: str = arg("float32", "evaluation dtype")
    threads: int = arg(1, "torch CPU threads (several workers share the machine)")
    log_level: str = arg("INFO", "logging level")


def main(argv: list[str] | None = None) -> int:
    import torch

    from eagle3.bench.prompts import load_prompt_set
    from eagle3.core.chat import ChatRenderer
    from eagle3.core.target import load_tokenizer
    from reference.evaluate_drafts import DraftEvaluator, EvalSpec

    cfg = parse_config(EvalWorkerConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    torch.set_num_threads(max(1, cfg.threads))
    raw = json.loads(cfg.spec)
    spec = EvalSpec(**{**raw, "draft": Path(raw["draft"])})
    prompts = load_prompt_set(cfg.prompts, cfg.prompts_workdir,
                              ChatRenderer(load_tokenizer(cfg.target)), cfg.limit).prompts
    DraftEvaluator(cfg.target, prompts, cfg.cache, cfg.device, cfg.dtype).run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
