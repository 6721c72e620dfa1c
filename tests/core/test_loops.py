"""Loop share and loop-free acceptance (eagle3/core/loops.py), the one definition 04, 05 and
the GPU reference use."""

from __future__ import annotations

import pytest

from eagle3.bench.report import report_markdown, summary_rows
from eagle3.core.loops import (
    loop_free_acceptance,
    loop_mask,
    loop_stats,
    loop_summary,
    rounds_before_loop,
)


def test_loop_mask_marks_a_unit_repeated_four_times_when_span_is_long_enough():
    seq = [90, 91] + [1, 2, 3, 4] * 4 + [92, 93]
    mask = loop_mask(seq)
    assert mask == [False, False] + [True] * 16 + [False, False]


def test_loop_mask_ignores_a_block_seen_only_twice():
    block = [1, 2, 3, 4, 5, 6, 7, 8]
    assert not any(loop_mask(block + block))  # two copies of an 8-token unit: not a loop


def test_loop_mask_ignores_short_runs_of_one_token():
    seq = [5, 6, 7] + [0] * 11 + [8, 9]  # 11 < the 12-token minimum span
    assert not any(loop_mask(seq))
    assert sum(loop_mask([5] + [0] * 12)) == 12


def test_loop_stats_counts_over_all_outputs_and_drops_a_trailing_eos():
    looping = [7] + [1, 2, 3] * 5 + [99]  # 15 loop tokens, eos 99 not counted
    clean = list(range(20))
    stats = loop_stats([looping, clean], eos={99})
    assert (stats.tokens, stats.loop_tokens, stats.looping_outputs) == (36, 15, 1)
    assert stats.first_loop == [1, None]
    assert stats.share == pytest.approx(15 / 36)


def test_rounds_before_loop_keeps_rounds_whose_tokens_all_precede_the_first_loop():
    # prefill token 0; rounds commit 1-3, 4-5, 6, 7-10: a loop from position 6 keeps two
    assert rounds_before_loop([3, 2, 1, 4], 6) == [3, 2]
    assert rounds_before_loop([3, 2, 1, 4], 7) == [3, 2, 1]
    assert rounds_before_loop([3, 2, 1, 4], None) == [3, 2, 1, 4]
    assert rounds_before_loop([3, 2], 2) == []


def test_loop_free_acceptance_is_one_when_every_accepted_token_is_inside_a_loop():
    clean = [90, 91, 92, 93]
    looping = [5, 6] + [1, 2] * 10
    free = loop_free_acceptance([[1, 1, 1], [1, 4, 4, 4, 4, 4]], [None, 2])
    assert free == {"acceptance_length": 1.0, "verify_passes": 4}
    out = loop_summary([clean, looping], [[1, 1, 1], [1, 4, 4, 4, 4, 4]])
    assert out["loop_share"] == pytest.approx(20 / 26)
    assert out["loop_free_acceptance"] == 1.0 and out["looping_outputs"] == 1


def test_offline_report_puts_loop_share_and_loop_free_acceptance_beside_acceptance():
    m = {"acceptance_length": 3.5, "verify_passes": 6, "per_position_acceptance": [1.0],
         "tok_s": 1.0, "speedup": 1.0, "lossless_mismatches": 0, "loop_share": 0.88,
         "loop_free_acceptance": 1.0, "loop_free_verify_passes": 4}
    results = {"backend": "hf", "draft": "d", "prompt_sets": {"eval": {
        "temperature": 0.0, "baseline_tok_s": 1.0, "steps": {"3": m}}}}
    assert "| 3.500 | 0.880 | 1.000 (4) |" in report_markdown(results)
    outputs, rows, _ = summary_rows(results)
    assert "loop share 88%, loop-free acceptance 1.000 (4 rounds)" in rows[
        "eval steps 3: acceptance length"]
    assert outputs["loops"]["3"] == {"loop_share": 0.88, "loop_free_acceptance": 1.0}
