"""Merge stage: duplicates, length policy, caps, weights, stable eval split, stats, kill/resume."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stage_helpers import assert_same_folder

from eagle3.core.records import read_jsonl
from eagle3.prepare.merge import conversation_id, is_eval

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "datasets" / "merge_and_shuffle.py"


def _main():
    """The script's main (datasets/ is no package: a `datasets` package would shadow HF's)."""
    if "merge_and_shuffle" not in sys.modules:
        spec = importlib.util.spec_from_file_location("merge_and_shuffle", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["merge_and_shuffle"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["merge_and_shuffle"].main


def rec(rid: str, ids: list[int], mask: list[int], source: str = "") -> dict:
    return {"id": rid, "source": source or rid.split("/")[0], "input_ids": ids,
            "loss_mask": mask, "seq_len": len(ids), "n_prompt_tokens": mask.index(1),
            "n_response_tokens": sum(mask), "finish_reason": "stop"}


def write_upstream(workdir: Path, sources: dict[str, list[dict]], policies: dict | None = None,
                   lines: dict[str, bytes] | None = None) -> None:
    for name, records in sources.items():
        d = workdir / "01b_generated" / name
        d.mkdir(parents=True, exist_ok=True)
        data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
        (d / "tokenized.jsonl").write_bytes(data + (lines or {}).get(name, b""))
    (workdir / "01b_generated/manifest.json").write_text(json.dumps({"complete": True}))
    if policies is not None:
        (workdir / "01_prepared").mkdir(parents=True, exist_ok=True)
        (workdir / "01_prepared/manifest.json").write_text(json.dumps(
            {"complete": True, "outputs": {"datasets": policies}}))


def merge(workdir: Path, *flags: str) -> int:
    return _main()(["--workdir", str(workdir), "--eval-fraction", "0", *flags])


def out(workdir: Path, split: str = "train") -> list[dict]:
    return list(read_jsonl(workdir / "01c_merged" / f"{split}.jsonl"))


def seq(start: int, n: int, prompt: int = 2) -> tuple[list[int], list[int]]:
    return list(range(start, start + n)), [0] * prompt + [1] * (n - prompt)


def test_merge_keeps_the_smallest_id_of_exact_duplicates_whatever_the_file_order(tmp_path):
    a = [rec("a/2", *seq(10, 5)), rec("a/9", *seq(50, 5))]
    b = [rec("b/1", *seq(10, 5)), rec("b/3", *seq(90, 5))]  # b/1 repeats a/2's tokens
    write_upstream(tmp_path, {"a": a, "b": b})
    assert merge(tmp_path) == 0
    assert sorted(r["id"] for r in out(tmp_path)) == ["a/2", "a/9", "b/3"]
    (q,) = read_jsonl(tmp_path / "01c_merged/quarantine.jsonl")
    assert q["id"] == "b/1" and q["reason"] == "duplicate: same token ids as a/2"
    stats = json.loads((tmp_path / "01c_merged/stats.json").read_text())
    assert stats["b"]["dropped"] == {"duplicate": 1} and stats["a"]["records"] == 2


def test_merge_truncates_or_drops_long_samples_as_each_recipe_entry_says(tmp_path):
    long_ids, long_mask = seq(100, 12, prompt=3)
    write_upstream(tmp_path, {
        "cut": [rec("cut/1", long_ids, long_mask), rec("cut/2", *seq(0, 12, prompt=10)),
                rec("cut/3", *seq(200, 4))],
        "keep": [rec("keep/1", *seq(300, 12)), rec("keep/2", *seq(400, 8))]},
        policies={"cut": {"overlength": "truncate"}, "keep": {"overlength": "drop"}})
    assert merge(tmp_path, "--max-seq-len", "8") == 0
    got = {r["id"]: r for r in out(tmp_path)}
    assert sorted(got) == ["cut/1", "cut/3", "keep/2"]
    cut = got["cut/1"]
    assert cut["input_ids"] == long_ids[:8] and cut["loss_mask"] == long_mask[:8]
    assert (cut["seq_len"], cut["n_response_tokens"], cut["finish_reason"]) == (8, 5, "truncated")
    reasons = {q["id"]: q["reason"] for q in read_jsonl(tmp_path / "01c_merged/quarantine.jsonl")}
    assert reasons["cut/2"].startswith("too long: no supervised token within the first 8")
    assert reasons["keep/1"] == "too long: 12 tokens > --max-seq-len 8"
    stats = json.loads((tmp_path / "01c_merged/stats.json").read_text())
    assert stats["cut"]["truncated"] == 1 and stats["keep"]["dropped"] == {"too long": 1}


def test_merge_applies_per_source_cap_and_weight_from_the_recipe(tmp_path):
    write_upstream(tmp_path, {
        "capped": [rec(f"capped/{i}", *seq(1000 + 10 * i, 5)) for i in range(10)],
        "half": [rec(f"half/{i}", *seq(2000 + 10 * i, 5)) for i in range(10)],
        "twice": [rec(f"twice/{i}", *seq(3000 + 10 * i, 5)) for i in range(3)]},
        policies={"capped": {"merge_cap": 3}, "half": {"merge_weight": 0.5},
                  "twice": {"merge_weight": 2.0}})
    assert merge(tmp_path, "--seed", "4") == 0
    ids = [r["id"] for r in out(tmp_path)]
    assert sum(i.startswith("capped/") for i in ids) == 3
    assert sum(i.startswith("half/") for i in ids) == 5
    assert sorted(i for i in ids if i.startswith("twice/")) == [
        "twice/0", "twice/0~r1", "twice/1", "twice/1~r1", "twice/2", "twice/2~r1"]
    stats = json.loads((tmp_path / "01c_merged/stats.json").read_text())
    assert stats["capped"]["dropped"] == {"cap": 7} and stats["half"]["dropped"] == {"weight": 5}
    first = [i for i in ids if i.startswith("capped/")]
    (tmp_path / "01c_merged/manifest.json").unlink()
    assert merge(tmp_path, "--seed", "4") == 0  # same seed, same picks
    assert [i for i in (r["id"] for r in out(tmp_path)) if i.startswith("capped/")] == first


def test_eval_split_is_stable_and_keeps_conversations_whole_when_a_source_is_added(tmp_path):
    base = {"a": [rec(f"a/{i}#{k}", *seq(100 * i + 10 * k, 6)) for i in range(40)
                  for k in range(2)],
            "b": [rec(f"b/{i}", *seq(10_000 + 10 * i, 6)) for i in range(40)]}
    write_upstream(tmp_path / "one", base)
    write_upstream(tmp_path / "two", {**base, "c": [rec(f"c/{i}", *seq(50_000 + 10 * i, 6))
                                                    for i in range(40)]})
    for w in ("one", "two"):
        assert _main()(["--workdir", str(tmp_path / w), "--eval-fraction", "0.25"]) == 0
    held_one = {r["id"] for r in out(tmp_path / "one", "eval")}
    held_two = {r["id"] for r in out(tmp_path / "two", "eval")}
    assert held_one and held_one == {i for i in held_two if not i.startswith("c/")}
    for rid in held_one:
        assert is_eval(rid, 0.25)
    train = {r["id"] for r in out(tmp_path / "one")}
    assert not {conversation_id(i) for i in train} & {conversation_id(i) for i in held_one}


def test_merge_output_does_not_depend_on_the_order_of_input_lines(tmp_path):
    records = [rec(f"a/{i}", *seq(10 * i, 6)) for i in range(30)]
    write_upstream(tmp_path / "x", {"a": records})
    write_upstream(tmp_path / "y", {"a": records[::-1]})
    for w in ("x", "y"):
        assert merge(tmp_path / w, "--seed", "1") == 0
    data = [(tmp_path / w / "01c_merged/train.jsonl").read_bytes() for w in ("x", "y")]
    assert data[0] == data[1] and len(out(tmp_path / "x")) == 30


def test_merge_reports_per_source_stats_as_json_and_as_a_table(tmp_path, capsys):
    lengths = [10, 20, 30, 40, 50]
    write_upstream(tmp_path, {"s": [rec(f"s/{n}", *seq(1000 * n, n)) for n in lengths]},
                   lines={"s": b'{"id": "s/torn", "input_ids": [1, 2'})
    assert merge(tmp_path) == 0
    s = json.loads((tmp_path / "01c_merged/stats.json").read_text())["s"]
    assert (s["records"], s["tokens"], s["supervised_tokens"]) == (5, 150, 150 - 2 * 5)
    assert s["length"]["p50"] == 30 and s["length"]["max"] == 50
    assert s["dropped"] == {"invalid": 1}
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("s "))
    assert row.split()[:9] == ["s", "5", "150", "140", "0", "30", "46", "49", "50"]
    assert row.endswith("invalid 1")


def test_merge_refuses_an_incomplete_upstream_unless_allowed(tmp_path):
    from eagle3.core.stage import StageError

    write_upstream(tmp_path, {"a": [rec("a/1", *seq(0, 4))]})
    (tmp_path / "01b_generated/manifest.json").unlink()
    with pytest.raises(StageError, match="--allow-partial"):
        merge(tmp_path)
    assert merge(tmp_path, "--allow-partial") == 0


def test_merge_output_is_identical_when_killed_at_random_moments_and_rerun(tmp_path):
    rng = random.Random(3)
    sources = {f"s{k}": [rec(f"s{k}/{i}", [rng.randrange(1000) for _ in range(400)],
                             [0] * 100 + [1] * 300) for i in range(1000)] for k in range(3)}
    for w in ("ref", "run"):
        write_upstream(tmp_path / w, sources, policies={"s0": {"overlength": "truncate"},
                                                        "s1": {"merge_weight": 1.5}})
    cmd = [sys.executable, str(SCRIPT), "--max-seq-len", "300", "--eval-fraction", "0.1",
           "--log-level", "WARNING", "--workdir"]

    def start(w: str) -> tuple[subprocess.Popen, float]:
        """Start a run; returns it once its stage folder exists (imports done, work begun)."""
        proc = subprocess.Popen(cmd + [str(tmp_path / w)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        while not (tmp_path / w / "01c_merged").exists() and proc.poll() is None:
            time.sleep(0.02)
        return proc, time.monotonic()

    proc, t0 = start("ref")
    assert proc.wait(timeout=300) == 0
    work = time.monotonic() - t0
    killed = 0
    for _ in range(4):
        proc, _ = start("run")
        try:
            proc.wait(timeout=rng.uniform(0.0, 0.9) * work)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed += 1
    assert killed >= 2
    assert subprocess.run(cmd + [str(tmp_path / "run")], capture_output=True).returncode == 0
    # the whole folder, byte for byte: no temp file, no stray, manifest.json without timestamps
    assert_same_folder(tmp_path / "run/01c_merged", tmp_path / "run",
                       tmp_path / "ref/01c_merged", tmp_path / "ref")
    assert (tmp_path / "run/01c_merged/train.jsonl").stat().st_size > 0
