#!/usr/bin/env python3
"""Merge stage: 01b tokenized datasets -> `01c_merged/train.jsonl` and `01c_merged/eval.jsonl`.

Drops invalid records, drops or truncates samples over `--max-seq-len` (per source, as its
recipe entry says: `overlength`), removes exact duplicates by token hash, applies the recipe's
per-source `merge_weight` and `merge_cap`, shuffles by seed and holds out an eval split chosen
by conversation id. Writes `stats.json` (per source: records, tokens, supervised tokens,
truncated, dropped and why, length percentiles), prints it as a table, and lists every record
dropped by a policy (too long, duplicate, weight, cap) in `quarantine.jsonl`. A damaged input
line (torn, empty, not JSON, a record breaking the tokenized contract) is skipped, counted as
`invalid` in stats.json and listed in `skipped.jsonl` (the manifest says how many and why); past
`--max-bad` of them the stage stops. 01b's manifest must agree with its files (datasets, record
counts), else the stage stops naming both. The recipe's fields come from
`01_prepared/manifest.json`. Outputs are written through temp files renamed at the end, so a
killed run (or one stopped by a full disk, which names the folder and the bytes needed) simply
runs again and ends with the same bytes.

Tiny target (demo):
    python datasets/merge_and_shuffle.py --workdir runs/demo --eval-fraction 0.1
Real run:
    python datasets/merge_and_shuffle.py --workdir runs/kimi-k25 --max-seq-len 8192
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.core.faults import SKIP_LIST, BadRecords, disk_errors_named, script_main
from eagle3.core.progress import format_summary, human_bytes, human_seconds
from eagle3.core.stage import (
    STAGE_DIRS,
    Quarantine,
    atomic_write_json,
    open_stage,
    read_manifest,
    require_upstream,
)
from eagle3.prepare.merge import (
    SourcePolicy,
    apply_policies,
    check_upstream_counts,
    dedupe,
    format_stats_table,
    scan,
    split_and_shuffle,
    write_split,
)

STAGE = STAGE_DIRS["merge"]
UPSTREAM = STAGE_DIRS["01b"]
RECIPE_STAGE = STAGE_DIRS["01"]
log = logging.getLogger("merge_and_shuffle")


@dataclass
class MergeConfig(UpstreamStageFlags):
    max_seq_len: int = arg(8192, "tokens; longer samples are dropped or truncated, as each "
                                 "source's recipe entry says (overlength)")
    eval_fraction: float = arg(0.02, "share of conversations held out for eval, by id hash "
                                     "(0-0.5)")
    seed: int = arg(0, "seed of the shuffle and of the per-source weight/cap picks")
    max_bad: int = arg(10, "damaged input lines (torn, not JSON, not a tokenized record) "
                           "skipped and listed in skipped.jsonl before the stage stops; 01b "
                           "writes none, so any is damage: 10 rides over a few and stops on a "
                           "wrong or corrupt file (0 = stop at the first, -1 = no limit)")

    def __post_init__(self) -> None:
        if self.max_bad < -1:
            raise ValueError("--max-bad must be >= 0, or -1 for no limit")
        if not 0 <= self.eval_fraction <= 0.5:
            raise ValueError("--eval-fraction must be within [0, 0.5]")
        if self.max_seq_len < 2:
            raise ValueError("--max-seq-len must be >= 2")


def source_policies(workdir: Path) -> dict[str, SourcePolicy]:
    """Each dataset's merge fields from 01's manifest (defaults when it is missing)."""
    manifest = read_manifest(workdir / RECIPE_STAGE)
    if manifest is None:
        log.warning("%s has no manifest: no per-source caps, weights or truncation",
                    workdir / RECIPE_STAGE)
        return {}
    datasets = manifest.get("outputs", {}).get("datasets", {})
    return {name: SourcePolicy(d.get("merge_cap"), d.get("merge_weight", 1.0),
                               d.get("overlength", "drop")) for name, d in datasets.items()}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(MergeConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    files = {p.parent.name: p for p in sorted((cfg.workdir / UPSTREAM).glob("*/tokenized.jsonl"))}
    check_upstream_counts(upstream, files, cfg.workdir / UPSTREAM / "manifest.json")
    for path in files.values():
        stage.add_input(path)
    policies = source_policies(cfg.workdir)
    for name in ("quarantine.jsonl", SKIP_LIST):  # rebuilt whole on every run
        (stage.dir / name).unlink(missing_ok=True)
    quarantine, bad = Quarantine(stage.dir / "quarantine.jsonl"), BadRecords(stage.dir, cfg.max_bad)
    with disk_errors_named(quarantine.path):
        entries, paths, stats = scan(files, cfg.max_seq_len, policies, quarantine, bad)
        entries = apply_policies(dedupe(entries, stats, quarantine), policies, stats, cfg.seed)
        quarantine.close()
        bad.close()
    train, held = split_and_shuffle(entries, cfg.eval_fraction, cfg.seed)
    train_tokens = write_split(stage.dir / "train.jsonl", train, paths, stats, "merge train")
    eval_tokens = write_split(stage.dir / "eval.jsonl", held, paths, stats, "merge eval")
    report = {s: st.to_json() for s, st in stats.items()}
    atomic_write_json(stage.dir / "stats.json", report)
    outputs = {"train": len(train), "eval": len(held), "dropped": quarantine.count,
               "train_tokens": train_tokens, "eval_tokens": eval_tokens, **bad.summary()}
    manifest = stage.finish(outputs=outputs, extra={
        "upstream_complete": bool(upstream and upstream.get("complete")),
        "policies": {s: p.__dict__ for s, p in policies.items()}})
    print(format_stats_table(report))
    print(format_summary("merge and shuffle", {
        "train records / tokens": f"{len(train):,} / {train_tokens:,}",
        "eval records / tokens": f"{len(held):,} / {eval_tokens:,}",
        "dropped (quarantine.jsonl)": quarantine.count,
        f"damaged lines skipped ({SKIP_LIST})": bad.count,
        "time": human_seconds(time.time() - t0), "disk": human_bytes(manifest["disk_bytes"]),
        "stats": str(stage.dir / "stats.json")}))
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main, "merge"))
