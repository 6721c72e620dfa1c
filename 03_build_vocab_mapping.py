#!/usr/bin/env python3
"""Stage 03: the draft vocabulary (`d2t`/`t2d`) from supervised tokens of the train split.

Reads `<workdir>/01c_merged/train.jsonl`; writes `<workdir>/03_vocab/vocab_mapping.safetensors`
and `report.json` (coverage at 8K/16K/32K/64K and at the chosen size, the chosen size's coverage
of target-written and of dataset-written supervised tokens apart, top tokens); warns when
dataset-written text (recipes with "regenerate": false) chose part of the vocabulary. A bad
line of the train split (02b's check of a merged line: torn, blank, not JSON, wrong types, no
source, ids outside the target vocab, a repeated id) is skipped, listed in
`03_vocab/skipped.jsonl` and counted in the summary (the first one named), `report.json` and the
manifest; past `--max-bad` the stage stops naming the list. A split with other than the records
the merge's manifest counts (a line added or removed since) stops the stage in one line naming
the file, both counts and the first bad line.

Tiny target (demo):
    python 03_build_vocab_mapping.py --workdir runs/demo --target runs/demo/target \
        --draft-vocab 256
Real run:
    python 03_build_vocab_mapping.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.core.faults import SKIP_LIST, BadRecords, script_main
from eagle3.core.progress import format_summary, human_seconds, progress
from eagle3.core.records import count_jsonl
from eagle3.core.stage import (
    STAGE_DIRS,
    atomic_save_safetensors,
    atomic_write_json,
    open_stage,
    require_upstream,
)
from eagle3.core.target import TRUST_HELP, check_remote_code, load_tokenizer, read_target_info
from eagle3.vocab.mapping import (
    build_mapping,
    check_merged_count,
    count_supervised_by_origin,
    regenerated_datasets,
    report,
    select_hot_ids,
)

STAGE = STAGE_DIRS["03"]
UPSTREAM = STAGE_DIRS["merge"]


@dataclass
class VocabConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (config.json for the vocab size, tokenizer)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    draft_vocab: int = arg(32000, "draft vocabulary size (ids)")
    max_bad: int = arg(10, "bad lines of the merged train split (torn, not JSON, wrong types, "
                           "no source, ids outside the target vocab, a repeated id) skipped "
                           "and listed in "
                           "03_vocab/skipped.jsonl before the stage stops (-1 = no limit): a "
                           "few barely move the vocabulary, more mean the merge went wrong")

    def __post_init__(self) -> None:
        check_remote_code(self.target, self.trust_remote_code)
        if self.draft_vocab < 1:
            raise ValueError("--draft-vocab must be >= 1")
        if self.max_bad < -1:
            raise ValueError("--max-bad must be >= 0, or -1 for no limit")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(VocabConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    info = read_target_info(cfg.target)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    src = cfg.workdir / UPSTREAM / "train.jsonl"
    stage.add_input(src)
    lines = count_jsonl(src)
    bar = progress(total=lines, desc="03 count", unit="rec")
    (stage.dir / SKIP_LIST).unlink(missing_ok=True)  # every line is read again: rebuilt whole
    bad = BadRecords(stage.dir, cfg.max_bad)
    try:  # a stop past --max-bad ends the bar's line before the error's
        by_origin = count_supervised_by_origin(src, info.vocab_size,
                                               regenerated_datasets(cfg.workdir), bar, bad=bad)
    finally:
        bar.close()
        bad.close()
    check_merged_count(src, lines, upstream, cfg.workdir / UPSTREAM / "manifest.json", bad.first)
    counts = by_origin.sum(0)
    hot = select_hot_ids(counts, cfg.draft_vocab)
    mapping = build_mapping(hot, info.vocab_size)
    atomic_save_safetensors(mapping, stage.dir / "vocab_mapping.safetensors")
    rep = report(counts, hot, load_tokenizer(cfg.target, cfg.trust_remote_code),
                 by_origin=by_origin)
    rep.update(bad.summary())
    for warning in rep["warnings"]:
        logging.getLogger("03_vocab").warning(warning)
    atomic_write_json(stage.dir / "report.json", rep)
    stage.finish(outputs={"draft_vocab": cfg.draft_vocab, "target_vocab": info.vocab_size,
                          "coverage": rep["coverage"],
                          "coverage_by_origin": rep["coverage_by_origin"],
                          **bad.summary()})
    rows = {"supervised tokens": rep["supervised_tokens"],
            "distinct ids seen": rep["distinct_ids_seen"],
            f"coverage at {cfg.draft_vocab} (chosen)": f"{rep['coverage']:.4f}"}
    for origin, c in rep["coverage_by_origin"].items():
        rows[f"coverage of {origin}-written tokens"] = (f"{c['coverage']:.4f} "
                                                        f"({c['supervised_tokens']} tokens)")
    for size, share in rep["coverage_at"].items():
        rows[f"coverage at {int(size) // 1024}K"] = f"{share:.4f}"
    rows["top tokens"] = json.dumps([t["token"] for t in rep["top_tokens"][:10]],
                                    ensure_ascii=False)[:120]
    rows["bad lines skipped"] = (f"{bad.count} ({bad.path})" if bad.count else "0")
    if bad.first:  # named here too: a run at --log-level ERROR shows no warning
        rows["first bad line"] = bad.first[:160]
    rows["report"] = str(stage.dir / "report.json")
    rows.update({f"WARNING {i + 1}": w for i, w in enumerate(rep["warnings"])})
    rows["time"] = human_seconds(time.time() - t0)
    print(format_summary("03 vocab mapping", rows))
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main, "03"))
