"""The draft lm_head and the soft cross-entropy of every TTT step in one autograd function.

Unfused, each TTT step k would run `logits_k = lm_head(normed_k)` and a soft cross-entropy
against the target's distribution at t+1+k; autograd then keeps every step's `[T, V]` logits for
the backward, re-reads them there, and forms the lm_head weight gradient as K separate GEMMs
whose `[V, H]` results it sums one by one (K-1 extra passes over a bf16 copy of the weight).

`HeadSoftCrossEntropy` computes the same loss and the same gradients, but:
- the gradient of the logits is formed in the forward, chunk by chunk of rows in float32, and
  written over the logits in place (one `[K, B, T, V]` buffer in the compute dtype, the same
  bytes the unfused path saves), so the backward never re-reads logits or reruns the softmax;
- the backward does the two lm_head GEMMs once over all K steps' rows: `dX = G W` and
  `dW = G^T X` with a K*B*T-long reduction, so the weight gradient is one GEMM, summed in the
  GEMM's float32 accumulator instead of K bf16 partial sums.

Loss: `sum_k scale_k * sum_{b,t} w_kbt * CE(p_{b,t+1+k}, softmax(X_kbt W^T))`, the target rows
`p` being the teacher's distribution over the draft vocabulary; rows t >= T-1-k have no target
(weight and gradient 0). Shapes: K steps, B batch, T positions, H hidden, V draft vocab.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 1024  # rows whose float32 logits are live at once (131 MB at V = 32000)


class HeadSoftCrossEntropy(torch.autograd.Function):
    """(loss, per-step weighted CE sums `[K]`, per-row draft argmax `[K, B, T]`).

    Inputs: normed `[K, B, T, H]` (the layer's output of every step), the lm_head weight
    `[V, H]` in the compute dtype, target_p `[B, T, V]` float32 rows summing to 1, weight
    `[K, B, T]` (0 where step k has no target), scale `[K]` (the step's factor in the loss),
    chunk_rows (int). Only the loss is differentiable; the backward may run once.
    """

    @staticmethod
    def forward(ctx, normed_KBTH, weight_VH, target_p_BTV, weight_KBT, scale_K, chunk_rows):
        grad_KBTV = torch.empty((*normed_KBTH.shape[:3], weight_VH.shape[0]),
                                dtype=normed_KBTH.dtype, device=normed_KBTH.device)
        ce_K, top_KBT = _logits_grad_into(grad_KBTV, normed_KBTH, weight_VH, target_p_BTV,
                                          weight_KBT, scale_K, chunk_rows)
        ctx.save_for_backward(normed_KBTH, weight_VH, grad_KBTV)
        ctx.mark_non_differentiable(ce_K, top_KBT)
        return (ce_K * scale_K).sum(), ce_K, top_KBT

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_top):
        normed_KBTH, weight_VH, grad_KBTV = ctx.saved_tensors
        K, B, T, H = normed_KBTH.shape
        g_NV = grad_KBTV.view(K * B * T, -1)
        x_NH = normed_KBTH.reshape(K * B * T, H)
        # grad_loss is 1 / grad_accum in training: scaling the [N, H] and [V, H] results costs
        # less than scaling the [N, V] gradient
        grad_x = (g_NV @ weight_VH).view(K, B, T, H) * grad_loss
        grad_w = (g_NV.T @ x_NH) * grad_loss  # one GEMM over every step's rows
        return grad_x, grad_w, None, None, None, None


def head_soft_ce_loss(normed_KBTH, weight_VH, target_p_BTV, weight_KBT, scale_K,
                      chunk_rows: int = CHUNK_ROWS):
    """Loss, CE sums `[K]` and draft argmax `[K, B, T]`; without grad mode, no gradient buffer
    is formed (evaluation)."""
    if torch.is_grad_enabled() and (normed_KBTH.requires_grad or weight_VH.requires_grad):
        return HeadSoftCrossEntropy.apply(normed_KBTH, weight_VH, target_p_BTV, weight_KBT,
                                          scale_K, chunk_rows)
    ce_K, top_KBT = _logits_grad_into(None, normed_KBTH, weight_VH, target_p_BTV, weight_KBT,
                                      scale_K, chunk_rows)
    return (ce_K * scale_K).sum(), ce_K, top_KBT


def _logits_grad_into(grad_KBTV, normed_KBTH, weight_VH, target_p_BTV, weight_KBT, scale_K,
                      chunk_rows: int):
    """Per step: the logits (one GEMM), then per chunk of rows in float32 their CE sum, argmax
    and, when `grad_KBTV` is given, d(loss)/d(logits) written into it (rows without a target
    get 0)."""
    K, B, T, _ = normed_KBTH.shape
    ce_sums, tops = [], []
    for k in range(K):
        n = k + 1  # step k is scored against the target at t + n
        logits_BTV = normed_KBTH[k] @ weight_VH.T
        ce_k = torch.zeros((), dtype=torch.float32, device=normed_KBTH.device)
        top_chunks = []
        for t0 in range(0, max(T - n, 0), chunk_rows):
            t1 = min(t0 + chunk_rows, T - n)
            lf = logits_BTV[:, t0:t1].float()
            p = target_p_BTV[:, t0 + n:t1 + n]
            w = weight_KBT[k, :, t0:t1]
            lse = torch.logsumexp(lf, dim=-1)
            p_sum = p.sum(-1)
            ce_k = ce_k + ((lse * p_sum - (p * lf).sum(-1)) * w).sum()
            top_chunks.append(lf.argmax(-1))
            if grad_KBTV is not None:
                g = (torch.exp(lf - lse[..., None]) * p_sum[..., None] - p)
                grad_KBTV[k, :, t0:t1].copy_(g * (w * scale_K[k])[..., None])
        top_chunks.append(torch.zeros_like(logits_BTV[:, T - min(n, T):, 0], dtype=torch.long))
        if grad_KBTV is not None:
            grad_KBTV[k, :, T - min(n, T):].zero_()
        ce_sums.append(ce_k)
        tops.append(torch.cat(top_chunks, dim=1))
    return torch.stack(ce_sums), torch.stack(tops)
