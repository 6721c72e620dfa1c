"""The offline summary 05 and reference/evaluate_drafts.py both report for one step count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3.bench.hf import offline_summary, sampling_generator


def _result(output_ids, accept_lengths, seconds=1.0, round_contexts=None):
    contexts = round_contexts or [10 + i for i in range(len(accept_lengths))]
    return SimpleNamespace(output_ids=output_ids, accept_lengths=accept_lengths, seconds=seconds,
                           round_contexts=contexts)


def test_offline_summary_counts_tokens_per_verify_round_and_greedy_mismatches():
    results = [_result([1, 2, 3, 4], [3, 1]), _result([5, 6], [2])]
    out = offline_summary(results, [[1, 2, 3, 4], [5, 7]], steps=2, baseline_tok_s=2.0,
                          temperature=0.0)
    assert out["acceptance_length"] == pytest.approx(6 / 3)  # 6 tokens over 3 verify rounds
    assert out["verify_passes"] == 3
    assert out["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3])
    assert out["tok_s"] == pytest.approx(3.0) and out["speedup"] == pytest.approx(1.5)
    assert out["lossless_mismatches"] == 1


def test_offline_summary_leaves_mismatches_out_when_sampling():
    out = offline_summary([_result([1], [1])], [[2]], 1, 1.0, temperature=0.7)
    assert out["lossless_mismatches"] is None


def test_sampling_generator_gives_each_prompt_its_own_reproducible_stream():
    a, b = sampling_generator(3, 1), sampling_generator(3, 1)
    assert torch.rand(4, generator=a).tolist() == torch.rand(4, generator=b).tolist()
    assert (torch.rand(4, generator=sampling_generator(3, 2)).tolist()
            != torch.rand(4, generator=sampling_generator(3, 1)).tolist())
