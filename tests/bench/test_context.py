"""Acceptance by context position (eagle3/bench/context.py) and the positions 05 records."""

from __future__ import annotations

import pytest
import torch

from eagle3.bench.context import acceptance_by_context
from eagle3.bench.evaluate import OracleProposer, speculative_chain


def test_acceptance_by_context_averages_rounds_per_bucket_of_their_start():
    out = acceptance_by_context([[4, 1, 2], [3]], [[10, 1023, 1024], [2500]], bucket_tokens=1024)
    assert out == [
        {"from": 0, "to": 1024, "acceptance_length": 2.5, "verify_passes": 2},
        {"from": 1024, "to": 2048, "acceptance_length": 2.0, "verify_passes": 1},
        {"from": 2048, "to": 3072, "acceptance_length": 3.0, "verify_passes": 1},
    ]


def test_acceptance_by_context_refuses_lists_that_do_not_pair():
    with pytest.raises(ValueError):
        acceptance_by_context([[2, 2]], [[5]])
    with pytest.raises(ValueError):
        acceptance_by_context([[2]], [[5]], bucket_tokens=0)


class _CountingTarget:
    """A target whose greedy next token is always (last id + 1) % 50; no aux states."""

    def __init__(self):
        self.seen: list[int] = []

    def forward(self, ids):
        self.seen += ids
        logits = torch.full((len(ids), 50), -1e9)
        for i, t in enumerate(ids):
            logits[i, (t + 1) % 50] = 0.0
        return logits, torch.zeros(len(ids), 3)

    def crop(self, length):
        self.seen = self.seen[:length]


def test_speculative_chain_records_the_context_length_at_each_round_start():
    prompt = [1, 2, 3]
    expected = [(3 + i) % 50 + 1 for i in range(10)]  # 4, 5, ...
    # The oracle proposes the target's own continuation: every round accepts all its drafts.
    proposer = OracleProposer(prompt, expected)
    res = speculative_chain(_CountingTarget(), proposer, prompt, max_new=10, eos=set(), steps=2)
    assert res.output_ids == expected
    # The first token comes from the prefill; round k starts with len(prompt) + committed.
    starts, n = [], len(prompt) + 1
    for a in res.accept_lengths:
        starts.append(n)
        n += a
    assert res.round_contexts == starts
    assert res.round_contexts[0] == 4
