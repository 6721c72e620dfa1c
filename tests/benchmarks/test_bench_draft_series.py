"""benchmarks/bench_draft_series.py: several drafts on several prompt sets with the offline
evaluator, on SmolLM2 and the committed reference draft at toy sizes (2 prompts x 12 tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRAFT = ROOT / "tests/fixtures/smollm2_chat_draft/final"
SCRIPT = "benchmarks/bench_draft_series.py"


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def series(smollm2_target_dir, tmp_path_factory) -> tuple[Path, list, str]:
    out = tmp_path_factory.mktemp("series")
    args = ["--out", out, "--target", smollm2_target_dir, "--drafts", f"a={DRAFT}",
            f"b={DRAFT}", "--prompt-sets", "human_chat=prompts/human_chat.jsonl",
            "--num-prompts", "2", "--max-new-tokens", "12", "--steps", "3", "7",
            "--workers", "2"]
    return out, args, _run(args).stdout


def test_series_evaluates_every_draft_on_every_set_losslessly(series):
    out, _, stdout = series
    result = json.loads((out / "series.json").read_text())
    cells = result["cells"]["human_chat"]
    assert set(cells) == {"a", "b"}
    for steps, ceiling in (("3", 4), ("7", 8)):
        r = cells["a"][steps]
        assert 1.0 <= r["acceptance_length"] <= ceiling and r["verify_passes"] > 0
        assert r["lossless_mismatches"] == 0 and r["outputs"] == 2
        assert len(r["per_position_acceptance"]) == int(steps)
        assert 0.0 <= r["loop_share"] <= 1.0
    assert cells["a"] == cells["b"]  # the same draft under two names: the same figures
    assert result["settings"]["num_prompts"] == 2 and result["settings"]["steps"] == [3, 7]
    row = next(x for x in stdout.splitlines() if x.startswith("| human_chat | a |"))
    assert f"{cells['a']['3']['acceptance_length']:.3f}" in row and row.endswith("| 4/4 |")


def test_series_rerun_decodes_nothing_again(series):
    out, args, _ = series
    before = {p: p.stat().st_mtime_ns for p in (out / "human_chat").glob("eval_*.json")}
    stdout = _run(args).stdout
    assert "human_chat / a:" not in stdout  # no cell evaluated
    assert {p: p.stat().st_mtime_ns for p in before} == before


@pytest.mark.parametrize("flag,value,message", [
    ("--drafts", "nameless", "--drafts takes NAME=PATH, got 'nameless'"),
    ("--prompt-sets", "x=/no/such.jsonl", "--prompt-sets x: /no/such.jsonl does not exist")])
def test_series_refuses_a_bad_pair_naming_the_flag(tmp_path, flag, value, message):
    args = ["--out", tmp_path, "--drafts", f"a={DRAFT}", "--prompt-sets",
            "c=prompts/human_chat.jsonl"]
    args[args.index(flag) + 1] = value
    proc = _run(args, check=False)
    assert proc.returncode != 0 and message in proc.stderr
