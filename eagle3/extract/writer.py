"""Stage 02b, shared by every backend: output folders, resume, disk preflight, progress, summary.

Output of a split (docs/PIPELINE.md): `<split>/shard_NNNNN/data_<idx>.pt`, idx = the record's line
index in the merged split file, each file written atomically; `<split>/index.jsonl` logs
`{idx, id, tokens, bytes, sha256}` once a file is on disk (sha256: of the file's bytes, hashed as
they are written; readers verify it), rewritten in idx order when the split ends (the same bytes
however the run was batched or killed). A full or read-only disk stops the stage with a
DiskError naming the folder and the bytes needed; no partial file is kept.

Resume is by record id: every existing file must hold the record now at its index (checked
through the log, or the file's own `meta.id` when the log lost its tail to a kill), otherwise
the merged split changed under the folder and the stage refuses to mix the two. A file found without its log line is hashed again; one that
does not load, or whose size differs from its log line, is removed and extracted again.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core import hidden_states as hs
from eagle3.core.faults import BadRecords, DiskError, StopSignals, disk_error, is_disk_error
from eagle3.core.progress import human_bytes, human_seconds, progress
from eagle3.core.records import JsonlAppender, read_jsonl
from eagle3.core.stage import StageError, atomic_write_bytes, file_sha256, sweep_temp_files
from eagle3.extract.checks import skip_key

log = logging.getLogger(__name__)

INDEX_FILE = "index.jsonl"
FAILURES_FILE = "failures.jsonl"
SUGGESTED_TOPK = 64  # K named in the disk preflight's advice


class ExtractError(StageError):
    """The stage cannot go on; the message names the record, file or flag and the fix (a
    StageError: the script's entry point prints it as one line and exits 1)."""


class VerificationFailed(ExtractError):
    """Files that differ from the transformers forward (`--verify-against-hf`); `idxs` are
    their records, whose files the stage removes (never left as good)."""

    def __init__(self, message: str, idxs: list[int]):
        super().__init__(message)
        self.idxs = idxs


@dataclass
class ExtractCounts:
    written: int = 0  # files written by this run
    skipped_existing: int = 0  # files found from an earlier run
    failed: int = 0  # records without a file at the end (see failures.jsonl)
    skipped_bad: int = 0  # records skipped as bad, this run or earlier (see skipped.jsonl)
    tokens: int = 0  # tokens in all files of the split
    bytes: int = 0  # bytes of all files of the split
    written_tokens: int = 0  # tokens in the files this run wrote
    written_bytes: int = 0


def record_meta(rec: dict, capture_layers: list[int]) -> dict:
    """The `meta` of a record's file (the pack adds `dtype`); identical for both backends."""
    return {"id": rec["id"], "capture_layers": list(capture_layers), "final": "post_norm",
            "source": rec["source"]}


class SplitWriter:
    """One split's output folder: files by record index, resumed by record id, with counts.

    `records[idx]` is None for a merged line skipped as bad (`eagle3/extract/checks.py`); `bad`
    is the stage's skip list (default: `skipped.jsonl` beside the split folder, no limit), and a
    record it lists from an earlier run (non-finite states) is not extracted again. `stop`: the
    stage's StopSignals, which the backends poll (`stopping`) between records.
    """

    def __init__(self, root: Path, records: list[dict | None], bad: BadRecords | None = None,
                 stop: StopSignals | None = None):
        self.root = Path(root)
        self.records = records
        self.bad = bad if bad is not None else BadRecords(self.root.parent, -1)
        self.stop = stop
        _check_unique_ids(records, self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_temp_files(self.root)  # open_stage swept too; a split may be written alone
        self.skipped = {i for i, r in enumerate(records)
                        if r is None or self.key(i) in self.bad.seen}
        self.done = self._scan()  # idx -> {"idx", "id", "tokens", "bytes", "sha256"}
        # Opened at the first line logged: a split the run never reached gets no index, so that
        # a stopped run leaves no index that a complete one would not write the same.
        self._index: JsonlAppender | None = None
        for entry in self.done.values():
            if entry.pop("unlogged", False):
                self._log(entry)
        self._flush_index()
        self.counts = ExtractCounts(skipped_existing=len(self.done))
        self.written_now: set[int] = set()  # records whose file this run wrote

    def path(self, idx: int) -> Path:
        return hs.file_path(self.root, idx)

    def key(self, idx: int) -> str:
        """The record's key in the skip list."""
        return skip_key(self.root.name, self.records[idx]["id"])

    @property
    def stopping(self) -> bool:
        """A stop signal arrived: take no new record."""
        return self.stop is not None and self.stop.requested

    def pending(self) -> list[int]:
        """Indices of the records without a file (and not skipped), ascending."""
        return [i for i in range(len(self.records)) if i not in self.done
                and i not in self.skipped]

    def save(self, idx: int, data: dict) -> hs.SavedFile:
        """Write record `idx`'s file (any thread); `mark_written` it afterwards."""
        return hs.save_with_sha256(data, self.path(idx))

    def mark_written(self, idx: int, tokens: int, nbytes: int, sha256: str | None = None) -> None:
        """Log a file on disk; `sha256` of its bytes (None: read back to hash it)."""
        entry = {"idx": idx, "id": self.records[idx]["id"], "tokens": tokens, "bytes": nbytes,
                 "sha256": sha256 or file_sha256(self.path(idx))}
        self._log(entry)
        self.done[idx] = entry
        self.written_now.add(idx)
        self.counts.written += 1
        self.counts.written_tokens += tokens
        self.counts.written_bytes += nbytes

    def discard(self, idxs: list[int]) -> list[Path]:
        """Remove the files of records `idxs` (found wrong after they were written): they are
        no longer done, their index lines go too (the index is rewritten from what is left, so
        that it never lists a file that is not there), and a re-run extracts them again.
        Returns the paths removed."""
        removed = []
        for idx in sorted(set(idxs)):
            entry = self.done.pop(idx, None)
            self.path(idx).unlink(missing_ok=True)
            removed.append(self.path(idx))
            if entry is None:
                continue
            if idx in self.written_now:
                self.written_now.discard(idx)
                self.counts.written -= 1
                self.counts.written_tokens -= entry["tokens"]
                self.counts.written_bytes -= entry["bytes"]
            else:  # a file of an earlier run
                self.counts.skipped_existing -= 1
        self._rewrite_index()
        return removed

    def skip(self, idx: int, reason: str) -> None:
        """Skip record `idx` as bad (never written); raises TooManyBad past `--max-bad`."""
        self.skipped.add(idx)
        self.bad.add(self.key(idx), reason)

    def close(self) -> ExtractCounts:
        """Rewrite the log in idx order; returns the counts with the totals of every file."""
        self._rewrite_index()
        c = self.counts
        c.tokens = sum(e["tokens"] for e in self.done.values())
        c.bytes = sum(e["bytes"] for e in self.done.values())
        c.skipped_bad = len(self.skipped)
        c.failed = len(self.records) - len(self.done) - len(self.skipped)
        return c

    def abandon(self) -> None:
        """After an error: hand the logged lines to the OS, best effort (a full disk may refuse
        them; those files then count as unlogged on resume and are hashed again)."""
        try:
            if self._index is not None:
                self._index.close()
                self._index = None
        except OSError as e:
            log.warning("%s: could not flush the index (%s); the resume re-reads those files",
                        self.root / INDEX_FILE, e)

    def _log(self, entry: dict) -> None:
        try:
            if self._index is None:
                self._index = JsonlAppender(self.root / INDEX_FILE)
            self._index.write(entry)
        except OSError as e:
            raise self._disk_error(e, entry) from e

    def _flush_index(self, close: bool = False) -> None:
        if self._index is None:
            return
        try:
            self._index.close() if close else self._index.flush()
        except OSError as e:
            raise self._disk_error(e, None) from e
        if close:
            self._index = None

    def _rewrite_index(self) -> None:
        """The index rewritten whole from `done`, in idx order (atomic); appending resumes
        on the new file at the next line logged."""
        self._flush_index(close=True)
        lines = (json.dumps(self.done[i], ensure_ascii=False) + "\n" for i in sorted(self.done))
        atomic_write_bytes(self.root / INDEX_FILE, "".join(lines).encode())

    def _disk_error(self, exc: OSError, entry: dict | None) -> OSError | DiskError:
        if not is_disk_error(exc):
            return exc
        need = len(json.dumps(entry)) + 1 if entry else None
        return disk_error(exc, self.root / INDEX_FILE, need)

    def _scan(self) -> dict[int, dict]:
        files = {hs.file_index(p): p for p in self.root.glob("shard_*/data_*.pt")}
        logged = {}
        if (self.root / INDEX_FILE).exists():
            logged = {e["idx"]: e for e in read_jsonl(self.root / INDEX_FILE)}
        done = {}
        for idx, path in sorted(files.items()):
            if idx >= len(self.records) or self.records[idx] is None:
                self._refuse(path, "a record index past the end of the merged split"
                             if idx >= len(self.records) else "a record whose line is now bad")
            entry = logged.get(idx)
            if entry is not None and entry["bytes"] != path.stat().st_size:
                log.warning("%s has %d bytes, its index line says %d: extracting it again",
                            path, path.stat().st_size, entry["bytes"])
                path.unlink()
                continue
            if entry is None:  # written, then killed before the log line: read the file itself
                entry = self._unlogged_entry(idx, path)
                if entry is None:
                    continue
            if entry["id"] != self.records[idx]["id"]:
                self._refuse(path, f"record {entry['id']!r}, but line {idx} of the merged "
                                   f"split is {self.records[idx]['id']!r}")
            done[idx] = entry
        return done

    @staticmethod
    def _unlogged_entry(idx: int, path: Path) -> dict | None:
        """The index entry of a file found without a log line, its sha256 read back; None
        (and the file removed, to be extracted again) when it does not load."""
        try:
            data = hs.load(path, mmap=True)
            entry = {"idx": idx, "id": data["meta"]["id"], "unlogged": True,
                     "tokens": int(data["input_ids"].shape[0]), "bytes": path.stat().st_size,
                     "sha256": file_sha256(path)}
        except Exception as e:  # torn zip, wrong pickle: our own output, so redo it
            log.warning("%s does not load (%r): extracting it again", path, e)
            path.unlink()
            return None
        return entry

    def _refuse(self, path: Path, what: str) -> None:
        raise ExtractError(f"{path} holds {what}: the merged split changed since this folder "
                           "was written. Re-run with --force to extract it again")


def _check_unique_ids(records: list[dict | None], root: Path) -> None:
    seen: dict[str, int] = {}
    for i, rec in enumerate(records):
        if rec is None:
            continue
        if rec["id"] in seen:
            raise ExtractError(f"record id {rec['id']!r} is on lines {seen[rec['id']]} and {i} "
                               f"of the split written to {root}: ids must be unique (re-run the "
                               "merge stage)")
        seen[rec["id"]] = i


class FailureLog:
    """`<split>/failures.jsonl`: records that failed every attempt, with their reasons.

    Rewritten whole at each failure (a handful of lines) and at the end, when records that now
    have a file (a re-run retried them) are dropped; the file is removed when none is left.
    """

    def __init__(self, path: Path, max_failures: int):
        self.path, self.max_failures = path, max_failures
        self.entries: dict[int, dict] = {}  # from an earlier run too, until retried
        if path.exists():
            self.entries = {e["idx"]: e for e in read_jsonl(path)}
        self.new = 0  # failures of this run

    def add(self, idx: int, record_id: str, reasons: list[str]) -> None:
        self.entries[idx] = {"idx": idx, "id": record_id, "reason": reasons[-1],
                             "attempts": len(reasons), "reasons": reasons}
        self.new += 1
        log.error("record %s failed %d times, last: %s", record_id, len(reasons), reasons[-1])
        self._write()
        if 0 <= self.max_failures < self.new:
            raise ExtractError(f"{self.new} records failed (more than --max-failures "
                               f"{self.max_failures}); something systematic is wrong: see "
                               f"{self.path}")

    def close(self, writer: SplitWriter) -> None:
        """Keep only records still without a file (a re-run may have fixed earlier ones)."""
        for idx in [i for i in self.entries if i in writer.done]:
            del self.entries[idx]
        if not self.entries:
            self.path.unlink(missing_ok=True)
        else:
            self._write()
            log.error("%d records of %s failed; they are listed in %s and retried by a re-run",
                      len(self.entries), writer.root.name, self.path)

    def _write(self) -> None:
        lines = "".join(json.dumps(e, ensure_ascii=False) + "\n"
                        for _, e in sorted(self.entries.items()))
        atomic_write_bytes(self.path, lines.encode())


# ---------------------------------------------------------------- disk preflight


def check_disk(path: Path, need_bytes: int, margin: float, detail: str, fix: str) -> None:
    """Refuse, with the numbers, when `need_bytes` plus `margin` (a fraction) is not free."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    want = int(need_bytes * (1 + margin))
    if want > free:
        raise ExtractError(
            f"not enough disk at {path}: need {human_bytes(need_bytes)} ({detail}) plus a "
            f"{margin:.0%} margin = {human_bytes(want)}, but only {human_bytes(free)} is free. "
            f"{fix}")
    log.info("disk: %s needed (%s), %s free at %s", human_bytes(need_bytes), detail,
             human_bytes(free), path)


def check_output_disk(stage_dir: Path, writers: list[SplitWriter], hidden_size: int,
                      dtype: str, margin: float, topk: int = 0) -> int:
    """Preflight of the files still to write; returns the estimated bytes."""
    tokens = sum(len(w.records[i]["input_ids"]) for w in writers for i in w.pending())
    files = sum(len(w.pending()) for w in writers)
    need = hs.estimate_bytes(tokens, files, hidden_size, dtype, topk)
    detail = (f"{tokens:,} tokens x {hs.bytes_per_token(hidden_size, dtype, topk):,} "
              f"bytes/token ({dtype}) + {files:,} files x {hs.FILE_OVERHEAD_BYTES:,} B")
    fix = "Free space or point --workdir at a larger disk"
    options = {d: hs.estimate_bytes(tokens, files, hidden_size, d, SUGGESTED_TOPK)
               for d in hs.DTYPES}
    smaller = [f"--dtype {d}{' --teacher-topk 64' if d == 'fp8-topk' else ''}: {human_bytes(b)}"
               for d, b in options.items() if b < need]
    if smaller:
        fix += ", or store less (" + "; ".join(smaller) + ")"
    check_disk(stage_dir, need, margin, detail, fix)
    return need


# ---------------------------------------------------------------- progress


class ExtractProgress:
    """A bar over tokens (so the ETA weighs long samples right) with samples/s and GB written."""

    def __init__(self, writer: SplitWriter, desc: str):
        self.total_samples = len(writer.records)
        self.samples = len(writer.done)
        done_tokens = sum(e["tokens"] for e in writer.done.values())
        self.bar = progress(total=sum(len(writer.records[i]["input_ids"])
                                      for i in [*writer.done, *writer.pending()]),
                            desc=desc, unit="tok")
        self.bar.unit_scale = True
        self.bar.n = self.bar.last_print_n = self.bar.initial = done_tokens  # rate: this run
        self.new_samples, self.new_bytes, self.t0 = 0, 0, time.time()
        self._show()

    def advance(self, tokens: int, nbytes: int) -> None:
        self.samples += 1
        self.new_samples += 1
        self.new_bytes += nbytes
        self._show(refresh=False)
        self.bar.update(tokens)

    def _show(self, refresh: bool = True) -> None:
        rate = self.new_samples / max(time.time() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.samples}/{self.total_samples} samples ({rate:.1f}/s) "
                                 f"| {self.new_bytes / 1e9:.2f} GB written", refresh=refresh)

    def close(self) -> None:
        self.bar.close()


def summary_rows(outputs: dict, seconds: float) -> dict:
    """Rows of the stage's summary table from the per-split counts."""
    rows = {}
    for split, o in outputs.items():
        rows[f"{split} samples (written / resumed / failed / skipped as bad)"] = (
            f"{o['samples']:,} ({o['written']:,} / {o['skipped_existing']:,} / {o['failed']:,} "
            f"/ {o['skipped_bad']:,})")
    tokens = sum(o["tokens"] for o in outputs.values())
    nbytes = sum(o["bytes"] for o in outputs.values())
    new_tokens = sum(o["written_tokens"] for o in outputs.values())
    new_samples = sum(o["written"] for o in outputs.values())
    rows["tokens (all files)"] = f"{tokens:,}"
    rows["bytes per token"] = f"{nbytes / max(tokens, 1):,.0f}"
    rows["disk (all files)"] = human_bytes(nbytes)
    rows["this run"] = (f"{new_samples / max(seconds, 1e-9):,.2f} samples/s, "
                        f"{new_tokens / max(seconds, 1e-9):,.0f} tokens/s, "
                        f"{human_bytes(sum(o['written_bytes'] for o in outputs.values()))} in "
                        f"{human_seconds(seconds)}")
    return rows
