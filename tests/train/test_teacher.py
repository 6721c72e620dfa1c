"""The stored top-k teacher: its two truncations, the tail bucket's loss, and training from every
layout (bf16, fp8, fp8-all, fp8-topk, and all of them mixed in one run)."""

from __future__ import annotations

import pytest
import torch
import train_helpers as th

from eagle3.core import hidden_states as hs
from eagle3.train.log import read_metrics
from eagle3.train.teacher import TailBucketCE, teacher_targets
from eagle3.train.ttt import TTTModel


def _topk_batch(final_BTH, lm_head_hot_VH, k):
    lp = torch.log_softmax(final_BTH @ lm_head_hot_VH.T, -1)
    v, i = lp.topk(k, -1)
    return {"teacher_ids": i, "teacher_logprobs": v,
            "has_final": torch.zeros(final_BTH.shape[:2], dtype=torch.bool)}


def test_topk_teacher_equals_the_full_teacher_when_k_is_the_whole_draft_vocabulary():
    torch.manual_seed(0)
    final, hot = torch.randn(2, 5, 8), torch.randn(12, 8)
    full = teacher_targets(final, hot, torch.float32)
    for mode in ("renorm", "tail"):
        got = teacher_targets(torch.zeros_like(final), hot, torch.float32,
                              _topk_batch(final, hot, 12), mode)
        torch.testing.assert_close(got.p_BTV, full.p_BTV, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.top_BT, full.top_BT)
        if mode == "tail":
            assert float(got.tail_p_BT.abs().max()) < 1e-5  # nothing outside the top K


def test_topk_teacher_renormalises_or_keeps_the_tail_as_one_bucket():
    torch.manual_seed(1)
    final, hot = torch.randn(1, 4, 8), torch.randn(12, 8)
    full = teacher_targets(final, hot, torch.float32).p_BTV
    topk = _topk_batch(final, hot, 3)
    share = full.gather(-1, topk["teacher_ids"]).sum(-1)  # the top-3 mass of the full teacher
    renorm = teacher_targets(final, hot, torch.float32, topk, "renorm")
    tail = teacher_targets(final, hot, torch.float32, topk, "tail")
    torch.testing.assert_close(renorm.p_BTV.sum(-1), torch.ones(1, 4))
    torch.testing.assert_close(tail.p_BTV.sum(-1), share)
    torch.testing.assert_close(tail.tail_p_BT, 1 - share)
    assert int(tail.tail_BTV.sum(-1).min()) == 12 - 3  # the ids outside the top 3
    assert torch.equal(renorm.top_BT, full.argmax(-1)) and torch.equal(tail.top_BT, renorm.top_BT)


def test_mixed_batch_keeps_the_exact_teacher_where_the_file_stores_the_final_state():
    torch.manual_seed(2)
    final, hot = torch.randn(1, 6, 8), torch.randn(12, 8)
    topk = _topk_batch(final, hot, 2)
    topk["has_final"][0, :3] = True
    got = teacher_targets(final, hot, torch.float32, topk, "tail")
    full = teacher_targets(final, hot, torch.float32).p_BTV
    torch.testing.assert_close(got.p_BTV[0, :3], full[0, :3])
    assert float(got.tail_p_BT[0, :3].abs().max()) == 0.0
    assert float(got.tail_p_BT[0, 3:].min()) > 0.0


def test_tail_bucket_ce_equals_autograd_of_minus_tail_mass_times_log_tail_probability():
    torch.manual_seed(3)
    logits = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    tail = torch.rand(5, 10) > 0.4
    tail[:, 0] = True  # at least one id per row
    tail_p, w = torch.rand(5, dtype=torch.float64), torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0],
                                                                dtype=torch.float64)
    got = TailBucketCE.apply(logits, tail, tail_p, w)
    (g_got,) = torch.autograd.grad(got, logits)
    q = torch.softmax(logits, -1)
    ref = -(w * tail_p * torch.log((q * tail).sum(-1))).sum()
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_got, g_ref)


def test_ttt_loss_from_a_whole_vocabulary_topk_file_equals_the_loss_from_its_final_state():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    doc, pos = torch.zeros(1, 8, dtype=torch.int32), torch.arange(8)[None]
    draft, embed, teacher = th.tiny_parts()
    torch.manual_seed(4)
    aux, final = torch.randn(1, 8, 3 * th.H), torch.randn(1, 8, th.H)
    topk = _topk_batch(final, teacher, th.VD)
    with torch.no_grad():
        ref, ref_stats = TTTModel(draft, embed, teacher, 3, 0.8)(ids, mask, doc, pos, aux, final)
        for mode in ("renorm", "tail"):
            model = TTTModel(draft, embed, teacher, 3, 0.8, topk_teacher=mode)
            loss, stats = model(ids, mask, doc, pos, aux, torch.zeros_like(final), topk=topk)
            assert float(loss) == pytest.approx(float(ref), rel=1e-4), mode
            assert torch.equal(stats[3:], ref_stats[3:])  # hits, weights, acceptance


@pytest.mark.parametrize("layouts", [("fp8-topk",), ("bf16", "fp8", "fp8-all", "fp8-topk")])
def test_training_learns_from_every_layout_and_from_layouts_mixed_in_one_run(tmp_path, layouts):
    root = tmp_path / "data"
    th.write_dataset(root / "train", 24, seed=1, layouts=layouts)
    th.write_dataset(root / "eval", 4, seed=2, layouts=layouts)
    data = th.load_tiny_data(root)
    assert data.teacher_topk == 8
    for mode in ("renorm", "tail"):
        summary, _ = th.run_tiny(root, tmp_path / f"out_{mode}", epochs=5, lr=1e-2,
                                 topk_teacher=mode, eval_every=100, save_every=100)
        first = [r for r in read_metrics(tmp_path / f"out_{mode}" / "metrics.jsonl")
                 if "eval_loss" in r][0]
        assert summary["eval_loss"][0] < 0.95 * first["eval_loss"][0], (layouts, mode)
        assert summary["eval_acc"][0] > first["eval_acc"][0]


def test_loader_refuses_a_topk_file_when_the_run_was_indexed_without_one(tmp_path):
    from eagle3.train.data import DataError, PackedRows

    th.write_dataset(tmp_path, 1, seed=0, layouts=("fp8-topk",))
    with pytest.raises(DataError, match="top-8"):
        PackedRows([hs.file_path(tmp_path, 0)], [[0]], 128, 128, topk=0)[0]
