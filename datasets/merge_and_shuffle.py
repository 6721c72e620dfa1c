#!/usr/bin/env python3
"""Merge stage: 01b tokenized datasets -> `01c_merged/train.jsonl` and `01c_merged/eval.jsonl`.

Removes exact duplicates, drops samples over `--max-seq-len`, shuffles by seed and holds out an
eval split chosen by record id. Writes `stats.json` (per source: records, tokens, supervised
tokens, dropped and why, length percentiles) and prints it as a table. Outputs are written
whole through temp files, so a killed run simply runs again.

Tiny target (demo):
    python datasets/merge_and_shuffle.py --workdir runs/demo --eval-fraction 0.1
Real run:
    python datasets/merge_and_shuffle.py --workdir runs/kimi-k25 --max-seq-len 8192
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eagle3/ sits one level up

from eagle3.cli import arg, config_dict, parse_config, setup_logging  # noqa: E402
from eagle3.merge import collect, split_and_shuffle  # noqa: E402
from eagle3.progress import format_summary, human_seconds  # noqa: E402
from eagle3.stage import Quarantine, atomic_write_bytes, atomic_write_json  # noqa: E402
from eagle3.stage import open_stage, require_upstream  # noqa: E402

STAGE = "01c_merged"
UPSTREAM = "01b_generated"


@dataclass
class MergeConfig:
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    max_seq_len: int = arg(8192, "drop samples longer than this many tokens")
    eval_fraction: float = arg(0.02, "share of records held out for eval, by id hash (0-0.5)")
    seed: int = arg(0, "shuffle seed")
    allow_partial: bool = arg(False, "accept an incomplete 01b_generated folder")
    force: bool = arg(False, "redo the stage even if it is complete")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if not 0 <= self.eval_fraction <= 0.5:
            raise ValueError("--eval-fraction must be within [0, 0.5]")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(MergeConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    files = {p.parent.name: p for p in sorted((cfg.workdir / UPSTREAM).glob("*/tokenized.jsonl"))}
    for path in files.values():
        stage.add_input(path)
    (stage.dir / "quarantine.jsonl").unlink(missing_ok=True)
    quarantine = Quarantine(stage.dir / "quarantine.jsonl")
    records, stats = collect(files, cfg.max_seq_len, quarantine)
    quarantine.close()
    train, held = split_and_shuffle(records, cfg.eval_fraction, cfg.seed)
    for name, split in (("train", train), ("eval", held)):
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in split)
        atomic_write_bytes(stage.dir / f"{name}.jsonl", data)
    atomic_write_json(stage.dir / "stats.json", stats)
    outputs = {"train": len(train), "eval": len(held), "dropped": quarantine.count,
               "train_tokens": sum(r["seq_len"] for r in train)}
    stage.finish(outputs=outputs, extra={"upstream_complete": bool(upstream)})
    rows = {f"{src}": f"{s['records']} rec, {s['tokens']} tok, {s['supervised_tokens']} sup, "
                      f"dropped {s['dropped'] or 0}, len p50/p90/p99/max "
                      f"{s['length_p50_p90_p99_max']}" for src, s in stats.items()}
    rows.update(train=len(train), eval=len(held), time=human_seconds(time.time() - t0))
    print(format_summary("merge and shuffle", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
