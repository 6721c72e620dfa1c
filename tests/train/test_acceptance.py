"""04's acceptance estimate: verify rounds, the full-vocabulary argmax, and equality with the
offline evaluator on the target's own greedy continuations."""

from __future__ import annotations

import pytest
import torch

from eagle3.bench.evaluate import (
    Eagle3Proposer,
    TargetRunner,
    autoregressive_decode,
    speculative_decode,
)
from eagle3.core.hidden_states import capture_hf
from eagle3.core.loops import loop_free_acceptance, loop_stats
from eagle3.draft.model import DraftConfig
from eagle3.train.acceptance import (
    AcceptanceEstimate,
    accepted_per_anchor,
    full_argmax,
    walk_rounds,
)
from eagle3.train.loop import build_draft
from eagle3.train.ttt import TTTModel
from eagle3.vocab.mapping import build_mapping


def test_full_argmax_equals_the_argmax_of_whole_logits_when_scored_in_chunks():
    g = torch.Generator().manual_seed(0)
    final, head = torch.randn(2, 9, 8, generator=g), torch.randn(40, 8, generator=g)
    expected = (final @ head.T).argmax(-1)
    for chunk in (7, 16, 40, 64):
        assert torch.equal(full_argmax(final, head, chunk), expected)


def test_rounds_start_accepted_plus_one_positions_later_when_walking_a_span():
    # prompt 0..2, span 3..9 (7 tokens); a round at anchor t accepts accepted[t] drafts
    accepted = [0, 0, 2, 0, 0, 1, 3, 0, 0, 0]
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    w = walk_rounds(accepted, mask, [0] * 10, list(range(10, 20)))
    # anchor 2 (a=2) -> anchor 5 (a=1) -> anchor 7 (a=0) -> anchor 8: its pending token 9 is
    # the span's last, nothing is left to propose. Rounds 3, 2, 1 -> 6 / 3, as the evaluator
    # decoding 7 tokens would count them; a per-anchor mean (13 / 7) differs.
    assert (w["accept_sum"], w["rounds"]) == (6, 3)
    per_anchor = sum(1 + accepted[t] for t in range(2, 9)) / 7
    assert per_anchor != pytest.approx(6 / 3)


def test_a_draft_token_is_a_miss_when_the_target_argmax_lies_outside_the_draft_vocab():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    doc = torch.zeros(1, 6, dtype=torch.int32)
    greedy = torch.tensor([[2, 3, 4, 5, 6, 7]])  # the record is the target's greedy path
    drafts = [torch.tensor([[3, 4, 5, 6, 7, 0]]), torch.tensor([[4, 5, 6, 7, 0, 0]])]
    assert accepted_per_anchor(drafts, greedy, ids, doc)[0, :3].tolist() == [2, 2, 2]
    # the target's choice after position 2 is 99, which the draft vocabulary lacks: the draft
    # proposed the best id it has (4, the record's token) and is rejected
    greedy_outside = greedy.clone()
    greedy_outside[0, 2] = 99
    got = accepted_per_anchor(drafts, greedy_outside, ids, doc)[0, :3].tolist()
    assert got == [1, 0, 2]  # anchor 0 stops after step 0, anchor 1 misses at step 0


def test_a_round_ends_where_the_record_leaves_the_targets_greedy_path():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    doc = torch.zeros(1, 6, dtype=torch.int32)
    greedy = torch.tensor([[2, 3, 8, 5, 6, 7]])  # after 3 the target says 8, the record has 4
    drafts = [torch.tensor([[3, 8, 5, 6, 7, 0]]), torch.tensor([[8, 5, 6, 7, 0, 0]])]
    # anchor 0: step 0 proposes 3 == greedy[1] (accepted); step 1 read the record's 3... and
    # proposes 8 == greedy[2]: accepted. anchor 1: step 0 accepted (8); step 1 read the record's
    # 4, not the accepted 8: serving is unknown there, the round ends.
    assert accepted_per_anchor(drafts, greedy, ids, doc)[0, :2].tolist() == [2, 1]


# ---------------------------------------------------------------- equality with 05's evaluator

CAPTURE = [2, 4, 5]
MAX_NEW = 24


def _greedy_records(model, n: int, extra: int):
    """(prompts, records): greedy continuations of random prompts, `extra` tokens past the
    budget so that the last round's draft tokens can be checked, as the evaluator does."""
    g = torch.Generator().manual_seed(3)
    prompts, records = [], []
    vocab = model.config.vocab_size - 20  # the special tokens are the last ids
    for i in range(n):
        prompt = torch.randint(20, vocab, (int(torch.randint(5, 12, (1,), generator=g)),),
                               generator=g).tolist()
        out = autoregressive_decode(TargetRunner(model, [0]), prompt, MAX_NEW + extra,
                                    set()).output_ids
        prompts.append(prompt)
        records.append({"input_ids": prompt + out,
                        "loss_mask": [0] * len(prompt) + [1] * MAX_NEW + [0] * extra})
    return prompts, records


def _packed_rows(model, records: list[dict], per_row: int) -> list[dict]:
    """fp32 packed rows of `per_row` records each (collate_packed's layout)."""
    rows = []
    for start in range(0, len(records), per_row):
        group = records[start:start + per_row]
        ids = torch.tensor([t for r in group for t in r["input_ids"]])[None]
        with torch.no_grad():
            states = [capture_hf(model, torch.tensor([r["input_ids"]]),
                                 torch.ones(1, len(r["input_ids"]), dtype=torch.long), CAPTURE)
                      for r in group]
        rows.append({
            "input_ids": ids,
            "loss_mask": torch.tensor([m for r in group for m in r["loss_mask"]])[None],
            "doc_ids": torch.cat([torch.full((len(r["input_ids"]),), j, dtype=torch.int32)
                                  for j, r in enumerate(group)])[None],
            "positions": torch.cat([torch.arange(len(r["input_ids"])) for r in group])[None],
            "aux": torch.cat([torch.cat(a, -1) for a, _ in states], 1),
            "final": torch.cat([f for _, f in states], 1)})
    return rows


def test_estimate_equals_the_evaluators_acceptance_when_records_are_greedy_continuations(
        target_model):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps = 3
    prompts, records = _greedy_records(target_model, 4, extra=steps + 1)
    rows = _packed_rows(target_model, records, per_row=2)
    embed = target_model.model.embed_tokens.weight.detach()
    lm_head = target_model.lm_head.weight.detach()
    V, H = lm_head.shape
    seen = torch.bincount(torch.tensor([t for r in records for t in r["input_ids"]]),
                          minlength=V)
    hot = torch.sort(torch.argsort(seen, descending=True, stable=True)[:40]).values
    mapping = build_mapping(hot.numpy(), V)  # some greedy tokens fall outside: misses
    dcfg = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                       intermediate_size=128, vocab_size=V, draft_vocab_size=40,
                       target_hidden_size=H, capture_layers=CAPTURE)
    draft = build_draft(dcfg, 0, mapping["d2t"], mapping["t2d"])
    model = TTTModel(draft, embed, lm_head[hot], steps, 0.8)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(12):  # a little training: the draft must accept some tokens, not all
        for row in rows:
            loss, _ = model(row["input_ids"], row["loss_mask"], row["doc_ids"],
                            row["positions"], row["aux"], row["final"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    draft.eval()

    estimate = AcceptanceEstimate(lm_head, draft.t2d, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for row in rows:
            logits = model.unroll(row["input_ids"], row["doc_ids"], row["positions"], row["aux"])
            estimate.add(draft, logits, row["input_ids"], row["loss_mask"], row["doc_ids"],
                         row["final"])
    sim = AcceptanceEstimate.result(estimate.sums)
    # fp8-topk rows store the target's argmax instead of the final state (zero in the row):
    # the estimate must read it and come out the same.
    topk_estimate = AcceptanceEstimate(lm_head, draft.t2d, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for row in rows:
            logits = model.unroll(row["input_ids"], row["doc_ids"], row["positions"], row["aux"])
            top = (row["final"] @ lm_head.T).argmax(-1)
            topk_estimate.add(draft, logits, row["input_ids"], row["loss_mask"], row["doc_ids"],
                              torch.zeros_like(row["final"]), top)
    assert torch.equal(topk_estimate.sums, estimate.sums)

    proposer = Eagle3Proposer(draft, embed)
    runs = [speculative_decode(target_model, proposer, p, MAX_NEW, set(), steps, CAPTURE)
            for p in prompts]
    lengths = [a for r in runs for a in r.accept_lengths]
    measured = sum(lengths) / len(lengths)
    assert [r.output_ids for r in runs] == [r["input_ids"][len(p):len(p) + MAX_NEW]
                                           for p, r in zip(prompts, records)]
    assert 1.2 < measured < steps + 1  # neither trivial nor perfect
    assert sim["sim_rounds"] == len(lengths)
    assert sim["sim_accept"] == pytest.approx(measured, abs=1e-9)
    stats = loop_stats([r.output_ids for r in runs])
    free = loop_free_acceptance([r.accept_lengths for r in runs], stats.first_loop)
    assert sim["loop_share"] == pytest.approx(stats.share, abs=1e-9)
    if free["acceptance_length"] is None:
        assert sim["sim_accept_loop_free"] is None
    else:
        assert sim["sim_accept_loop_free"] == pytest.approx(free["acceptance_length"], abs=1e-9)
    assert sim["greedy_share"] == 1.0
    assert sim["greedy_in_draft_vocab"] < 1.0


def test_standard_error_is_the_ratio_estimators_over_samples_from_summed_moments():
    """Three samples in two packed rows: the standard error from the sums the eval reduces
    equals sqrt(n/(n-1) * sum((a_i - R r_i)^2)) / sum(r_i) computed from each sample walked
    on its own (a_i accepted tokens, r_i rounds); one sample has none."""
    import math

    from eagle3.train.acceptance import FIELDS, WALKED, AcceptanceEstimate

    samples = [  # (accepted per anchor, loss mask): prompt of 3, span of 7
        ([0, 0, 2, 0, 0, 1, 3, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
        ([0, 0, 1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
        ([0, 3, 0, 0, 0, 2, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ]
    alone = [walk_rounds(acc, mask, [0] * 10, list(range(10))) for acc, mask in samples]
    a = [w["accept_sum"] for w in alone]
    r = [w["rounds"] for w in alone]
    assert len(set(ai / ri for ai, ri in zip(a, r))) == 3  # the samples disagree: a spread
    R = sum(a) / sum(r)
    want = math.sqrt(3 / 2 * sum((ai - R * ri) ** 2 for ai, ri in zip(a, r))) / sum(r)

    rows = [(samples[0][0] + samples[1][0], samples[0][1] + samples[1][1], [0] * 10 + [1] * 10),
            (samples[2][0], samples[2][1], [0] * 10)]
    sums = torch.zeros(len(FIELDS), dtype=torch.float64)
    for acc, mask, doc in rows:
        w = walk_rounds(acc, mask, doc, list(range(len(acc))))
        sums[:WALKED] += torch.tensor([w[f] for f in FIELDS[:WALKED]], dtype=torch.float64)
    got = AcceptanceEstimate.result(sums)
    assert got["sim_samples"] == 3
    assert got["sim_accept"] == pytest.approx(R)
    assert got["sim_accept_se"] == pytest.approx(want, rel=1e-12)
    one = walk_rounds(*samples[0], [0] * 10, list(range(10)))
    single = torch.zeros(len(FIELDS), dtype=torch.float64)
    single[:WALKED] += torch.tensor([one[f] for f in FIELDS[:WALKED]], dtype=torch.float64)
    assert AcceptanceEstimate.result(single)["sim_accept_se"] is None
