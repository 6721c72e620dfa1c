"""The fused lm_head + soft cross-entropy equals the per-step autograd formula it replaces."""

from __future__ import annotations

import pytest
import torch

from eagle3.train.head_loss import head_soft_ce_loss

K, B, T, H, V = 3, 2, 10, 6, 13


def _inputs(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    normed = torch.randn(K, B, T, H, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    target_p = torch.softmax(torch.randn(B, T, V, generator=g, dtype=dtype), -1).float()
    w = (torch.rand(K, B, T, generator=g) < 0.7).float()
    for k in range(K):
        w[k, :, T - 1 - k:] = 0  # no target past the row's end
    scale = torch.rand(K, generator=g) + 0.5
    return normed, weight, target_p, w, scale


def _reference(normed, weight, target_p, w, scale):
    """sum_k scale_k sum_t w_kt * -(p_{t+1+k} . log_softmax(x_kt W^T)), by plain autograd."""
    total, ce = 0.0, []
    for k in range(K):
        n = k + 1
        logp = torch.log_softmax(normed[k, :, : T - n] @ weight.T, -1)
        ce_k = (-(target_p[:, n:].to(logp.dtype) * logp).sum(-1) * w[k, :, : T - n]).sum()
        ce.append(ce_k)
        total = total + scale[k] * ce_k
    return total, torch.stack(ce)


@pytest.mark.parametrize("chunk_rows", [1, 3, 1024])
def test_fused_head_loss_matches_autograd_reference_when_rows_are_chunked(chunk_rows):
    normed, weight, target_p, w, scale = _inputs(0)
    loss, ce, top = head_soft_ce_loss(normed, weight, target_p, w, scale, chunk_rows)
    (0.5 * loss).backward()  # a grad_accum of 2 scales the incoming gradient
    grads = normed.grad.clone(), weight.grad.clone()
    normed.grad, weight.grad = None, None
    ref, ref_ce = _reference(normed, weight, target_p, w, scale)
    (0.5 * ref).backward()
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce, ref_ce.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], normed.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)
    for k in range(K):  # rows without a target get no gradient at all
        assert torch.all(grads[0][k, :, T - 1 - k:] == 0)
        expected_top = (normed[k] @ weight.T).argmax(-1)
        assert torch.equal(top[k, :, : T - 1 - k], expected_top[:, : T - 1 - k])


def test_fused_head_loss_without_grad_mode_gives_the_same_loss_and_argmax():
    normed, weight, target_p, w, scale = _inputs(1, torch.float32)
    loss, ce, top = head_soft_ce_loss(normed, weight, target_p, w, scale, 4)
    with torch.no_grad():
        loss_ng, ce_ng, top_ng = head_soft_ce_loss(normed, weight, target_p, w, scale, 4)
    assert torch.equal(loss.detach(), loss_ng) and torch.equal(ce, ce_ng)
    assert torch.equal(top, top_ng)


def test_fused_head_loss_in_bf16_stays_within_bf16_noise_of_the_float64_reference():
    normed, weight, target_p, w, scale = _inputs(2)
    x16 = normed.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    loss, _, _ = head_soft_ce_loss(x16, w16, target_p, w, scale, 4)
    loss.backward()
    ref, _ = _reference(normed, weight, target_p, w, scale)
    ref.backward()
    assert abs(float(loss) - float(ref)) / abs(float(ref)) < 2e-2
    for ours, exact in ((x16.grad, normed.grad), (w16.grad, weight.grad)):
        err = (ours.double() - exact).norm() / exact.norm()
        assert err < 2e-2, float(err)
