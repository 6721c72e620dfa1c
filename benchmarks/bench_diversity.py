#!/usr/bin/env python3
"""How varied the user turns of prompt sets are, side by side (eagle3/prepare/diversity.py):
length spread, distinct-1/2/3, duplicate rates and task-type shares. Each set is a JSONL file of
conversation or prompt-set records (`{"id", "messages", "steer"?}`: 01's conversations and
held-out prompts, prompts/*.jsonl); all are measured at the size of the smallest (a seeded
sample), since distinct-n falls as a set grows.

    python benchmarks/bench_diversity.py \
        human_chat=prompts/human_chat.jsonl human_code=prompts/human_code.jsonl \
        self_written=tests/fixtures/smollm2_chat_draft/heldout_chat.jsonl --json-out div.json
    python benchmarks/bench_diversity.py a=01_prepared/x/heldout.jsonl --sample 0  # all turns
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.core.stage import atomic_write_json  # noqa: E402
from eagle3.prepare.diversity import DiversityInputError, measure, user_turns  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sets", nargs="+", metavar="NAME=PATH",
                   help="a set's name and its JSONL file of conversation records")
    p.add_argument("--sample", type=int, default=-1,
                   help="user turns measured per set, a seeded sample (default -1: the "
                        "smallest set's count; 0: every turn of each set)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    p.add_argument("--turns", choices=("all", "first"), default="first",
                   help="each record's first user turn (default) or all of them")
    p.add_argument("--near-dup-threshold", type=float, default=0.8,
                   help="word 3-shingle Jaccard of a near duplicate, (0, 1] (default 0.8, "
                        "01's self-written filter)")
    p.add_argument("--json-out", type=Path, default=None, help="write the figures here too")
    args = p.parse_args(argv)
    if args.sample < -1:
        p.error("--sample must be -1 (smallest set), 0 (all) or a count")
    if not 0 < args.near_dup_threshold <= 1:
        p.error("--near-dup-threshold must be in (0, 1]")
    for s in args.sets:
        name, _, path = s.partition("=")
        if not name or not path:
            p.error(f"set {s!r}: write NAME=PATH")
    return args


def read_records(path: Path) -> list[tuple[str, dict]]:
    """(file:line, record) of every non-blank line; a bad line is a one-line error."""
    if not path.is_file():
        raise DiversityInputError(f"{path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DiversityInputError(f"{path}:{n}: bad JSON ({e})") from e
    return out


def table(results: dict) -> str:
    """The figures as a markdown table, one row per set."""
    head = ("| set | turns | words p5 / p25 / p50 / p75 / p95 (mean) | distinct-1 / 2 / 3 | "
            "exact / near dup | task types (share) |\n|---|---|---|---|---|---|")
    rows = []
    for name, r in results.items():
        w = r["words"]
        tasks = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["task_share"].items())
        rows.append(f"| {name} | {r['turns']} | {w['p5']:g} / {w['p25']:g} / {w['p50']:g} / "
                    f"{w['p75']:g} / {w['p95']:g} ({w['mean']:g}) | {r['distinct_1']:.3f} / "
                    f"{r['distinct_2']:.3f} / {r['distinct_3']:.3f} | "
                    f"{100 * r['exact_dup_rate']:.1f}% / {100 * r['near_dup_rate']:.1f}% | "
                    f"{tasks} |")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        turns = {}
        for s in args.sets:
            name, _, path = s.partition("=")
            turns[name] = user_turns(read_records(Path(path)), first_only=args.turns == "first")
    except DiversityInputError as e:
        print(f"bench_diversity: {e}", file=sys.stderr)
        return 2
    sample = (min(len(t) for t in turns.values()) if args.sample == -1
              else args.sample or None)
    results = {name: measure(t, sample, args.seed, args.near_dup_threshold)
               for name, t in turns.items()}
    print(table(results))
    if args.json_out:
        atomic_write_json(args.json_out, {"sets": dict(s.partition("=")[::2] for s in args.sets),
                                          "sample": sample, "seed": args.seed,
                                          "turns": args.turns,
                                          "near_dup_threshold": args.near_dup_threshold,
                                          "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
