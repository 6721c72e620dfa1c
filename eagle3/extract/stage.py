"""Stage 02b's door: `check_inputs(cfg)` before the stage folder is opened, `run(cfg, stage)` after.

The backends (`eagle3/extract/hf.py`, `eagle3/extract/sglang.py`) each expose
`extract(cfg, writers, layers, info) -> (outputs per split, manifest extras)` and share the
output writer (`eagle3/extract/writer.py`): adding a backend is one module and one entry in
`BACKENDS` (with its name in `eagle3/extract/config.py`).
"""

from __future__ import annotations

import time

from eagle3.core.faults import BadRecords, InputFileError, StopSignals
from eagle3.core.hidden_states import bytes_per_token
from eagle3.core.stage import STAGE_DIRS, Stage, StageResult, require_upstream
from eagle3.core.target import TargetInfo, default_capture_layers, read_target_info
from eagle3.extract import hf, sglang
from eagle3.extract.checks import read_split
from eagle3.extract.config import ExtractConfig
from eagle3.extract.writer import SplitWriter, check_output_disk, summary_rows

__all__ = ["BACKENDS", "ExtractConfig", "STAGE", "check_inputs", "run"]

STAGE = STAGE_DIRS["02b"]
UPSTREAM = STAGE_DIRS["merge"]
BACKENDS = {"hf": hf, "sglang": sglang}
RESUME = ("re-run the same command to resume: the files written are kept (listed in "
          f"{STAGE}/<split>/index.jsonl) and only the records without one are extracted")


def check_inputs(cfg: ExtractConfig) -> TargetInfo:
    """The merged splits are complete and there, the target readable: before any folder is
    made."""
    require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    for split in cfg.splits:
        src = cfg.workdir / UPSTREAM / f"{split}.jsonl"
        if not src.is_file():
            raise InputFileError(src, f"missing: the merge stage wrote no split {split!r} "
                                      "(re-run it, or pass --splits with the splits it wrote)")
    return read_target_info(cfg.target)


def run(cfg: ExtractConfig, stage: Stage) -> StageResult:
    """Every split through the chosen backend; the manifest once nothing failed (or
    `--accept-failures`); the summary rows. Bad records are skipped into `skipped.jsonl` (up to
    `--max-bad`); SIGTERM / SIGINT stop after the records in flight (Interrupted)."""
    info = read_target_info(cfg.target)
    layers = cfg.capture_layers or default_capture_layers(info.num_hidden_layers)
    bad = BadRecords(stage.dir, cfg.max_bad)
    stop = StopSignals(RESUME)
    t0, writers = time.time(), {}
    for split in cfg.splits:
        src = cfg.workdir / UPSTREAM / f"{split}.jsonl"
        stage.add_input(src)
        records = read_split(src, split, info.vocab_size, bad)
        writers[split] = SplitWriter(stage.dir / split, records, bad, stop)
    check_output_disk(stage.dir, list(writers.values()), info.hidden_size, cfg.dtype,
                      cfg.disk_margin, cfg.topk)
    extra = {"capture_layers": layers, "hidden_size": info.hidden_size, "backend": cfg.backend,
             "dtype": cfg.dtype, "teacher_topk": cfg.topk,
             "bytes_per_token": bytes_per_token(info.hidden_size, cfg.dtype, cfg.topk)}
    try:
        with stop:
            outputs, more = BACKENDS[cfg.backend].extract(cfg, writers, layers, info)
    finally:
        bad.close()
    stop.check()  # Interrupted: the files written are indexed, the manifest is not written
    extra.update(more)
    extra.update(bad.summary())
    failed = sum(o["failed"] for o in outputs.values())
    rows = summary_rows(outputs, time.time() - t0)
    if bad.count:
        rows["skipped as bad"] = f"{bad.count:,} {bad.reasons} (listed in {bad.path})"
    if failed and not cfg.accept_failures:
        rows["INCOMPLETE"] = (f"{failed} records failed (see <split>/failures.jsonl): re-run "
                              "this command to retry them, or add --accept-failures")
        return StageResult(rows, exit_code=2)
    manifest = stage.finish(outputs=outputs, extra=extra)
    rows["manifest"] = f"{stage.dir / 'manifest.json'} ({manifest['disk_bytes']:,} B)"
    return StageResult(rows)
