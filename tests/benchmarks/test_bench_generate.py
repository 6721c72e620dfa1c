"""benchmarks/bench_generate.py at toy size on the CPU: every row runs and the JSON holds them.

Speed is what the script measures on a GPU; here the tiny Llama target in float32 shows that
both engines run on the same prompts and that the fast engine's greedy outputs are generate's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eagle3.tiny.target import TinyTargetConfig, make_tiny_target

ROOT = Path(__file__).resolve().parents[2]


def test_bench_generate_runs_generate_and_fast_rows_and_writes_its_json(tmp_path):
    target = make_tiny_target(tmp_path / "target", TinyTargetConfig(arch="llama"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_generate.py", "--target", str(target), "--device",
         "cpu", "--dtype", "float32", "--num-prompts", "6", "--batch-sizes", "4", "8",
         "--max-new-tokens", "6", "--float32-prompts", "4", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_generate.json").read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["generate b4", "generate b2", "fast b4", "fast b4 expanded", "fast b8",
                          "fast b4 T=1", "generate b4 float32", "fast b4 float32"]
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in rows.values())
    assert rows["generate b4"]["prompts"] == 4 and rows["fast b4"]["prompts"] == 6
    for name in ("generate b2", "fast b4", "fast b4 expanded", "fast b8", "fast b4 float32"):
        assert rows[name]["identical"] == 1.0 and rows[name]["compared"] == 4, name
        assert rows[name]["compared_distinct"] == 4, name  # 6 prompts of a pool of 256
    assert rows["fast b4"]["decode_attention"] == "grouped"
    assert rows["fast b4 expanded"]["decode_attention"] == "expanded"
    assert "identical" not in rows["fast b4 T=1"]
    assert rows["fast b4"]["graphs"] == 0 and "cpu" in rows["fast b4"]["eager_reason"]
    assert "fast b4 expanded" in proc.stdout and "wrote" in proc.stdout


def test_float32_identity_covers_distinct_prompts_not_cycled_copies(tmp_path):
    """Cycling 3 prompts to 12 and sorting them longest first puts each one's 4 copies side by
    side; the float32 rows (the identity claim) must still cover 3 different prompts."""
    target = make_tiny_target(tmp_path / "target", TinyTargetConfig(arch="llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": text}]}) + "\n" for i, text in enumerate(
            ["short one", "a somewhat longer request here", "the longest of the three "
             "requests, by a good margin"])))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_generate.py", "--target", str(target), "--device",
         "cpu", "--dtype", "float32", "--prompts", str(prompts), "--num-prompts", "12",
         "--batch-sizes", "4", "--max-new-tokens", "3", "--temperature", "0",
         "--float32-prompts", "3", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads((out / "bench_generate.json").read_text())["rows"]}
    assert rows["fast b4"]["compared"] == 4 and rows["fast b4"]["compared_distinct"] == 1
    f32 = rows["fast b4 float32"]
    assert rows["generate b4 float32"]["prompts"] == 3
    assert f32["compared"] == 3 and f32["compared_distinct"] == 3 and f32["identical"] == 1.0
