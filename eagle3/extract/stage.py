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
from eagle3.core.progress import human_bytes
from eagle3.core.spool import Spool
from eagle3.core.stage import STAGE_DIRS, Stage, StageResult, require_upstream
from eagle3.core.target import TargetInfo, default_capture_layers, read_target_info
from eagle3.extract import hf, sglang
from eagle3.extract.checks import read_split
from eagle3.extract.config import ExtractConfig
from eagle3.extract.writer import SplitWriter, check_disk, check_output_disk, summary_rows

__all__ = ["BACKENDS", "ExtractConfig", "STAGE", "check_inputs", "run"]

STAGE = STAGE_DIRS["02b"]
UPSTREAM = STAGE_DIRS["merge"]
BACKENDS = {"hf": hf, "sglang": sglang}
RESUME = ("re-run the same command to resume: the files written are kept (listed in "
          f"{STAGE}/<split>/index.jsonl) and only the records without one are extracted")


def _run_stream(cfg: ExtractConfig, stage: Stage, writers: dict, train: list, layers: list[int],
                info: TargetInfo, bad: BadRecords, stop: StopSignals) -> tuple[dict, dict]:
    """Stream mode: the other splits as usual, then the train split through the spool."""
    from eagle3.extract.stream import HfStream, SglangStream, run_stream

    spool = Spool(cfg.spool_dir)
    check_spool_disk(spool.root, cfg.spool_gb)
    layout = {"capture_layers": layers, "hidden_size": info.hidden_size, "dtype": cfg.dtype,
              "topk": cfg.topk, "vocab_sha256": _vocab_sha(cfg), "offline_splits": list(writers),
              "eval_ready": False}
    spool.write_producer({**layout, "state": "writing the offline splits"})
    backend = HfStream(cfg, layers) if cfg.backend == "hf" else SglangStream(cfg, layers, info)
    try:
        if cfg.backend == "sglang":
            backend.preflight([*writers.values(), _AllPending(train)])
        outputs, more = backend.offline(writers) if writers else ({}, {})
        layout["eval_ready"] = True
        spool.write_producer({**layout, "state": "offline splits written"})
        outputs["train"], extra = run_stream(cfg, stage.dir, train, layout, bad, stop, backend)
    finally:
        backend.close()
    return outputs, {**more, **extra}


class _AllPending:
    """The train split as the sglang preflight sees it (its sizes for the auto concurrency)."""

    def __init__(self, records: list):
        self.records = records

    def pending(self) -> list[int]:
        return [i for i, r in enumerate(self.records) if r is not None]


def _vocab_sha(cfg: ExtractConfig) -> str | None:
    """The draft vocabulary of an fp8-topk teacher (04 checks its own against it)."""
    if cfg.dtype != "fp8-topk":
        return None
    from safetensors.torch import load_file

    from eagle3.vocab.mapping import MAPPING_FILE, vocab_sha256

    return vocab_sha256(load_file(str(cfg.workdir / STAGE_DIRS["03"] / MAPPING_FILE))["d2t"])


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
    streamed = {}
    for split in cfg.splits:
        src = cfg.workdir / UPSTREAM / f"{split}.jsonl"
        stage.add_input(src)
        records = read_split(src, split, info.vocab_size, bad)
        if cfg.stream and split == "train":
            streamed[split] = records
            continue
        writers[split] = SplitWriter(stage.dir / split, records, bad, stop)
    check_output_disk(stage.dir, list(writers.values()), info.hidden_size, cfg.dtype,
                      cfg.disk_margin, cfg.topk)
    extra = {"capture_layers": layers, "hidden_size": info.hidden_size, "backend": cfg.backend,
             "dtype": cfg.dtype, "teacher_topk": cfg.topk,
             "bytes_per_token": bytes_per_token(info.hidden_size, cfg.dtype, cfg.topk)}
    try:
        with stop:
            if cfg.stream:
                outputs, more = _run_stream(cfg, stage, writers, streamed["train"], layers,
                                            info, bad, stop)
            else:
                outputs, more = BACKENDS[cfg.backend].extract(cfg, writers, layers, info)
    finally:
        bad.close()
    stop.check()  # Interrupted: the files written are indexed, the manifest is not written
    extra.update(more)
    extra.update(bad.summary())
    offline = {k: o for k, o in outputs.items() if not o.get("stream")}
    # a streamed record that failed is left out of 04's rows (listed in train_failures.jsonl):
    # 04 has read past it, so it does not hold the stage open
    failed = sum(o["failed"] for o in offline.values())
    rows = summary_rows(offline, time.time() - t0)
    if cfg.stream:  # "this run" would be the eval split's rate over the whole stage
        del rows["this run"]
        rows.update(stream_rows(extra["stream"], outputs["train"], time.time() - t0))
    if bad.count:
        rows["skipped as bad"] = f"{bad.count:,} {bad.reasons} (listed in {bad.path})"
    if failed and not cfg.accept_failures:
        rows["INCOMPLETE"] = (f"{failed} records failed (see <split>/failures.jsonl): re-run "
                              "this command to retry them, or add --accept-failures")
        return StageResult(rows, exit_code=2)
    manifest = stage.finish(outputs=outputs, extra=extra)
    rows["manifest"] = f"{stage.dir / 'manifest.json'} ({manifest['disk_bytes']:,} B)"
    return StageResult(rows)


def check_spool_disk(root, spool_gb: float) -> None:
    """The spool's filesystem has room for its budget."""
    check_disk(root, int(spool_gb * 1e9), 0.0, f"--spool-gb {spool_gb:g}",
               "Free space, lower --spool-gb or point --spool at a larger disk")


def stream_rows(stream: dict, train: dict, seconds: float) -> dict:
    """The summary rows of stream mode."""
    return {
        "train prefill rate (whole stage, waits included)": (
            f"{train['prefill_tokens'] / max(seconds, 1e-9):,.0f} tokens/s"),
        "train (stream): files / kept links / skipped / failed": (
            f"{train['extracted']:,} / {train['linked']:,} / {train['skipped_bad']:,} / "
            f"{train['failed']:,}"),
        "spool peak": (f"{human_bytes(stream['peak_bytes'])} of {human_bytes(stream['budget_bytes'])}"
                       f" ({stream['spool']})"),
        "target prefill": (f"{train['prefill_tokens']:,} tokens: {stream['prefill_passes']:.2f} "
                           f"passes over the split for {stream['epochs']} epochs "
                           f"({stream['kept_records']:,} records kept for the later epochs)"),
        "waited for 04 (spool full) / for its plan": (f"{stream['backpressure_s']:.0f}s / "
                                                      f"{stream['plan_wait_s']:.0f}s"),
        "04 restarts met": str(stream["rewinds"]),
    }
