#!/usr/bin/env python3
"""Stage 01: public datasets -> conversation records, one folder per recipe dataset.

Reads a recipe from datasets/ and writes `<workdir>/01_prepared/<dataset>/conversations.jsonl`
(OpenAI-shaped messages, stable ids) plus `quarantine.jsonl` with every rejected row and why.

Tiny target (demo):
    python 01_prepare_datasets.py --recipe datasets/demo.json --workdir runs/demo
Real run:
    python 01_prepare_datasets.py --recipe datasets/kimi_k25_mix.json --workdir runs/kimi-k25
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.cli import arg, config_dict, parse_config, setup_logging
from eagle3.prepare import prepare_dataset
from eagle3.progress import format_summary, human_bytes, human_seconds
from eagle3.recipes import load_recipe
from eagle3.stage import open_stage

STAGE = "01_prepared"


@dataclass
class PrepareConfig:
    recipe: Path = arg(help="dataset recipe JSON (see datasets/)")
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    force: bool = arg(False, "redo the stage even if it is complete")
    log_level: str = arg("INFO", "logging level")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PrepareConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    recipe = load_recipe(cfg.recipe)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    stage.add_input(cfg.recipe)
    t0 = time.time()
    outputs = {}
    for spec in recipe.datasets:
        stage.add_input(spec.path)
        outputs[spec.name] = prepare_dataset(spec, stage.dir / spec.name)
    manifest = stage.finish(outputs={"datasets": outputs}, extra={"recipe": recipe.name})
    rows = {f"{name} records / quarantined": f"{c['records']} / {c['quarantined']}"
            for name, c in outputs.items()}
    rows.update(time=human_seconds(time.time() - t0), disk=human_bytes(manifest["disk_bytes"]),
                output=str(stage.dir))
    print(format_summary("01 prepare datasets", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
