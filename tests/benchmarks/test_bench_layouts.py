"""benchmarks/bench_layouts.py on the tiny target: every layout run end to end, and its figures
read back against the files and results the runs left (computed, not constants)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from extract_helpers import write_merged

HIDDEN = 64  # the tiny target's hidden size (eagle3.tiny.target)


@pytest.fixture(scope="module")
def layouts(tiny_target_dir, tmp_path_factory):
    import importlib.util
    import os

    demo = tmp_path_factory.mktemp("layouts") / "demo"
    write_merged(demo, n_train=12, n_eval=3)
    eval_split = demo / "01c_merged" / "eval.jsonl"  # 05 prompts with the first half of each
    records = [json.loads(line) for line in eval_split.read_text().splitlines()]
    eval_split.write_text("".join(json.dumps({**r, "n_prompt_tokens": max(1, r["seq_len"] // 2)})
                                  + "\n" for r in records))
    os.symlink(tiny_target_dir, demo / "target")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_layouts.py"
    spec = importlib.util.spec_from_file_location("bench_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = demo.parent / "runs"
    assert module.main(["--demo", str(demo), "--out", str(out), "--topk", "8", "--epochs", "1",
                        "--num-prompts", "2", "--max-new-tokens", "8",
                        "--draft-vocab", "64"]) == 0
    return demo, out, json.loads((out / "layouts.json").read_text())


def _tokens(demo: Path) -> int:
    return sum(json.loads(line)["seq_len"] for split in ("train", "eval")
               for line in (demo / "01c_merged" / f"{split}.jsonl").read_text().splitlines())


def test_bench_layouts_bytes_per_token_are_the_files_on_disk_over_the_tokens(layouts):
    demo, out, result = layouts
    tokens = _tokens(demo)
    payload = {"bf16": 8 * HIDDEN + 16, "fp8": 5 * HIDDEN + 28, "fp8_all": 4 * HIDDEN + 32,
               "topk": 3 * HIDDEN + 4 * 8 + 32, "topk_tail": 3 * HIDDEN + 4 * 8 + 32}
    for name, row in result["runs"].items():
        folder = out / ("topk" if name == "topk_tail" else name) / "02b_hidden_states"
        disk = sum(p.stat().st_size for p in folder.resolve().rglob("*") if p.is_file())
        manifest = json.loads((folder / "manifest.json").read_text())
        assert row["bytes_per_token"] == pytest.approx(manifest["disk_bytes"] / tokens)
        assert manifest["disk_bytes"] == pytest.approx(disk, rel=0.05)  # the manifest's own size
        assert row["payload_bytes_per_token"] == payload[name]
        assert row["bytes_per_token"] > row["payload_bytes_per_token"]  # plus file overhead
    runs = result["runs"]
    assert runs["fp8_all"]["bytes_per_token"] < runs["fp8"]["bytes_per_token"] \
        < runs["bf16"]["bytes_per_token"]
    assert runs["topk"]["bytes_per_token"] == runs["topk_tail"]["bytes_per_token"]  # same files


def test_bench_layouts_acceptance_is_each_runs_own_05_result(layouts):
    _, out, result = layouts
    seen = set()
    for name, row in result["runs"].items():
        res = json.loads((out / name / "05_benchmark" / "results.json").read_text())
        (prompt_set,) = res["prompt_sets"].values()
        for steps, m in prompt_set["steps"].items():
            rounds = [a for lengths in m["accept_lengths"] for a in lengths]
            assert row["acceptance"][steps] == pytest.approx(sum(rounds) / len(rounds))
            assert 1.0 <= row["acceptance"][steps] <= int(steps) + 1
            assert 0.0 <= row["loop_share"][steps] <= 1.0
        seen.add(json.dumps(row["acceptance"]))
        assert row["prompts"] == 2
    assert 0.0 <= min(result["tail_mass"].values()) <= max(result["tail_mass"].values()) <= 1.0
    tail = [result["tail_mass"][k] for k in ("4", "8", "16", "32", "64")]
    assert tail == sorted(tail, reverse=True)  # less mass outside a larger top K
