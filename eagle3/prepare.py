"""Stage 01 logic: one recipe dataset -> `conversations.jsonl` + `quarantine.jsonl`.

Each dataset folder is written whole through temp files and renames, and marked done with
`done.json` last; a killed run redoes only the datasets without that marker, so the result is
exactly that of an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.adapters import to_conversation
from eagle3.progress import progress
from eagle3.recipes import DatasetSpec, iter_rows
from eagle3.records import RecordError, validate_conversation
from eagle3.stage import atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)


def prepare_dataset(spec: DatasetSpec, out_dir: Path) -> dict:
    """Convert one dataset; returns its counts (also written to `out_dir/done.json`)."""
    out_dir = Path(out_dir)
    done = out_dir / "done.json"
    if done.exists():
        log.info("%s: already prepared, skipping", spec.name)
        return json.loads(done.read_text())
    good: list[bytes] = []
    bad: list[bytes] = []
    reasons: dict[str, int] = {}
    seen: set[str] = set()
    for n, row, error in progress(iter_rows(spec.path), desc=f"01 {spec.name}", unit="row"):
        if spec.max_samples is not None and len(good) >= spec.max_samples:
            break
        record = None
        if error is None:
            try:
                record = validate_conversation(
                    to_conversation(spec.name, spec.adapter, row, spec.id_field)
                )
                if record["id"] in seen:
                    raise RecordError(f"duplicate id: {record['id']} seen before")
            except RecordError as e:
                error, record = str(e), None
        if record is None:
            reasons[error.split(":")[0]] = reasons.get(error.split(":")[0], 0) + 1
            bad.append(_line({"source": spec.name, "row": n, "reason": error, "raw": row}))
            continue
        seen.add(record["id"])
        good.append(_line(record))
    atomic_write_bytes(out_dir / "conversations.jsonl", b"".join(good))
    atomic_write_bytes(out_dir / "quarantine.jsonl", b"".join(bad))
    counts = {"records": len(good), "quarantined": len(bad), "quarantine_reasons": reasons,
              "regenerate": spec.regenerate, "max_seq_len": spec.max_seq_len}
    atomic_write_json(done, counts)
    if bad:
        log.warning("%s: %d rows quarantined (%s) -> %s", spec.name, len(bad), reasons,
                    out_dir / "quarantine.jsonl")
    return counts


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"
