"""The reference benchmark's side-by-side evaluation processes (reference/parallel.py) and the
follower that runs the whole benchmark detached across device commands (reference/follow.py)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from reference.parallel import JobPool


def _sleeper(path, name: str, seconds: float) -> list[str]:
    """A job that appends its start and end times to `path`."""
    code = (f"import time, pathlib; p = pathlib.Path({str(path)!r}); "
            f"f = p.open('a'); f.write(f'{name} start {{time.time()}}\\n'); f.flush(); "
            f"time.sleep({seconds}); f.write(f'{name} end {{time.time()}}\\n'); f.close()")
    return [sys.executable, "-c", code]


def _max_overlap(path) -> int:
    events = []
    for line in path.read_text().splitlines():
        _, kind, t = line.split()
        events.append((float(t), 1 if kind == "start" else -1))
    running = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    return peak


def test_pool_runs_at_most_its_workers_at_once_and_all_of_them(tmp_path):
    times = tmp_path / "times.txt"
    with JobPool(2, time.time() + 60, tmp_path / "logs", poll_s=0.05) as pool:
        for k in range(4):
            pool.submit(f"job {k}", _sleeper(times, f"j{k}", 0.6))
        jobs = pool.wait()
    assert sorted(j.name for j in jobs) == [f"job {k}" for k in range(4)]
    assert all(j.rc == 0 and not j.skipped and j.wall_s >= 0.6 for j in jobs)
    assert _max_overlap(times) == 2  # side by side, never more than the workers


def test_pool_does_not_start_a_job_that_no_longer_fits_the_deadline(tmp_path):
    times = tmp_path / "times.txt"
    with JobPool(2, time.time() + 30, tmp_path / "logs", slowdown=1.5, poll_s=0.05) as pool:
        pool.submit("fits", _sleeper(times, "fits", 0.1), estimate_s=10)
        pool.submit("too long", _sleeper(times, "long", 0.1), estimate_s=25)  # 37.5 s > 30 s
        jobs = {j.name: j for j in pool.wait()}
    assert jobs["fits"].rc == 0
    assert jobs["too long"].rc is None and "run the phase again" in jobs["too long"].skipped
    assert "long start" not in times.read_text()


def test_pool_reports_a_failing_job_with_its_output_in_the_job_log(tmp_path):
    with JobPool(1, time.time() + 60, tmp_path / "logs", poll_s=0.05) as pool:
        job = pool.submit("bad job/1", [sys.executable, "-c",
                                        "import sys; print('boom here'); sys.exit(5)"])
        pool.wait()
    assert job.rc == 5
    assert pool.log_path(job).name == "bad_job_1.log"
    assert "boom here" in pool.log_path(job).read_text()


def test_closing_the_pool_kills_what_still_runs(tmp_path):
    times = tmp_path / "times.txt"
    pool = JobPool(1, time.time() + 60, tmp_path / "logs", poll_s=0.05)
    job = pool.submit("slow", _sleeper(times, "slow", 30))
    deadline = time.time() + 20
    while "slow start" not in (times.read_text() if times.exists() else ""):
        assert time.time() < deadline
        time.sleep(0.05)
    t0 = time.time()
    pool.close()
    assert time.time() - t0 < 5 and job.proc.poll() is not None
    assert "slow end" not in times.read_text()


# ---------------------------------------------------------------- follow.py


def test_follow_collects_a_finished_run_and_returns_its_exit_status(tmp_path):
    from reference.follow import main, paths

    workdir = tmp_path / "ref"
    (workdir / "results").mkdir(parents=True)
    (workdir / "results" / "state.json").write_text(json.dumps(
        {"profile": "smoke", "done": {}, "skipped": {}, "phases": {}}))
    p = paths(workdir)
    p["log"].write_text("step 1\nstep 2\nall done\n")
    p["rc"].write_text("0\n")
    out = tmp_path / "out"
    assert main(["--workdir", str(workdir), "--wait-s", "5", "--out", str(out)]) == 0
    assert (out / "reference" / "summary.md").is_file()
    assert (out / "reference" / "console.log").read_text().endswith("all done\n")
    p["rc"].write_text("4\n")
    assert main(["--workdir", str(workdir), "--wait-s", "5"]) == 4


def test_follow_says_so_when_no_run_was_started(tmp_path, capsys):
    from reference.follow import STILL_RUNNING, main

    t0 = time.time()
    assert main(["--workdir", str(tmp_path / "ref"), "--wait-s", "60"]) == STILL_RUNNING
    assert time.time() - t0 < 10  # does not wait for a run that does not exist
    assert "start it with --start" in capsys.readouterr().out


@pytest.mark.parametrize("alive", [True, False])
def test_follow_tells_a_live_pid_from_a_dead_one(tmp_path, alive):
    import subprocess

    from reference.follow import running

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        if not alive:
            proc.kill()
            proc.wait()
        (tmp_path / "pid").write_text(str(proc.pid))
        assert running(tmp_path / "pid") is alive
    finally:
        proc.kill()
        proc.wait()
