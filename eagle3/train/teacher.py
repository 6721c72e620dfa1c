"""The teacher of a packed batch: the target's distribution over the draft vocabulary.

From a stored final state it is `softmax(lm_head_hot @ final)` (post-norm: no second norm). An
fp8-topk file stores only the K largest log-probs of that distribution (eagle3/core/
hidden_states.py); the rest of the mass is unknown in detail, and 04 treats it one of two ways
(`--topk-teacher`):

- `renorm`: the top-K probabilities renormalised to sum 1 (the tail is taken as 0);
- `tail`: the top-K probabilities as stored, plus the tail mass `1 - sum` as one bucket: the
  draft is asked to put that mass on the ids outside the top K, in any split. Its CE term is
  `p_tail * (lse(all) - lse(tail ids))`, TailBucketCE below.

Positions of files that store the final state (`has_final`) keep the exact teacher in a mixed
batch. Shapes: B batch, T positions, V draft vocabulary, K stored top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOPK_MODES = ("renorm", "tail")


@dataclass
class TeacherTargets:
    """What the loss and the metrics compare the draft with, at every position."""

    p_BTV: torch.Tensor  # float32; rows sum to 1, or to the top-K share in tail mode
    top_BT: torch.Tensor  # the teacher's argmax draft id
    tail_p_BT: torch.Tensor | None = None  # tail mode: the mass outside the stored top-K
    tail_BTV: torch.Tensor | None = None  # tail mode: bool, the id is in the tail bucket


def topk_probs(logprobs_BTK: torch.Tensor, mode: str) -> torch.Tensor:
    """Probabilities of the stored top-K (`-inf` entries are absent: probability 0)."""
    if mode == "tail":
        return torch.exp(logprobs_BTK)
    lse = torch.logsumexp(logprobs_BTK, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows with no top-K
    return torch.exp(logprobs_BTK - lse)


@torch.no_grad()
def teacher_targets(final_BTH: torch.Tensor, lm_head_hot_VH: torch.Tensor,
                    compute_dtype: torch.dtype, topk: dict | None = None,
                    mode: str = "renorm") -> TeacherTargets:
    """The teacher of every position; `topk`: the batch's `teacher_ids`, `teacher_logprobs`,
    `has_final` (eagle3/train/data.py collate_packed), None when no file of the run has one."""
    logits = final_BTH.to(compute_dtype) @ lm_head_hot_VH.T
    p = torch.softmax(logits.float(), dim=-1)  # [B, T, V]
    if topk is None:
        return TeacherTargets(p, p.argmax(-1))
    if mode not in TOPK_MODES:
        raise ValueError(f"--topk-teacher {mode!r}: expected one of {TOPK_MODES}")
    ids, logprobs, has_final = topk["teacher_ids"], topk["teacher_logprobs"], topk["has_final"]
    pk = topk_probs(logprobs.float(), mode)
    # scatter_add, not scatter: padded entries share id 0 with probability 0
    dense = torch.zeros_like(p).scatter_add_(-1, ids, pk)
    p = torch.where(has_final[..., None], p, dense)
    if mode == "renorm":
        return TeacherTargets(p, p.argmax(-1))
    stored = torch.zeros_like(p).scatter_add_(-1, ids, torch.isfinite(logprobs).float()) > 0
    tail_p = torch.where(has_final, torch.zeros_like(pk[..., 0]),
                         (1.0 - pk.sum(-1)).clamp(min=0.0))
    return TeacherTargets(p, p.argmax(-1), tail_p, ~stored)


class TailBucketCE(torch.autograd.Function):
    """sum_n w_n * p_tail_n * (lse(logits_n) - lse(logits_n over the tail ids)).

    The cross-entropy of the tail bucket: -p_tail * log q(tail), q = softmax(logits). logits
    `[N, V]`, tail `[N, V]` bool, p_tail `[N]`, w `[N]`. The gradient
    is `w * p_tail * (q - tail * q / q(tail))`, formed in float32.
    """

    @staticmethod
    def forward(ctx, logits_NV, tail_NV, tail_p_N, weight_N):
        lf = logits_NV.float()
        lse_N = torch.logsumexp(lf, dim=-1)
        lse_tail_N = torch.logsumexp(lf.masked_fill(~tail_NV, -torch.inf), dim=-1)
        # a row whose top K is the whole vocabulary has no tail (and no tail mass)
        has_tail_N = tail_NV.any(-1)
        lse_tail_N = torch.where(has_tail_N, lse_tail_N, lse_N)
        coef_N = tail_p_N * weight_N * has_tail_N
        ctx.save_for_backward(logits_NV, tail_NV, coef_N, lse_N, lse_tail_N)
        return ((lse_N - lse_tail_N) * coef_N).sum()

    @staticmethod
    def backward(ctx, grad_out):
        logits_NV, tail_NV, coef_N, lse_N, lse_tail_N = ctx.saved_tensors
        lf = logits_NV.float()
        grad = torch.exp(lf - lse_N[:, None]) - tail_NV * torch.exp(lf - lse_tail_N[:, None])
        grad = grad * (coef_N * grad_out)[:, None]
        return grad.to(logits_NV.dtype), None, None, None
