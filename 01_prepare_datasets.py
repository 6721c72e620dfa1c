#!/usr/bin/env python3
"""Stage 01: public datasets (or prompts the target writes itself) -> conversation records and
token-exact samples, per dataset.

Reads a recipe from datasets/ and writes, for each of its datasets,
`<workdir>/01_prepared/<dataset>/conversations.jsonl` (OpenAI-shaped messages, stable ids),
`tokenized.jsonl` (datasets whose replies are kept: input_ids + loss_mask rendered with the
target's chat template, docs/PIPELINE.md "Records") and `quarantine.jsonl` (every rejected row and
why). Datasets run in parallel worker processes, in chunks; killed and re-run with the same
command, the stage continues from the finished chunks and ends with the same bytes. A
`self_written` dataset is first written by the target (in process, or through an SGLang server
with --gen-backend sglang), round by round (a re-run resumes), with `heldout.jsonl` beside it.

Tiny target (demo):
    python 01_prepare_datasets.py --recipe datasets/demo.json --workdir runs/demo \
        --target runs/demo/target
Real run:
    python 01_prepare_datasets.py --recipe datasets/kimi_k25_mix.json --workdir runs/kimi-k25 \
        --target /models/Kimi-K2.5 --num-workers 32
SmolLM2 writing its own prompts on a GPU:
    python 01_prepare_datasets.py --recipe datasets/smollm2_self_written.json \
        --workdir runs/smollm2-self --target runs/smollm2/target --device cuda \
        --dtype bfloat16 --gen-batch-size 512
"""

from __future__ import annotations

import os
import sys

from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.faults import script_main
from eagle3.core.progress import format_summary
from eagle3.core.stage import open_stage
from eagle3.prepare.recipes import RecipeError
from eagle3.prepare.sources import SourceError
from eagle3.prepare.stage import STAGE, PrepareConfig, check_inputs, run

__all__ = ["PrepareConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PrepareConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    # One tokenizer thread per worker process: the pool provides the parallelism.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        recipe, sources = check_inputs(cfg)
    except (RecipeError, SourceError) as e:
        print(f"01_prepare_datasets: {e}", file=sys.stderr)
        return 2
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    result = run(cfg, stage, recipe, sources)
    if result.rows is not None:
        print(format_summary("01 prepare datasets", result.rows))
    if result.error:
        print(result.error, file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(script_main(main, "01"))
