"""Side-by-side subprocesses for the reference benchmark's evaluations.

A batch-1 speculative decode of the 100M-parameter reference target keeps the H200 mostly idle
(the cost is Python and kernel launches), so phase 3 runs its evaluations -- the draft sweeps
and 05 at temperature 1 -- as separate processes, several at once, while its own process trains
the fp8-state and data-size drafts. Speed figures measured this way are slowed by the neighbours;
the report takes speed only from 05 at temperature 0, which runs alone in phase 2.

`JobPool` starts queued jobs as slots free up (a thread polls them), never starts one past the
deadline or whose estimate no longer fits (it is recorded as skipped), and writes every job's
output to `<logs>/<name>.log`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Job:
    name: str
    argv: list[str]
    estimate_s: float = 0.0
    rc: int | None = None
    started: float = 0.0
    wall_s: float = 0.0
    skipped: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)


class JobPool:
    """Up to `workers` subprocesses at once; `deadline` is a time.time() value."""

    def __init__(self, workers: int, deadline: float, log_dir: Path, slowdown: float = 1.5,
                 env: dict | None = None, poll_s: float = 0.5):
        self.workers, self.deadline, self.slowdown = max(1, workers), deadline, slowdown
        self.log_dir = Path(log_dir)
        self.env = {**os.environ, **(env or {})}
        self.queue: list[Job] = []
        self.running: list[Job] = []
        self.finished: list[Job] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._loop, name="job-pool", daemon=True)
        self._thread.start()

    def submit(self, name: str, argv: list[str], estimate_s: float = 0.0) -> Job:
        job = Job(name, [str(a) for a in argv], estimate_s)
        with self._lock:
            self.queue.append(job)
        self._tick()
        return job

    def python(self, script: str | Path, args: list) -> list[str]:
        """The argv of a Python script run with this interpreter."""
        return [sys.executable, str(script), *map(str, args)]

    def _tick(self) -> None:
        with self._lock:
            done = []
            for job in list(self.running):
                rc = job.proc.poll()
                if rc is not None:
                    job.rc, job.wall_s = rc, time.time() - job.started
                    self.running.remove(job)
                    self.finished.append(job)
                    done.append(job)
            while self.queue and len(self.running) < self.workers:
                job = self.queue.pop(0)
                left = self.deadline - time.time()
                if job.estimate_s * self.slowdown > left:
                    job.skipped = (f"needs ~{job.estimate_s * self.slowdown:.0f} s side by side "
                                   f"with the others, {left:.0f} s left: run the phase again")
                    log.warning("not starting %s: %s", job.name, job.skipped)
                    self.finished.append(job)
                    done.append(job)
                    continue
                self._start(job)
        for job in done:
            if job.rc is not None:
                level = logging.INFO if job.rc == 0 else logging.ERROR
                log.log(level, "%s exited with %s after %.0f s (log: %s)", job.name, job.rc,
                        job.wall_s, self.log_path(job))

    def log_path(self, job: Job) -> Path:
        return self.log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", job.name) + ".log")

    def _start(self, job: Job) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(job), "ab") as out:
            job.started = time.time()
            job.proc = subprocess.Popen(job.argv, stdout=out, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
        log.info("started %s (%d running, %d queued): %s", job.name, len(self.running) + 1,
                 len(self.queue), " ".join(job.argv))
        self.running.append(job)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._tick()
            self._stop.wait(self._poll_s)

    def idle(self) -> bool:
        with self._lock:
            return not self.queue and not self.running

    def wait(self) -> list[Job]:
        """Block until every submitted job has finished or been skipped; returns them all."""
        while not self.idle():
            time.sleep(self._poll_s)
        self._tick()
        return list(self.finished)

    def close(self) -> None:
        """Stop polling; kill what still runs (an interrupted phase: the next run resumes)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for job in self.running:
                job.proc.kill()
                job.proc.wait()
            self.running.clear()

    def __enter__(self) -> JobPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
