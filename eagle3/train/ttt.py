"""Training-time test (TTT): the k-step unroll of the draft over a packed batch, and its loss.

A packed batch row holds several sequences back to back (`doc_ids`: sequence index per row, -1
for padding; `positions`: position inside the sequence). At anchor t, step k (k = 0..K-1) the
draft reads token t+1+k and, as hidden, fc(aux_t) for k = 0 or its own step k-1 output; its
prediction is compared (soft cross-entropy) with the target's distribution at position t+1+k,
`softmax(lm_head_hot @ final_{t+1+k})` over the draft vocabulary. The stored final state is
post-norm: no second norm here. The term's weight is `loss_mask[t+1+k]` — the mask moves with
the targets, so the last prompt position (the first the draft serves) is trained — and 0 when
t+1+k lies outside t's sequence. Step k's mean loss is scaled by `step_weight ** k`.

Metrics stay on the device (no host sync per micro-step): per step the summed CE, the number of
anchors whose argmax equals the target's argmax, and the summed weight; plus the simulated
acceptance: for each anchor with a step-0 target, 1 + the number of leading steps that hit
(what greedy chain verification would accept when the draft reads the true prefix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.draft.model import Eagle3Draft, StepCache, TTTMasks
from eagle3.train.head_loss import head_soft_ce_loss

ATTENTION = ("naive", "flex")


def shift_rows(x_BT: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """x[:, n:] followed by n `fill` rows (dim 1 keeps its length)."""
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)


def num_stats(steps: int) -> int:
    return 3 * steps + 2


def stats_dict(stats: torch.Tensor, steps: int) -> dict:
    """Per-step mean loss and accuracy, and simulated acceptance, from summed stats (host)."""
    s = stats.double().cpu().tolist()
    ce, hits, weight = s[0:steps], s[steps:2 * steps], s[2 * steps:3 * steps]
    accept_sum, anchors = s[3 * steps], s[3 * steps + 1]
    return {"loss_steps": [c / max(w, 1.0) for c, w in zip(ce, weight)],
            "acc": [h / max(w, 1.0) for h, w in zip(hits, weight)],
            "sim_accept": accept_sum / max(anchors, 1.0),
            "supervised": weight[0]}


class TTTModel(nn.Module):
    """The draft plus the frozen target tensors; `forward(batch)` = (loss, stats).

    `embed` `[target_vocab, H]` and `teacher` (target lm_head rows of the draft vocabulary,
    `[draft_vocab, Ht]`) are non-persistent buffers: they follow `.to(device)`, are never saved
    and never trained. `compute_dtype` is the dtype activations are fed in (bf16 under autocast).
    """

    def __init__(self, draft: Eagle3Draft, embed_VH: torch.Tensor, teacher_VdH: torch.Tensor,
                 steps: int, step_weight: float, attention: str = "naive",
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: expected one of {ATTENTION}")
        self.draft = draft
        self.register_buffer("embed", embed_VH.to(compute_dtype), persistent=False)
        self.register_buffer("teacher", teacher_VdH.to(compute_dtype), persistent=False)
        self.steps, self.step_weight, self.attention = steps, step_weight, attention
        self.compute_dtype = compute_dtype

    def build_masks(self, doc_ids_BT: torch.Tensor, compile_mask: bool = False) -> list | None:
        """Flex block masks of every step (None for the naive attention); build outside
        compiled regions and pass to `forward`."""
        if self.attention != "flex":
            return None
        return TTTMasks(doc_ids_BT, compile_mask).all_steps(self.steps)

    def unroll(self, input_ids, doc_ids, positions, aux, masks=None) -> list:
        """The draft logits `[B, T, V]` of steps 0..K-1 (row t = anchor t; rows whose token
        t+1+k lies outside the sequence are garbage that no valid row ever attends to)."""
        return [self.draft.lm_head(x) for x in self.unroll_normed(input_ids, doc_ids, positions,
                                                                   aux, masks)]

    def unroll_normed(self, input_ids, doc_ids, positions, aux, masks=None) -> list:
        """The layer's normed output `[B, T, H]` of steps 0..K-1 (the lm_head's input)."""
        T = input_ids.shape[1]
        hidden = self.draft.fc(aux.to(self.compute_dtype))  # once per batch, not per step
        keys, values, cache = [], [], StepCache()
        anchors = torch.arange(T, device=input_ids.device)
        out = []  # a list, not a generator: simpler for torch.compile to trace
        for k in range(self.steps):
            embeds = F.embedding(shift_rows(input_ids, 1 + k), self.embed)
            if self.attention == "flex":
                normed, hidden = self.draft.flex_layer(embeds, hidden, positions + k, keys,
                                                       values, masks[k])
            else:
                normed, hidden = self.draft.step_layer(embeds, hidden, positions + k, cache,
                                                       anchors, doc_ids)
            out.append(normed)
        return out

    def forward(self, input_ids, loss_mask, doc_ids, positions, aux, final, masks=None):
        """(weighted loss, stats `[3K+2]`) of one packed batch; shapes `[B, T]`, aux
        `[B, T, 3Ht]`, final `[B, T, Ht]`."""
        B, T = input_ids.shape
        with torch.no_grad():  # the target's distribution over the draft vocabulary
            teacher_logits = final.to(self.compute_dtype) @ self.teacher.T
            teacher_p = torch.softmax(teacher_logits.float(), dim=-1)  # [B, T, V]
            teacher_top = teacher_p.argmax(-1)
        weight_KBT, scale_K = self.step_weights(loss_mask, doc_ids)
        normed_KBTH = torch.stack(self.unroll_normed(input_ids, doc_ids, positions, aux, masks))
        head_VH = self.draft.lm_head.weight.to(self.compute_dtype)
        total, ce_K, top_KBT = head_soft_ce_loss(normed_KBTH, head_VH, teacher_p, weight_KBT,
                                                 scale_K)
        hit_sums, weight_sums = [], []
        chain = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        accept = torch.zeros((), device=input_ids.device)
        with torch.no_grad():
            for k in range(self.steps):
                n = 1 + k  # this step read token t+n and is scored against the target at t+n
                weight = weight_KBT[k, :, : T - n].bool()
                w_sum = weight_KBT[k].sum()
                hit = (top_KBT[k, :, : T - n] == teacher_top[:, n:]) & weight
                chain = torch.cat([chain[:, : T - n] & hit, torch.zeros_like(chain[:, T - n:])], 1)
                if k == 0:
                    accept = accept + w_sum  # every anchor with a step-0 target counts 1
                accept = accept + chain.sum()
                hit_sums.append(hit.sum().float())
                weight_sums.append(w_sum)
        stats = torch.stack([*ce_K.unbind(), *hit_sums, *weight_sums, accept, weight_sums[0]])
        return total, stats

    def step_weights(self, loss_mask, doc_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight `[K, B, T]` of anchor t at step k: `loss_mask[t+1+k]` when t+1+k is in t's
        sequence, else 0; scale `[K]`: `step_weight**k / max(sum of step k's weights, 1)`, the
        factor of step k's summed CE in the loss)."""
        weights = []
        for k in range(self.steps):
            n = 1 + k
            same_seq = (shift_rows(doc_ids, n, -2) == doc_ids) & (doc_ids >= 0)
            weights.append((same_seq & shift_rows(loss_mask, n).bool()).float())
        weight_KBT = torch.stack(weights)
        powers = torch.tensor([self.step_weight ** k for k in range(self.steps)],
                              device=loss_mask.device)
        return weight_KBT, powers / weight_KBT.sum((1, 2)).clamp(min=1.0)
