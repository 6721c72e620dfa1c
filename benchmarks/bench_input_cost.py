#!/usr/bin/env python3
"""Stage 01's cost on huge rows: one 3,000-turn conversation and one 5 MB message, each alone
through `01_prepare_datasets.py` (1 worker), timed with the peak RSS of its process.

Cases (each row is one dataset of one conversation, replies kept, `--max-seq-len` below):
- `baseline`: one short user/assistant pair: the process start (imports, tokenizer);
- `turns_over`: 3,000 short turns (1,500 user/assistant pairs) at max_seq_len 8192, far over
  it: cut to its longest fitting prefix;
- `turns_over_64k`: the same at max_seq_len 65536 (~2,400 of its turns fit): what a long
  fitting part costs (its turns are rendered one by one: quadratic in the turns that fit);
- `message_5mb`: one 5 MB user message at max_seq_len 8192: refused by the character bound.

    python benchmarks/bench_input_cost.py --target runs/demo/target
    python benchmarks/bench_input_cost.py   # builds the tiny target in a temp folder
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {"baseline": 8192, "turns_over": 8192, "turns_over_64k": 65536, "message_5mb": 8192}


def conversation(case: str) -> dict:
    if case == "baseline":
        return {"id": case, "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello"}]}
    if case == "message_5mb":
        text = ("lorem ipsum dolor sit amet " * 200_000)[: 5 * 1024 * 1024]
        return {"id": case, "messages": [{"role": "user", "content": text},
                                         {"role": "assistant", "content": "ok"}]}
    msgs = []
    for i in range(1500):
        msgs += [{"role": "user", "content": f"question {i}: what is {i} plus one?"},
                 {"role": "assistant", "content": f"{i} plus one is {i + 1}."}]
    return {"id": case, "messages": msgs}


def run_case(case: str, target: Path, work: Path) -> dict:
    """01 on the case's row in a child process: seconds, peak RSS of the child, outcome."""
    data = work / f"{case}.jsonl"
    data.write_text(json.dumps(conversation(case)) + "\n")
    recipe = work / f"{case}.recipe.json"
    recipe.write_text(json.dumps({"name": case, "datasets": [
        {"name": case, "adapter": "openai", "path": str(data), "id_field": "id",
         "regenerate": False, "max_seq_len": CASES[case]}]}))
    cmd = [sys.executable, str(ROOT / "01_prepare_datasets.py"), "--recipe", str(recipe),
           "--target", str(target), "--workdir", str(work / case), "--num-workers", "1",
           "--log-level", "WARNING"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KB, max over children
    if proc.returncode != 0:
        raise SystemExit(f"{case}: 01 failed\n{proc.stderr[-3000:]}")
    out = work / case / "01_prepared" / case
    kept = [json.loads(x) for x in (out / "tokenized.jsonl").read_text().splitlines()]
    quarantined = [json.loads(x)["reason"][:90] for x in
                   (out / "quarantine.jsonl").read_text().splitlines()]
    return {"case": case, "max_seq_len": CASES[case], "seconds": round(seconds, 1),
            "peak_rss_mb": round(rss / 1024), "records": len(kept),
            "tokens": sum(r["seq_len"] for r in kept), "quarantined": quarantined}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=None, help="target folder (default: tiny)")
    ap.add_argument("--case", choices=list(CASES), default=None, help="one case (default: all)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target = args.target
        if target is None:
            from eagle3.tiny.target import make_tiny_target

            target = make_tiny_target(work / "target")
        for case in [args.case] if args.case else list(CASES):
            # one case per child process: RUSAGE_CHILDREN's peak is then that case's own
            if args.case is None:
                cmd = [sys.executable, __file__, "--target", str(target), "--case", case]
                print(subprocess.run(cmd, check=True, capture_output=True,
                                     text=True).stdout.strip())
            else:
                print(json.dumps(run_case(case, target, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
