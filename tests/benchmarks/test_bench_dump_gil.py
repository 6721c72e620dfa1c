"""benchmarks/bench_dump_gil.py at toy size on the CPU: every condition runs through the hook's
real writer, and the JSON holds the figures the report is read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dump_gil_measures_every_condition_and_writes_its_json(tmp_path):
    out = tmp_path / "gil.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_dump_gil.py", "--hidden", "64", "--tokens-per-pass",
         "64", "--seconds", "0.3", "--repeats", "1", "--layouts", "bf16", "--dirs",
         str(tmp_path), "--switch-ms", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["row_bytes"]["bf16"] == 8 + 2 * 64 * 4
    (name, cell), = result["cells"].items()
    assert name == f"bf16/{tmp_path}"
    assert set(cell) == {"dir", "idle", "thread", "process", "thread@1"}
    for condition in ("idle", "thread", "process", "thread@1"):
        m = cell[condition]
        assert m["steps"] > 0 and m["steps_per_s"] > 0 and 0 <= m["gil_wait_share"] <= 1
        assert m["steps_per_s_free_core"] >= m["steps_per_s"] * 0.999
    idle = cell["idle"]
    assert idle["ratio_to_idle"] == 1.0 and idle["gil_wait_us_per_step_over_idle"] == 0
    for condition in ("thread", "process", "thread@1"):  # the writer wrote meanwhile
        assert cell[condition]["writer_bytes_per_s"] > 0
    assert cell["thread"]["ring_misses"] == 0  # the hook's writer staged every job in its ring
    assert "thread@1" in proc.stdout and "free-core" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # its dump folder removed
