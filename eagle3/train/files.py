"""The hidden-state files 04 trains on, checked: the split's index and folder must agree, every
file passes a header pre-flight before the first step, and each is verified where it is read.

- `check_split`: the files of `<02b>/<split>/` as its `index.jsonl` lists them. A line whose
  file is missing, a file without a line, and a file whose header is bad (unreadable, emptied,
  wrong keys, dtype, shape, hidden size, capture layers) or disagrees with its line (record id,
  token count, size) are skipped and listed in the skip list (`04_train/skipped.jsonl`); the
  others are the split, in record-index order. Memory-mapped: only headers are read.
- `read_sample`: one file's full read for training: its sha256 checked against the index (when
  the index has one) and every value finite; a bad file gives a reason instead of data.
- `SkipCountingLoader`: the DataLoader seen by the loop. Workers only report the records they
  skipped (in the row, under `skipped`); this wrapper lists them in the main process (one writer
  of the skip list per rank) and stops the run between rows once SIGTERM/SIGINT came.

A record is skipped the same way in every attempt (the checks depend on the file only; one
listed by an earlier attempt is skipped without being read again), so an exact resume meets the
same skips and the list counts each record once.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core import hidden_states as hs
from eagle3.core.faults import BadRecords, InputFileError, StopSignals
from eagle3.extract.writer import INDEX_FILE

log = logging.getLogger(__name__)

INDEX_KEYS = ("idx", "id", "tokens", "bytes")  # every line has these; "sha256" since checksums


@dataclass
class FileIndex:
    """Per file of a split: token count, and K of its stored teacher (0: the file stores the
    final state) with the draft vocabulary it was made with (fp8-topk files only)."""

    lengths: list[int] = field(default_factory=list)
    topk: list[int] = field(default_factory=list)
    vocab_sha256: list[str | None] = field(default_factory=list)


class SplitFiles(list):
    """Paths of a split's good files (record-index order) with what reading them needs: record
    ids, checksums (None: the index has none), the hidden size (an all-skipped row's width), and
    the run's skip list and stop signals (main process only: not sent to loader workers)."""

    def __init__(self, paths=(), ids=(), sha256=(), hidden_size: int = 0,
                 bad: BadRecords | None = None, stop: StopSignals | None = None):
        super().__init__(paths)
        self.ids, self.sha256, self.hidden_size = list(ids), list(sha256), hidden_size
        self.bad, self.stop = bad, stop
        self.known_bad = set(bad.seen) if bad is not None else set()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "bad": None, "stop": None}


def read_split_index(root: Path) -> dict[int, dict]:
    """idx -> line of `<root>/index.jsonl`. A missing index, a line that is not JSON or lacks a
    key, or an idx listed twice raises InputFileError naming the index and the line."""
    path = Path(root) / INDEX_FILE
    if not path.is_file():
        raise InputFileError(path, "missing: 02b's index of the split is not there (re-run 02b: "
                                   "it rebuilds the index from the files it finds)")
    entries: dict[int, dict] = {}
    for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
            missing = [k for k in INDEX_KEYS if k not in entry]
            idx = int(entry["idx"]) if not missing else None
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as e:
            raise InputFileError(path, f"line {n} is not an index entry ({e}): the index was "
                                       "edited or damaged; re-run 02b to rebuild it") from e
        if missing:
            raise InputFileError(path, f"line {n} lacks {missing}: re-run 02b to rebuild it")
        if idx in entries:
            raise InputFileError(path, f"line {n} lists record index {idx} again: re-run 02b "
                                       "to rebuild the index")
        entries[idx] = entry
    return entries


def check_split(root: Path, hidden_size: int, capture_layers: list[int] | None,
                bad: BadRecords | None, bar=None, stop: StopSignals | None = None
                ) -> tuple[SplitFiles, FileIndex]:
    """The split's good files and their FileIndex after the pre-flight; bad files go to `bad`
    (raise InputFileError without)."""
    root = Path(root)
    entries = read_split_index(root)
    on_disk = {hs.file_index(p): p for p in root.glob("shard_*/data_*.pt")}
    files = SplitFiles(hidden_size=hidden_size, bad=bad, stop=stop)
    index = FileIndex()
    for idx in sorted(entries.keys() | on_disk.keys()):
        if stop is not None:
            stop.check()
        entry, path = entries.get(idx), on_disk.get(idx, hs.file_path(root, idx))
        # the skip-list key: `<split>:<record id>` (ids are unique within a split only)
        record_id = f"{root.name}:{entry['id'] if entry else f'data_{idx}'}"
        try:
            got = _check_file(path, entry, hidden_size, capture_layers)
        except InputFileError as e:
            if bad is None:
                raise
            bad.add(record_id, e.problem, path)
        else:
            files.append(path)
            files.ids.append(record_id)
            files.sha256.append(entry.get("sha256"))
            index.lengths.append(got.tokens)
            index.topk.append(got.topk)
            index.vocab_sha256.append(got.vocab_sha256)
        if bar is not None:
            bar.update(1)
    if files and all(s is None for s in files.sha256):
        log.warning("%s has no checksums (written before 02b recorded them): its files are "
                    "read unverified", root / INDEX_FILE)
    return files, index


def _check_file(path: Path, entry: dict | None, hidden_size: int,
                capture_layers: list[int] | None) -> hs.FileFacts:
    """The header pre-flight of one file, and its agreement with its index line."""
    if entry is None:
        raise InputFileError(path, f"unindexed: no line in {INDEX_FILE} (copied in, or written "
                                   "after 02b's index): re-run 02b to index it")
    if not path.is_file():
        raise InputFileError(path, f"missing: {INDEX_FILE} lists record {entry['id']!r} at "
                                   f"index {entry['idx']}, but its file is not there")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise InputFileError(path, f"wrong size: {size:,} bytes, {INDEX_FILE} says "
                                   f"{entry['bytes']:,} (truncated or replaced)")
    got = hs.check_header(path, hidden_size, capture_layers)
    if got.record_id != entry["id"] or got.tokens != entry["tokens"]:
        raise InputFileError(path, f"index mismatch: the file holds record {got.record_id!r} "
                                   f"of {got.tokens} tokens, {INDEX_FILE} says "
                                   f"{entry['id']!r} of {entry['tokens']}")
    return got


def read_sample(files: list[Path], j: int) -> tuple[dict | None, dict | None]:
    """(data, None) for a good file j of `files`, else (None, skip) with skip = {id, file,
    reason}: listed by an earlier attempt (not read again), checksum mismatch, unreadable,
    tokens and states of different lengths, or a non-finite value."""
    path = files[j]
    record_id = files.ids[j] if isinstance(files, SplitFiles) else str(path)
    sha = files.sha256[j] if isinstance(files, SplitFiles) else None

    def skip(reason: str):
        return None, {"id": record_id, "file": str(path), "reason": reason}

    if isinstance(files, SplitFiles) and record_id in files.known_bad:
        return skip("listed by an earlier attempt")
    try:
        data = hs.load_checked(path, sha)
    except InputFileError as e:
        return skip(e.problem)
    T = data["input_ids"].shape[0]
    if any(t.shape[0] != T for t in data["hidden_states"]):
        return skip(f"wrong shape: input_ids has {T} tokens, a hidden-state tensor another count")
    problem = hs.nonfinite_problem(data)
    return (data, None) if problem is None else skip(problem)


class SkipCountingLoader:
    """Iterates `loader` (rows of PackedRows): takes each row's `skipped` records off the row
    and lists them in the skip list of `files` (or logs them without one), then stops the run
    (Interrupted) before handing over a row once a stop signal came."""

    def __init__(self, loader, files: list[Path]):
        self.loader = loader
        self.bad = getattr(files, "bad", None)
        self.stop = getattr(files, "stop", None)
        self.on_row = getattr(files, "on_row", None)  # stream mode: report the position

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for row in self.loader:
            for s in row.pop("skipped", []):
                if self.bad is not None:
                    self.bad.add(s["id"], s["reason"], s["file"])
                else:
                    log.warning("skipped %s (%s): %s", s["id"], s["file"], s["reason"])
            next_demand = row.pop("stream_next", None)
            if next_demand is not None and self.on_row is not None:
                self.on_row(next_demand)
            if self.stop is not None:
                self.stop.check()  # between rows: the step in flight is abandoned
            yield row


def save_checked(path: Path, root: Path, files: SplitFiles, index: FileIndex) -> None:
    """Rank 0's pre-flight result, for the other ranks (`load_checked_split`)."""
    from eagle3.core.stage import atomic_write_json

    atomic_write_json(path, {"files": [str(p.relative_to(root)) for p in files],
                             "ids": files.ids, "sha256": files.sha256,
                             "lengths": index.lengths, "topk": index.topk,
                             "vocab_sha256": index.vocab_sha256})


def load_checked_split(path: Path, root: Path, hidden_size: int, bad: BadRecords | None,
                       stop: StopSignals | None) -> tuple[SplitFiles, FileIndex]:
    """What `save_checked` wrote this run (the ranks after 0 do not check the files again)."""
    saved = json.loads(Path(path).read_text())
    files = SplitFiles([Path(root) / f for f in saved["files"]], saved["ids"], saved["sha256"],
                       hidden_size, bad, stop)
    return files, FileIndex(saved["lengths"], saved["topk"], saved["vocab_sha256"])
