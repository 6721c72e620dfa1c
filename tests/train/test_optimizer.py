"""04's optimizer step (eagle3/train/optimizer.py): clipping folded into the fused AdamW equals
torch's clip_grad_norm_ followed by the unfused AdamW, and a non-finite norm skips the update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3.train.optimizer import clip_gradients


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def _grads(model: nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = scale * torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("scale", [0.01, 10.0])  # norms below and above --max-grad-norm
def test_clipping_inside_the_fused_adamw_equals_clip_grad_norm_then_adamw(scale):
    fused_model, ref_model = _model(0), _model(0)
    fused = torch.optim.AdamW(fused_model.parameters(), lr=1e-2, fused=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=False)
    flag = torch.tensor(-1)
    for step in range(3):
        _grads(fused_model, scale, step)
        _grads(ref_model, scale, step)
        norm = clip_gradients(fused, 0.5, step, flag)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        torch.testing.assert_close(norm, ref_norm)  # the logged norm: before clipping
        assert (float(fused.grad_scale) > 1.0) == (scale > 1)
        fused.step()
        ref.step()
        fused.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for a, b in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        moved = [float((a - b).abs().max()) for a, b in zip(fused_model.parameters(),
                                                            _model(0).parameters())]
    assert min(moved) > 1e-3  # the updates were applied
    assert int(flag) == -1


def test_unfused_adamw_gets_its_gradients_clipped_in_place():
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=False)
    _grads(model, 10.0, 0)
    norm = clip_gradients(opt, 0.5, 0, torch.tensor(-1))
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(norm) > 0.5 and float(after) == pytest.approx(0.5, rel=1e-4)


def test_a_non_finite_norm_skips_the_fused_update_and_records_the_step():
    model = _model(2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _grads(model, 1.0, 0)
    next(model.parameters()).grad[0, 0] = float("nan")
    flag = torch.tensor(-1)
    clip_gradients(opt, 0.5, 7, flag)
    opt.step()
    assert int(flag) == 7
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
