"""Comparing whole stage folders: what a killed and resumed stage must equal, and the kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

VOLATILE = ("started", "finished", "seconds", "argv")  # manifest fields that tell the run time


def _drop_keys(obj, keys: tuple) -> None:
    """Remove `keys` from every dict nested in `obj` (in place)."""
    if isinstance(obj, dict):
        for key in keys:
            obj.pop(key, None)
        for v in obj.values():
            _drop_keys(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            _drop_keys(v, keys)


def stage_snapshot(stage_dir: Path, workdir: Path, run_counts: tuple = (),
                   count_files: tuple = ()) -> dict[str, bytes]:
    """Every file of a stage folder by relative name with its bytes; manifest.json without its
    timestamps, and without the `run_counts` keys anywhere in it nor in the JSON
    files named in `count_files` (what this run did, such as 02b's `written` /
    `skipped_existing` or 01b's requests per run), and the workdir's path written `<workdir>`
    (two runs live in two folders)."""
    out = {}
    for p in sorted(Path(stage_dir).rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "manifest.json" and p.parent == Path(stage_dir):
            manifest = {k: v for k, v in json.loads(data).items() if k not in VOLATILE}
            _drop_keys(manifest, run_counts)
            data = json.dumps(manifest, sort_keys=True).encode()
        elif p.name in count_files:
            counts = json.loads(data)
            _drop_keys(counts, run_counts)
            data = json.dumps(counts, sort_keys=True).encode()
        out[str(p.relative_to(stage_dir))] = data.replace(str(workdir).encode(), b"<workdir>")
    return out


def assert_same_folder(got_dir: Path, got_workdir: Path, want_dir: Path,
                       want_workdir: Path, run_counts: tuple = (),
                       count_files: tuple = ()) -> None:
    got = stage_snapshot(got_dir, got_workdir, run_counts, count_files)
    want = stage_snapshot(want_dir, want_workdir, run_counts, count_files)
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    differ = [n for n in want if got[n] != want[n]]
    assert differ == [], differ


def _spawn(cmd: list[str], cwd: Path | None) -> subprocess.Popen:
    # its own process group: a kill reaches the stage's workers too
    # stderr to a file, not a pipe: progress bars would fill a pipe nobody reads and stall it
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                            start_new_session=True)
    proc.err_file = err
    return proc


def timed_run(cmd: list[str], ready: Callable[[], bool],
              cwd: Path | None = None) -> tuple[float, float]:
    """Run `cmd` to its end (it must succeed) in a fresh work folder; returns (seconds from
    its start until `ready()` held, i.e. the stage began its work; seconds until it ended)."""
    proc, t0 = _spawn(cmd, cwd), time.monotonic()
    t_ready = None
    while proc.poll() is None:
        if t_ready is None and ready():
            t_ready = time.monotonic() - t0
        time.sleep(0.005)
    t_end = time.monotonic() - t0
    assert proc.returncode == 0, _tail(proc)
    return (t_end if t_ready is None else t_ready), t_end


def kill_at_fractions(cmd: list[str], timing: tuple[float, float],
                      fractions: tuple[float, ...], cwd: Path | None = None,
                      after_kill: Callable[[], None] | None = None) -> int:
    """Run `cmd` once per fraction and SIGKILL its process group that far into its work
    (`timing`: what `timed_run` measured on an uninterrupted run; 0.5 = halfway between the
    start of the work and the end); `after_kill()` sees each killed run's folder. Returns how
    many runs were killed (a run that ended first was not)."""
    t_ready, t_end = timing
    killed = 0
    for fraction in fractions:
        proc = _spawn(cmd, cwd)
        try:
            proc.wait(timeout=t_ready + fraction * (t_end - t_ready))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed += 1
            if after_kill is not None:
                after_kill()
    return killed


def kill_and_rerun(cmd: Callable[[str], list[str]], stage_dir: Callable[[str], Path],
                   fractions: tuple[float, ...], cwd: Path | None = None) -> None:
    """Run `cmd("ref")` uninterrupted, then `cmd("run")` SIGKILLed at each fraction of its work
    and finally to its end; asserts at least two kills landed and one of them after the stage
    made its folder (`stage_dir(w)`): killed inside the work, not before it."""
    timing = timed_run(cmd("ref"), lambda: stage_dir("ref").exists(), cwd)
    seen = []  # what each kill left: the folder's files, or None before the stage made it

    def look():
        d = stage_dir("run")
        seen.append(sorted(p.name for p in d.iterdir()) if d.exists() else None)

    killed = kill_at_fractions(cmd("run"), timing, fractions, cwd, look)
    assert killed >= 2 and any(s is not None for s in seen), seen
    timed_run(cmd("run"), lambda: True, cwd)


def _tail(proc: subprocess.Popen) -> str:
    err = proc.err_file
    err.seek(0)
    return err.read().decode(errors="replace")[-3000:]
