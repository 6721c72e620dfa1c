"""Merge logic: tokenized datasets -> one shuffled train split and a held-out eval split.

Exact duplicates (same token ids) are removed, samples over the length limit are dropped, the
order is a seeded shuffle, and the eval split is chosen by a hash of the record id, so that a
record's split never changes when sources are added or removed.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path

import numpy as np

from eagle3.records import RecordError, read_jsonl, validate_tokenized

log = logging.getLogger(__name__)


def is_eval(record_id: str, eval_fraction: float) -> bool:
    """Stable split by id: the same id always lands in the same split."""
    h = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return (h % 1_000_000) < eval_fraction * 1_000_000


def token_hash(input_ids: list[int]) -> bytes:
    return hashlib.sha256(np.asarray(input_ids, dtype=np.int64).tobytes()).digest()


def collect(files: dict[str, Path], max_seq_len: int, quarantine) -> tuple[list[dict], dict]:
    """Read every dataset's records; returns (kept records, per-source stats)."""
    seen: set[bytes] = set()
    kept: list[dict] = []
    stats: dict[str, dict] = {}
    for source, path in sorted(files.items()):
        s = stats.setdefault(source, {"records": 0, "tokens": 0, "supervised_tokens": 0,
                                      "dropped": {}, "lengths": []})
        for rec in read_jsonl(path):
            reason = None
            try:
                validate_tokenized(rec)
                if rec["seq_len"] > max_seq_len:
                    reason = f"too long: {rec['seq_len']} > {max_seq_len}"
                elif (h := token_hash(rec["input_ids"])) in seen:
                    reason = "duplicate: same token ids as an earlier record"
                else:
                    seen.add(h)
            except RecordError as e:
                reason = f"invalid: {e}"
            if reason:
                kind = reason.split(":")[0]
                s["dropped"][kind] = s["dropped"].get(kind, 0) + 1
                quarantine.add(rec.get("id"), reason)
                continue
            s["records"] += 1
            s["tokens"] += rec["seq_len"]
            s["supervised_tokens"] += rec["n_response_tokens"]
            s["lengths"].append(rec["seq_len"])
            kept.append(rec)
    for s in stats.values():
        lengths = np.asarray(s.pop("lengths") or [0])
        s["length_p50_p90_p99_max"] = [int(np.percentile(lengths, q)) for q in (50, 90, 99, 100)]
    return kept, stats


def split_and_shuffle(records: list[dict], eval_fraction: float, seed: int):
    """(train, eval), each in a seeded shuffled order independent of input order."""
    records = sorted(records, key=lambda r: r["id"])  # input order must not matter
    random.Random(seed).shuffle(records)
    train = [r for r in records if not is_eval(r["id"], eval_fraction)]
    held = [r for r in records if is_eval(r["id"], eval_fraction)]
    return train, held
