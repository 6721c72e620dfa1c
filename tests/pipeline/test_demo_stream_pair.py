"""The demos' `--stream` flag: tools/extract_and_train.sh runs 03 first, then 02b and 04 at the
same time with the stream flags, and when either fails the script fails with its code and stops
the other (which would wait for it forever). Stand-in stage commands; the real pair is
tests/train/test_stream.py's."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, stream: int, extract: str, train: str) -> tuple[int, list[str], float]:
    log = tmp_path / "log"
    script = f"""set -euo pipefail
vocab() {{ echo "vocab $*" >> {log}; }}
extract() {{ echo "extract start $*" >> {log}; {extract}; echo "extract end" >> {log}; }}
train() {{ echo "train start $*" >> {log}; {train}; echo "train end" >> {log}; }}
STREAM={stream}; SPOOL_GB=0.5
source {ROOT / 'tools/extract_and_train.sh'}
echo "after" >> {log}
"""
    t0 = time.monotonic()
    rc = subprocess.run(["bash", "-c", script], timeout=60).returncode
    return rc, log.read_text().splitlines(), time.monotonic() - t0


def test_stream_pair_runs_03_first_then_both_at_once_with_the_stream_flags(tmp_path):
    rc, lines, seconds = _run(tmp_path, 1, "sleep 1", "sleep 1")
    assert rc == 0
    assert lines[0] == "vocab "
    assert set(lines[1:3]) == {"extract start --stream --spool-gb 0.5", "train start --stream"}
    assert lines[-1] == "after"
    assert seconds < 1.9  # at the same time, not one after the other


def _is_alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stream_pair_fails_and_stops_04_when_02b_fails(tmp_path):
    # 02b fails only once 04's stage runs, whatever the machine's load: the order of events is
    # fixed, so is the outcome (04's shell must neither finish nor outlive the script).
    pid_file = tmp_path / "train.pid"
    rc, lines, seconds = _run(tmp_path, 1,
                              f"until [ -s {pid_file} ]; do sleep 0.01; done; exit 3",
                              f"sleep 20 & echo $! > {pid_file}; wait")
    assert rc == 3
    assert "train end" not in lines and "after" not in lines
    assert seconds < 10  # 04 was stopped, not waited for
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _is_alive(pid) and time.monotonic() < deadline:  # SIGTERM is handled, not instant
        time.sleep(0.05)
    assert not _is_alive(pid), "the stage process 04 ran outlived the script"


def test_offline_pair_runs_the_stages_in_order(tmp_path):
    rc, lines, _ = _run(tmp_path, 0, "true", "true")
    assert rc == 0
    assert lines == ["extract start ", "extract end", "vocab ", "train start ", "train end",
                     "after"]
