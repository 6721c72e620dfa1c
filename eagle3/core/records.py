"""The records that pass between stages (docs/PIPELINE.md, "Records") and their JSONL files.

JSONL files are written append-only: a process killed mid-write leaves at most one torn last
line, which `read_jsonl` reports and `JsonlAppender` cuts off before appending again.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
TOKENIZED_KEYS = (
    "id",
    "source",
    "input_ids",
    "loss_mask",
    "seq_len",
    "n_prompt_tokens",
    "n_response_tokens",
    "finish_reason",
)


class RecordError(ValueError):
    """A record that breaks its contract; the message names the record and the field."""


def read_jsonl(path: Path, *, drop_torn_tail: bool = True) -> Iterator[dict]:
    """Yield the records of a JSONL file.

    A last line without its newline that fails to parse is a torn write and is skipped (logged);
    any other unparsable line raises RecordError naming the file and line number.
    """
    path = Path(path)
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):  # streams: merged files reach several GB
            if not raw.strip():
                continue
            try:
                yield json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                if not raw.endswith(b"\n") and drop_torn_tail:
                    log.warning("%s: dropping torn last line %d (%d bytes)", path, n, len(raw))
                    return
                raise RecordError(f"{path}:{n}: not valid JSON ({e})") from e


def count_jsonl(path: Path) -> int:
    """Number of complete lines of a JSONL file."""
    with Path(path).open("rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


class JsonlAppender:
    """Append-only JSONL writer that first cuts off a torn last line left by a killed run."""

    def __init__(self, path: Path, fsync_every: int = 100):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_torn_tail(self.path)
        self._f = self.path.open("ab")
        self._fsync_every = fsync_every
        self._n = 0

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._n += 1
        if self._n % self._fsync_every == 0:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def hand_to_os(self) -> None:
        """Pass the buffered lines to the OS: they survive a kill of this process (not a power
        loss), so a line written to another file after this one cannot outlive it."""
        self._f.flush()

    def close(self) -> None:
        self.flush()
        self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _truncate_torn_tail(path: Path) -> None:
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    log.warning("%s: cutting torn last line (%d bytes)", path, len(data) - keep)
    with path.open("r+b") as f:
        f.truncate(keep)


@dataclass
class TokenizedRecord:
    """One training sample (01b output, merged files)."""

    id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]
    n_prompt_tokens: int
    finish_reason: str

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "source": self.source,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "seq_len": len(self.input_ids),
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_response_tokens": sum(self.loss_mask),
            "finish_reason": self.finish_reason,
        }


def validate_tokenized(rec: dict) -> dict:
    """Check a tokenized record's contract; returns it or raises RecordError naming it."""
    rid = rec.get("id", "<no id>")
    missing = [k for k in TOKENIZED_KEYS if k not in rec]
    if missing:
        raise RecordError(f"record {rid}: missing fields {missing}")
    n = len(rec["input_ids"])
    if not (n == len(rec["loss_mask"]) == rec["seq_len"]):
        raise RecordError(
            f"record {rid}: len(input_ids)={n}, len(loss_mask)={len(rec['loss_mask'])}, "
            f"seq_len={rec['seq_len']} differ"
        )
    if any(m not in (0, 1) for m in rec["loss_mask"]):
        raise RecordError(f"record {rid}: loss_mask holds values other than 0 and 1")
    if sum(rec["loss_mask"]) == 0:
        raise RecordError(f"record {rid}: no supervised token (loss_mask all 0)")
    return rec


def tokenized_problem(rec, vocab_size: int | None = None) -> str | None:
    """Why `rec` cannot be read as a tokenized record (`kind: detail`, the kind one of `bad
    record`, `bad input_ids`, `bad loss_mask`, `bad seq_len`), None when it can: the one check of
    a tokenized line that the merge, 02b and 03 run on what they read. Token ids are ints (a
    float, a string or a JSON true is no token id), non-negative and, given `vocab_size`, below
    it; `loss_mask` has one 0 or 1 per id; `seq_len`, when present, is their number."""
    if not isinstance(rec, dict):
        return f"bad record: a JSON {type(rec).__name__}, not an object"
    rid = rec.get("id")
    if not isinstance(rid, str) or not rid:
        return f"bad record: id {rid!r} is not a non-empty string"
    ids, mask = rec.get("input_ids"), rec.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        return f"bad input_ids: record {rid}: missing, empty or not a list of ints"
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        i = next(i for i, t in enumerate(ids) if t < 0 or (vocab_size and t >= vocab_size))
        return (f"bad input_ids: record {rid}: input_ids[{i}] = {ids[i]} is not a token id of "
                f"the target (vocabulary {vocab_size}); wrong --target?")
    if not isinstance(mask, list) or len(mask) != len(ids):
        got = len(mask) if isinstance(mask, list) else type(mask).__name__
        return f"bad loss_mask: record {rid}: {got} values for {len(ids)} input_ids"
    if not all(type(m) is int and m in (0, 1) for m in mask):
        return f"bad loss_mask: record {rid}: values other than 0 and 1"
    seq_len = rec.get("seq_len", len(ids))
    if type(seq_len) is not int or seq_len != len(ids):
        return f"bad seq_len: record {rid}: {seq_len!r} for {len(ids)} input_ids"
    return None

