"""Helpers of stage 01b's server tests: the command line, a 01b process to kill, waiting for its
records, and the manifest counts that say what one run did (not what the stage holds)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 24  # generation budget of the tests' replies

# What one run did, not what the stage holds: done.json and the manifest keep them per run;
# and the manifest's disk_bytes, which counts done.json (whose run counts vary in digits).
RUN_COUNTS = ("generated", "stop", "length", "dropped_length", "output_tokens", "requests",
              "retries", "abandoned", "max_inflight", "short_jobs", "long_jobs", "seconds",
              "servers", "resumed", "appended_stop_token", "disk_bytes")


def main_01b(argv: list[str]) -> int:
    return importlib.import_module("01b_generate_synthetic").main(argv)


def sglang_argv(workdir, target, url, *extra) -> list[str]:
    """01b's flags against fake SGLang servers at `url` (one URL or several)."""
    return ["--workdir", str(workdir), "--target", str(target), "--backend", "sglang",
            "--server-url", *([url] if isinstance(url, str) else url),
            "--max-new-tokens", str(MAX_NEW), "--retry-delay-s", "0.02", "--poll-s", "0.1",
            "--log-level", "WARNING", *extra]


def spawn_01b(workdir: Path, target: Path, url: str, *extra: str) -> subprocess.Popen:
    """01b in a process of its own (to kill or signal), at concurrency 16 unless told."""
    cmd = [sys.executable, str(ROOT / "01b_generate_synthetic.py"),
           *sglang_argv(workdir, target, url, "--concurrency", "16", *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def count_lines(paths: list[Path]) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.exists())


def wait_for_lines(paths: "Path | list[Path]", n: int, proc: subprocess.Popen,
                   timeout: float = 60.0) -> None:
    """Until the files hold `n` lines together, the process ends, or `timeout` passes."""
    paths = [paths] if isinstance(paths, Path) else list(paths)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if count_lines(paths) >= n:
            return
        time.sleep(0.01)
