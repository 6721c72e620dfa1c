"""Faults every stage meets the same way (docs/PIPELINE.md, "Faults").

- Typed errors, all `StageError`: `InputFileError` (an input file that is truncated, corrupt or
  breaks its contract: the message names the file and what is wrong), `DiskError` (the disk filled
  up or turned read-only mid-write: names the folder and the bytes the write needed),
  `TooManyBad` (more skipped records than `--max-bad`: names the skip list).
- `BadRecords`: a stage's skip list (`skipped.jsonl` in its folder, append-only), with the
  budget past which the stage stops. A record that fails validation is written there with the
  reason and counted in the summary and the manifest; it is never used as good.
- `StopSignals`: SIGTERM / SIGINT become a flag that a stage polls between records; the stage
  finishes or abandons the record in flight, keeps what is complete, and raises `Interrupted`.
  A second signal interrupts at once (KeyboardInterrupt).
- `script_main`: a numbered script's entry point. It turns the errors above (and an ENOSPC /
  EROFS that escaped every writer) into one line on stderr and an exit code, never a traceback:
  1 for a stage error, 128 + the signal number for an interrupted run.
"""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from eagle3.core.stage import DISK_ERRNOS, DiskError, StageError, disk_error, is_disk_error

__all__ = ["DISK_ERRNOS", "BadRecords", "DiskError", "InputFileError", "Interrupted",
           "StopSignals", "TooManyBad", "disk_error", "is_disk_error", "script_main"]

log = logging.getLogger(__name__)

SKIP_LIST = "skipped.jsonl"


class InputFileError(StageError):
    """An input file that cannot be used: the message names the file and what is wrong."""

    def __init__(self, path: Path | str, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


class TooManyBad(StageError):
    """More bad records than the stage's `--max-bad` allows."""


class Interrupted(RuntimeError):
    """The stage stopped on a signal after keeping what was complete."""

    def __init__(self, signum: int, resume: str = "re-run the same command to resume"):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}; what was complete is kept: {resume}")


class BadRecords:
    """The skip list of one stage: `<stage dir>/skipped.jsonl`, one line per bad record (its id,
    the file at fault, the reason). `max_bad` < 0 means no limit; past it `add` raises TooManyBad.

    On a resumed run the lines already in the list are counted again, so the budget and the
    summary cover the whole stage, not only the last attempt; `seen` tells a record skipped by
    an earlier attempt (the stage skips it again without re-reading it)."""

    def __init__(self, stage_dir: Path, max_bad: int, flag: str = "--max-bad"):
        from eagle3.core.records import read_jsonl

        self.path = Path(stage_dir) / SKIP_LIST
        self.max_bad, self.flag = max_bad, flag
        self.reasons: dict[str, int] = {}
        self.seen: set[str] = set()
        self.first: str | None = None  # the first record skipped by this run, as logged
        if self.path.exists():
            for row in read_jsonl(self.path):
                self._count(str(row.get("id")), row.get("reason", ""))
        self._out = None

    @property
    def count(self) -> int:
        return len(self.seen)

    def _count(self, record_id: str, reason: str) -> None:
        if record_id in self.seen:
            return
        self.seen.add(record_id)
        kind = reason.split(":")[0]
        self.reasons[kind] = self.reasons.get(kind, 0) + 1

    def add(self, record_id: Any, reason: str, file: Path | str | None = None) -> None:
        """Skip one record; raises TooManyBad once more than `max_bad` are skipped."""
        from eagle3.core.records import JsonlAppender

        record_id = str(record_id)
        if record_id not in self.seen:
            if self._out is None:
                self._out = JsonlAppender(self.path, fsync_every=1)
            self._out.write({"id": record_id, "file": None if file is None else str(file),
                             "reason": reason})
            self._count(record_id, reason)
            where = f"{record_id}{f' ({file})' if file else ''}: {reason}"
            self.first = self.first or where
            log.warning("skipped %s", where)
        if 0 <= self.max_bad < self.count:
            self.close()
            raise TooManyBad(f"{self.count} bad records, more than {self.flag} {self.max_bad}: "
                             f"see {self.path} (reasons: {self.reasons}); fix or remove them, "
                             f"or raise {self.flag}")

    def summary(self) -> dict:
        """For the manifest and the summary table."""
        return {"skipped": self.count, "skip_reasons": dict(self.reasons),
                "skip_list": str(self.path) if self.count else None}

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


class StopSignals:
    """Within the block, the first SIGTERM or SIGINT sets `signum` (poll `requested` between
    records, or call `check()` to raise Interrupted); a second one raises KeyboardInterrupt.
    A no-op outside the main thread (signal handlers can only be set there)."""

    def __init__(self, resume: str = "re-run the same command to resume"):
        self.resume = resume
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum, self.resume)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: finishing the record in flight, then stopping (send it again "
                    "to stop at once)", signal.Signals(signum).name)

    def __enter__(self) -> "StopSignals":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def script_main(main: Callable[[], int], name: str) -> int:
    """Run a numbered script's `main` and return its exit code: a StageError, an Interrupted or
    a disk error ends in one line on stderr (`<name>: error: ...`), not a traceback."""
    try:
        return main()
    except Interrupted as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{name}: interrupted; what was complete is kept: re-run the same command to "
              "resume", file=sys.stderr)
        return 130
    except StageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if not is_disk_error(e):
            raise
        print(f"{name}: error: {disk_error(e, e.filename or '.')}", file=sys.stderr)
        return 1


@contextmanager
def disk_errors_named(path: Path | str, needed_bytes: int | None = None):
    """Within the block, a full or read-only disk (ENOSPC, EDQUOT, EROFS) raised by a plain
    write (an append, which names no file) becomes the DiskError of `disk_error`, naming `path`'s
    folder (the file's own, when the error names one) and the bytes needed."""
    try:
        yield
    except OSError as e:
        if not is_disk_error(e):
            raise
        raise disk_error(e, e.filename or path, needed_bytes) from e
