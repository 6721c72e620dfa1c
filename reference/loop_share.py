#!/usr/bin/env python3
"""Loop share: how much of a generation is a repetition loop.

A small model decoding greedily falls into cycles (the same line, or the same few tokens, over
and over), and a draft predicts a cycle trivially, which inflates acceptance. Every acceptance
figure of the reference benchmark is reported next to the loop share of the outputs it was
measured on.

Definition. In a token sequence s, a span s[j : j + L] is p-periodic when s[t] == s[t + p] for
every t in [j, j + L - p). A token is *inside a loop* when it lies in a p-periodic span, for some
period 1 <= p <= `max_period`, that repeats its unit at least `min_repeats` times (L >= p *
min_repeats) and is at least `min_span` tokens long. The loop share of a set of outputs is
(tokens inside loops) / (generated tokens), over all outputs together; the final end-of-turn
token is not counted. A prompt "loops" when any of its tokens is inside a loop; `first_loop`
is the position where its first loop starts.

    python reference/loop_share.py RESULTS.json     # any JSON holding per-prompt output ids
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_PERIOD = 32  # tokens: a line of code or two
MIN_REPEATS = 3  # a unit seen three times in a row is a loop, twice may be legitimate code
MIN_SPAN = 12  # tokens: shorter runs ("\n\n\n", "))))") are formatting, not loops


@dataclass
class LoopStats:
    """Loop statistics of a set of outputs."""

    outputs: int = 0
    tokens: int = 0
    loop_tokens: int = 0
    looping_outputs: int = 0
    first_loop: list = field(default_factory=list)  # per output: start of its first loop or None

    @property
    def share(self) -> float:
        return self.loop_tokens / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "share": self.share,
                "params": {"max_period": MAX_PERIOD, "min_repeats": MIN_REPEATS,
                           "min_span": MIN_SPAN}}


def loop_mask(seq: list[int], max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
              min_span: int = MIN_SPAN) -> list[bool]:
    """Per token of `seq`: True when it lies inside a repetition loop (see the module doc)."""
    n = len(seq)
    inside = [False] * n
    for p in range(1, max_period + 1):
        need = max(p * min_repeats, min_span)
        if need > n:
            break
        run = 0  # length of the current run of t with seq[t] == seq[t + p]
        for t in range(n - p + 1):
            if t < n - p and seq[t] == seq[t + p]:
                run += 1
                continue
            span = run + p  # the run of matches starting at t - run covers run + p tokens
            if run and span >= need:
                start = t - run
                for i in range(start, start + span):
                    inside[i] = True
            run = 0
    return inside


def loop_stats(outputs: list[list[int]], eos: set[int] | None = None) -> LoopStats:
    """Loop statistics of `outputs` (generated ids only; a trailing eos id is dropped)."""
    stats = LoopStats()
    for out in outputs:
        out = list(out)
        if out and eos and out[-1] in eos:
            out = out[:-1]
        mask = loop_mask(out)
        stats.outputs += 1
        stats.tokens += len(out)
        stats.loop_tokens += sum(mask)
        first = next((i for i, m in enumerate(mask) if m), None)
        stats.first_loop.append(first)
        stats.looping_outputs += first is not None
    return stats


def find_output_ids(obj) -> list[list[int]]:
    """Every list stored under a key named `output_ids` (lists of ints), depth first."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "output_ids" and isinstance(v, list) and all(isinstance(t, int) for t in v):
                found.append(v)
            else:
                found.extend(find_output_ids(v))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(find_output_ids(v))
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python reference/loop_share.py RESULTS.json", file=sys.stderr)
        return 2
    outputs = find_output_ids(json.loads(Path(argv[0]).read_text()))
    stats = loop_stats(outputs)
    print(json.dumps({k: v for k, v in stats.to_dict().items() if k != "first_loop"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
