"""The dump hook's writer: one thread that writes the dump jobs in the order they came, off the
forward path, with a bound on the host memory they hold.

Pure Python, importing nothing from eagle3: the dump hook (`eagle3/extract/sglang_dump.py`)
runs inside SGLang and loads this file by path.

`DumpWriter.submit(make_job, nbytes, tokens, label)` is called from the server's scheduler
thread, once per request of a prefill pass. It waits while the jobs not yet written hold more than
`max_pending_bytes` of host memory (back-pressure: the server slows to the writer's speed; it
never drops a dump nor grows without bound), then calls `make_job()` (which starts the copies of
the request's rows) and queues the job. A job larger than the bound alone goes through once the
queue is empty. The thread takes the jobs one by one, FIFO, so the chunks of one prompt are
written in their order, and calls `write(job)` (which waits for the job's copies, serialises and
renames; returns the bytes written). An exception there costs that job only: logged with its
`label`, counted.

What it says: a warning when `submit` had to wait (at most one every `warn_every_s`, with the
time waited and the queue), a summary line every `log_every_s` while it works, and, with
`stats_file`, a JSON of the counters written atomically at most every `stats_every_s` and
whenever the queue runs empty (`Stats` lists the fields). `flush()` waits until every job
submitted is written; `close()` flushes and stops the thread (the hook registers it with atexit).
`InlineWriter` has the same face and writes each job at once, in the caller's thread.

`ring` (a `dump_staging.HostRing`, or None) is the host memory the jobs are staged in, sized to
the bound: the writer only holds it for the hook (`writer.ring`) and reports its counters.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Stats:
    """The writer's counters (the stats JSON); bytes are host bytes of the jobs' tensors."""

    max_pending_bytes: int = 0  # the bound on queued host bytes
    jobs_submitted: int = 0
    jobs_written: int = 0
    jobs_failed: int = 0  # write raised: logged, the dump of that request is missing
    tokens: int = 0  # rows of the jobs written
    job_bytes: int = 0  # host bytes of the jobs written (what crossed from the device)
    file_bytes: int = 0  # bytes written to files (a chunk's file is rewritten whole)
    queue_jobs: int = 0  # jobs submitted and not yet written, now
    queue_bytes: int = 0  # their host bytes, now
    max_queue_jobs: int = 0
    max_queue_bytes: int = 0
    blocked_s: float = 0.0  # seconds `submit` waited for room, in all
    blocked_waits: int = 0  # how many submits waited
    write_s: float = 0.0  # seconds the thread spent in `write`
    bytes_per_token: float = 0.0  # job_bytes / tokens
    ring_bytes: int = 0  # the staging ring's capacity (0: no ring)
    ring_misses: int = 0  # jobs the ring had no room for (staged in buffers of their own)


class DumpWriter:
    """A FIFO of dump jobs and the one thread that writes them (see the module docstring)."""

    def __init__(self, write: Callable[[Any], int], max_pending_bytes: int,
                 stats_file: Path | None = None, *, name: str = "eagle3-dump-writer",
                 log_every_s: float = 60.0, warn_every_s: float = 10.0,
                 stats_every_s: float = 1.0, ring: Any = None):
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes {max_pending_bytes}: expected >= 1")
        self._write, self._stats_file, self.ring = write, stats_file, ring
        self._log_every_s, self._warn_every_s = log_every_s, warn_every_s
        self._stats_every_s = stats_every_s
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (job, nbytes, tokens, label)
        self._busy = 0  # jobs taken off the queue and not yet written (0 or 1)
        self._closed = False
        self.stats = Stats(max_pending_bytes=max_pending_bytes)
        now = time.monotonic()
        self._last_log = self._last_stats = self._last_warn = now
        self._waited_since_warn, self._waits_since_warn = 0.0, 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the scheduler's side

    def submit(self, make_job: Callable[[], Any], nbytes: int, tokens: int, label: str) -> None:
        """Queue `make_job()` once the queue has room for `nbytes` more host bytes (blocking
        until then); `tokens` and `label` are for the counters and the log. Raises RuntimeError
        if the writer was closed or its thread is gone."""
        with self._cond:
            t0 = None
            while self._pending_jobs() and \
                    self.stats.queue_bytes + nbytes > self.stats.max_pending_bytes:
                self._check_running()
                t0 = t0 or time.monotonic()
                self._cond.wait(timeout=1.0)
            self._check_running()
            if t0 is not None:
                self._note_wait(time.monotonic() - t0)
            job = make_job()  # the copies start here, once the room is there
            self._queue.append((job, nbytes, tokens, label))
            s = self.stats
            s.jobs_submitted += 1
            s.queue_jobs, s.queue_bytes = s.queue_jobs + 1, s.queue_bytes + nbytes
            s.max_queue_jobs = max(s.max_queue_jobs, s.queue_jobs)
            s.max_queue_bytes = max(s.max_queue_bytes, s.queue_bytes)
            self._cond.notify_all()

    def _pending_jobs(self) -> int:
        return len(self._queue) + self._busy

    def _check_running(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the dump writer is closed or its thread is gone")

    def _note_wait(self, waited: float) -> None:
        s = self.stats
        s.blocked_s += waited
        s.blocked_waits += 1
        self._waited_since_warn += waited
        self._waits_since_warn += 1
        now = time.monotonic()
        if now - self._last_warn >= self._warn_every_s or s.blocked_waits == 1:
            logger.warning(
                "eagle3 dump: the writer is behind: the server waited %.2f s in %d waits for "
                "room in the queue (now %d jobs, %.0f MB pending, limit %.0f MB; %.1f s in all)",
                self._waited_since_warn, self._waits_since_warn, s.queue_jobs,
                s.queue_bytes / 2**20, s.max_pending_bytes / 2**20, s.blocked_s)
            self._last_warn = now
            self._waited_since_warn, self._waits_since_warn = 0.0, 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted is written; False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending_jobs() and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left if left is not None else 1.0)
            return not self._pending_jobs()

    def close(self) -> None:
        """Write every job still queued, then stop the thread (idempotent)."""
        self.flush()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._log_summary()
        self._write_stats()

    # ------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                job, nbytes, tokens, label = self._queue.popleft()
                self._busy = 1
            t0 = time.monotonic()
            written, ok = 0, False
            try:
                written, ok = self._write(job), True
            except Exception as exc:  # a full disk or a bad chunk costs this job, not the server
                logger.exception("eagle3 dump: skipped %s: %s", label, exc)
            dt = time.monotonic() - t0
            del job  # its host buffers go back now, not when the next job arrives
            with self._cond:
                s = self.stats
                s.write_s += dt
                if ok:
                    s.jobs_written += 1
                    s.tokens += tokens
                    s.job_bytes += nbytes
                    s.file_bytes += int(written or 0)
                else:
                    s.jobs_failed += 1
                s.queue_jobs, s.queue_bytes = s.queue_jobs - 1, s.queue_bytes - nbytes
                s.bytes_per_token = s.job_bytes / s.tokens if s.tokens else 0.0
                drained = not self._queue
                self._cond.notify_all()  # room in the queue
            self._maybe_report(drained)
            with self._cond:  # done once reported: after flush() the stats file is current
                self._busy = 0
                self._cond.notify_all()

    def _maybe_report(self, drained: bool) -> None:
        now = time.monotonic()
        if now - self._last_log >= self._log_every_s:
            self._log_summary()
            self._last_log = now
        if drained or now - self._last_stats >= self._stats_every_s:
            self._write_stats()
            self._last_stats = now

    def _log_summary(self) -> None:
        s = self.snapshot()
        if s["jobs_submitted"]:
            logger.info(
                "eagle3 dump writer: %d jobs written (%d failed), %d tokens, %.2f GB "
                "(%.0f B/token), queue %d jobs (max %d, %.0f MB), blocked %.1f s, writing "
                "%.1f s", s["jobs_written"], s["jobs_failed"], s["tokens"],
                s["job_bytes"] / 1e9, s["bytes_per_token"], s["queue_jobs"],
                s["max_queue_jobs"], s["max_queue_bytes"] / 2**20, s["blocked_s"],
                s["write_s"])

    def snapshot(self) -> dict:
        """The counters now (a copy; the stats JSON's fields)."""
        with self._cond:
            data = asdict(self.stats)
        if self.ring is not None:
            data.update(ring_bytes=self.ring.capacity, ring_misses=self.ring.misses)
        return data

    def _write_stats(self) -> None:
        if self._stats_file is None:
            return
        data = {**self.snapshot(), "pid": os.getpid(), "time": time.time()}
        path = Path(self._stats_file)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # the stats must never cost a dump
            logger.warning("eagle3 dump: cannot write the writer stats %s: %s", path, e)
            tmp.unlink(missing_ok=True)


class InlineWriter:
    """`DumpWriter`'s face, writing each job at once in the caller's thread (no queue, no
    staging ring)."""

    ring = None

    def __init__(self, write: Callable[[Any], int]):
        self._write = write

    def submit(self, make_job: Callable[[], Any], nbytes: int, tokens: int, label: str) -> None:
        self._write(make_job())

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass
