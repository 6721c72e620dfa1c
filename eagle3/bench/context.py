"""Acceptance by context position: how the draft holds up as the context grows.

Published drafts lose much of their acceptance on long contexts, and Kimi-K2.5's thinking replies
are long, so 05 reports acceptance length (tokens per verify round) per bucket of the context
length at which each round started (`DecodeResult.round_contexts`: prompt plus the tokens
committed so far). Buckets are `bucket_tokens` wide: [0, 1024), [1024, 2048), ... by default.
"""

from __future__ import annotations

CONTEXT_BUCKET_TOKENS = 1024


def acceptance_by_context(accept_lengths: list[list[int]], round_contexts: list[list[int]],
                          bucket_tokens: int = CONTEXT_BUCKET_TOKENS) -> list[dict]:
    """One row per non-empty bucket, in order: {"from", "to", "acceptance_length",
    "verify_passes"}, over the rounds of every generation (parallel lists per generation)."""
    if bucket_tokens <= 0:
        raise ValueError(f"bucket_tokens must be positive, got {bucket_tokens}")
    sums: dict[int, list[int]] = {}
    for lengths, contexts in zip(accept_lengths, round_contexts, strict=True):
        if len(lengths) != len(contexts):
            raise ValueError("accept_lengths and round_contexts differ in length")
        for a, c in zip(lengths, contexts):
            s = sums.setdefault(c // bucket_tokens, [0, 0])
            s[0] += a
            s[1] += 1
    return [{"from": b * bucket_tokens, "to": (b + 1) * bucket_tokens,
             "acceptance_length": total / n, "verify_passes": n}
            for b, (total, n) in sorted(sums.items())]
