"""Training-time test (TTT): the k-step unroll of the draft over a packed batch, and its loss.

A packed batch row holds several sequences back to back (`doc_ids`: sequence index per row, -1
for padding; `positions`: position inside the sequence). At anchor t, step k (k = 0..K-1) the
draft reads token t+1+k and, as hidden, fc(aux_t) for k = 0 or its own step k-1 output; its
prediction is compared (soft cross-entropy) with the target's distribution at position t+1+k,
`softmax(lm_head_hot @ final_{t+1+k})` over the draft vocabulary (or the stored top-k of it:
eagle3/train/teacher.py). The stored final state is post-norm: no second norm here. The term's weight is `loss_mask[t+1+k]` — the mask moves with
the targets, so the last prompt position (the first the draft serves) is trained — and 0 when
t+1+k lies outside t's sequence. Step k's mean loss is scaled by `step_weight ** k`.

Two unrolls compute the same logits (tests/draft/test_draft_model.py holds both to a float64
serving reference): `shared` (the default) computes the embedding half of the attention's input
projections once per batch and, with flex attention, attends over step 0's keys alone with the
later steps' keys merged in by log-sum-exp (eagle3/draft/attention.py); `per-step` computes every
step's projections in full and attends over all steps' keys concatenated. At Kimi-K2.5 draft size
`shared` does 14% fewer FLOPs per token (eagle3/train/flops.py) and steps faster (BENCHMARKS.md,
"Training step").

Metrics stay on the device (no host sync per micro-step): per step the summed CE, the number of
anchors whose argmax equals the teacher's argmax (over the draft vocabulary: the training
target, not what serving accepts), and the summed weight. The acceptance estimate, which walks
verify rounds against the target's full-vocabulary argmax, is eagle3/train/acceptance.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.draft.attention import StepCache, TTTMasks
from eagle3.draft.model import Eagle3Draft
from eagle3.train.teacher import TailBucketCE, teacher_targets

ATTENTION = ("naive", "flex")
UNROLLS = ("shared", "per-step")


class SoftCrossEntropy(torch.autograd.Function):
    """sum_n w_n * CE(target_p_n, softmax(logits_n)), saving only the logits and their lse.

    logits `[N, V]` (any float dtype), target_p `[N, V]` float32 rows summing to 1, w `[N]`.
    The gradient is `(softmax(logits) * sum(p) - p) * w`, formed in float32.
    """

    @staticmethod
    def forward(ctx, logits_NV, target_p_NV, weight_N):
        lf = logits_NV.float()
        lse_N = torch.logsumexp(lf, dim=-1)
        p_sum = target_p_NV.sum(-1)
        ce_N = lse_N * p_sum - (target_p_NV * lf).sum(-1)
        ctx.save_for_backward(logits_NV, target_p_NV, weight_N, lse_N)
        return (ce_N * weight_N).sum()

    @staticmethod
    def backward(ctx, grad_out):
        logits_NV, target_p_NV, weight_N, lse_N = ctx.saved_tensors
        probs = torch.exp(logits_NV.float() - lse_N[:, None])
        grad = probs * target_p_NV.sum(-1, keepdim=True) - target_p_NV
        grad = grad * (weight_N * grad_out)[:, None]
        return grad.to(logits_NV.dtype), None, None


def shift_rows(x_BT: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """x[:, n:] followed by n `fill` rows (dim 1 keeps its length)."""
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)


def shift_repeat_last(x_BTN: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] followed by n copies of its last row: step n's rows from step 0's embedding
    projections, whose last row is the padding token's, the token `shift_rows(ids, 1 + n)`
    puts in the last n + 1 rows."""
    if n == 0:
        return x_BTN
    return torch.cat([x_BTN[:, n:], x_BTN[:, -1:].expand(-1, n, -1)], dim=1)


def num_stats(steps: int) -> int:
    return 3 * steps


def stats_dict(stats: torch.Tensor, steps: int) -> dict:
    """Per-step mean loss and accuracy from summed stats (host)."""
    s = stats.double().cpu().tolist()
    ce, hits, weight = s[0:steps], s[steps:2 * steps], s[2 * steps:3 * steps]
    return {"loss_steps": [c / max(w, 1.0) for c, w in zip(ce, weight)],
            "acc": [h / max(w, 1.0) for h, w in zip(hits, weight)],
            "supervised": weight[0]}


class TTTModel(nn.Module):
    """The draft plus the frozen target tensors; `forward(batch)` = (loss, stats).

    `embed` `[target_vocab, H]` and `teacher` (target lm_head rows of the draft vocabulary,
    `[draft_vocab, Ht]`) are non-persistent buffers: they follow `.to(device)`, are never saved
    and never trained. `compute_dtype` is the dtype activations are fed in (bf16 under autocast).
    """

    def __init__(self, draft: Eagle3Draft, embed_VH: torch.Tensor, teacher_VdH: torch.Tensor,
                 steps: int, step_weight: float, attention: str = "naive",
                 compute_dtype: torch.dtype = torch.float32, topk_teacher: str = "renorm",
                 unroll: str = "shared"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: expected one of {ATTENTION}")
        if unroll not in UNROLLS:
            raise ValueError(f"--ttt-unroll {unroll!r}: expected one of {UNROLLS}")
        self.draft = draft
        self.register_buffer("embed", embed_VH.to(compute_dtype), persistent=False)
        self.register_buffer("teacher", teacher_VdH.to(compute_dtype), persistent=False)
        self.steps, self.step_weight, self.attention = steps, step_weight, attention
        self.compute_dtype = compute_dtype
        self.topk_teacher = topk_teacher  # how a stored top-k teacher's tail counts (teacher.py)
        self.unroll_mode = unroll  # UNROLLS (module doc)

    def build_masks(self, doc_ids_BT: torch.Tensor, compile_mask: bool = False) -> list | None:
        """Flex block masks of every step (None for the naive attention); build outside
        compiled regions and pass to `forward`. The shared unroll's steps all use step 0's."""
        if self.attention != "flex":
            return None
        masks = TTTMasks(doc_ids_BT, compile_mask)
        if self.unroll_mode == "shared":
            return [masks.for_step(0)] * self.steps
        return masks.all_steps(self.steps)

    def unroll(self, input_ids, doc_ids, positions, aux, masks=None) -> list:
        """The draft logits `[B, T, V]` of steps 0..K-1 (row t = anchor t; rows whose token
        t+1+k lies outside the sequence are garbage that no valid row ever attends to)."""
        T = input_ids.shape[1]
        draft, shared = self.draft, self.unroll_mode == "shared"
        hidden = draft.project_aux(aux.to(self.compute_dtype))  # once per batch, not per step
        if shared:  # step 0 reads token t+1: its rows, shifted, serve every step (model.py)
            step0 = draft.embed_projections(F.embedding(shift_rows(input_ids, 1), self.embed))
        cache = StepCache()
        anchors = torch.arange(T, device=input_ids.device)
        out = []  # a list, not a generator: simpler for torch.compile to trace
        for k in range(self.steps):
            embeds, part = None, None
            if shared:
                part = {name: shift_repeat_last(p, k) for name, p in step0.items()}
            else:
                embeds = F.embedding(shift_rows(input_ids, 1 + k), self.embed)
            if self.attention == "flex":
                logits, hidden = draft.flex_step(embeds, hidden, positions + k, cache, masks[k],
                                                 part, merged=shared)
            else:
                logits, hidden = draft.step(embeds, hidden, positions + k, cache, anchors,
                                            doc_ids, part)
            out.append(logits)
        return out

    def forward(self, input_ids, loss_mask, doc_ids, positions, aux, final, masks=None,
                topk=None, return_logits: bool = False):
        """(weighted loss, stats `[3K]`) of one packed batch; shapes `[B, T]`, aux
        `[B, T, 3Ht]`, final `[B, T, Ht]`; `topk`: the batch's stored top-k teacher (a dict,
        see eagle3/train/teacher.py), None when no file of the run stores one.
        `return_logits`: also the unroll's per-step logits (the evaluation's acceptance
        estimate reads them: one unroll, not two)."""
        B, T = input_ids.shape
        # the target's distribution over the draft vocabulary
        teacher = teacher_targets(final, self.teacher, self.compute_dtype, topk,
                                  self.topk_teacher)
        teacher_p, teacher_top = teacher.p_BTV, teacher.top_BT
        total = torch.zeros((), device=input_ids.device)
        ce_sums, hit_sums, weight_sums = [], [], []
        steps_logits = self.unroll(input_ids, doc_ids, positions, aux, masks)
        for k, logits in enumerate(steps_logits):
            n = 1 + k  # this step read token t+n and is scored against the target at t+n
            same_seq = (shift_rows(doc_ids, n, -2) == doc_ids) & (doc_ids >= 0)
            weight = (same_seq & shift_rows(loss_mask, n).bool())[:, : T - n]
            logits = logits[:, : T - n]
            V = logits.shape[-1]
            w = weight.reshape(-1).float()
            ce_sum = SoftCrossEntropy.apply(logits.reshape(-1, V), teacher_p[:, n:].reshape(-1, V),
                                            w)
            if teacher.tail_p_BT is not None:  # a stored top-k teacher's tail as one bucket
                ce_sum = ce_sum + TailBucketCE.apply(
                    logits.reshape(-1, V), teacher.tail_BTV[:, n:].reshape(-1, V),
                    teacher.tail_p_BT[:, n:].reshape(-1), w)
            w_sum = w.sum()
            total = total + (self.step_weight ** k) * ce_sum / w_sum.clamp(min=1.0)
            with torch.no_grad():
                hit = (logits.argmax(-1) == teacher_top[:, n:]) & weight
            ce_sums.append(ce_sum.detach())
            hit_sums.append(hit.sum().float())
            weight_sums.append(w_sum)
        stats = torch.stack([*ce_sums, *hit_sums, *weight_sums])
        return (total, stats, steps_logits) if return_logits else (total, stats)
