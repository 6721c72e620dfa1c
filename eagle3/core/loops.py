"""Loop share: how much of a generation is a repetition loop, and acceptance outside loops.

A small or randomly initialised model decoding greedily falls into cycles (the same line, or the
same few tokens, over and over), and a draft predicts a cycle trivially, which inflates
acceptance. Every acceptance figure (04's simulated one, 05's measured one, the GPU reference's)
is reported next to the loop share of the text it was measured on, and next to the acceptance
of the rounds before the first loop of each generation. This module is the one definition.

Definition. In a token sequence s, a span s[j : j + L] is p-periodic when s[t] == s[t + p] for
every t in [j, j + L - p). A token is *inside a loop* when it lies in a p-periodic span, for some
period 1 <= p <= `MAX_PERIOD`, that repeats its unit at least `MIN_REPEATS` times (L >= p *
MIN_REPEATS) and is at least `MIN_SPAN` tokens long. The loop share of a set of outputs is
(tokens inside loops) / (generated tokens), over all outputs together; a final end-of-turn
token is not counted. An output "loops" when any of its tokens is inside a loop; `first_loop`
is the position where its first loop starts.

Loop-free acceptance. A generation's first token comes from the prefill; verify round i commits
the `accept_lengths[i]` tokens that follow. The loop-free acceptance of a set of generations is
the mean accept length over the rounds whose committed tokens all lie before the generation's
first loop (every round of a generation without a loop).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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


def first_loop(seq: list[int]) -> int | None:
    """Position of the first token of `seq` inside a loop, None when none is."""
    return next((i for i, m in enumerate(loop_mask(seq)) if m), None)


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


def rounds_before_loop(accept_lengths: list[int], loop_start: int | None) -> list[int]:
    """The accept lengths of a generation's rounds whose committed tokens all lie before
    `loop_start` (the first generated token, position 0, comes from the prefill)."""
    if loop_start is None:
        return list(accept_lengths)
    kept, end = [], 1  # tokens committed so far: the prefill's one
    for a in accept_lengths:
        end += a
        if end > loop_start:
            break
        kept.append(a)
    return kept


def loop_free_acceptance(accept_lengths: list[list[int]], first_loops: list) -> dict:
    """{"acceptance_length", "verify_passes"} over the rounds before each generation's first
    loop; acceptance_length is None when no such round exists."""
    kept = [a for lengths, start in zip(accept_lengths, first_loops, strict=True)
            for a in rounds_before_loop(lengths, start)]
    return {"acceptance_length": sum(kept) / len(kept) if kept else None,
            "verify_passes": len(kept)}


def loop_summary(outputs: list[list[int]], accept_lengths: list[list[int]] | None,
                 eos: set[int] | None = None) -> dict:
    """Loop share of `outputs` and, given their rounds, the loop-free acceptance: the figures
    reported next to an acceptance length."""
    stats = loop_stats(outputs, eos)
    out = {"loop_share": stats.share, "looping_outputs": stats.looping_outputs,
           "outputs": stats.outputs}
    if accept_lengths is not None:
        free = loop_free_acceptance(accept_lengths, stats.first_loop)
        out.update(loop_free_acceptance=free["acceptance_length"],
                   loop_free_verify_passes=free["verify_passes"])
    return out
