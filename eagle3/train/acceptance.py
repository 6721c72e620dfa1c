"""04's estimate of the acceptance length a draft reaches when served (chain, top-1, greedy).

Acceptance length is tokens per verify round (SGLang's figure, and 05's): a round at anchor t
(the target has processed positions <= t, token t+1 is pending) proposes `steps` draft tokens;
the target accepts the leading ones equal to its own greedy choice and adds one token of its own,
so the round commits `a + 1` tokens and the next round's anchor is `t + a + 1`. The estimate
walks these rounds over each supervised span of the eval records, in the order serving would,
and averages `a + 1` over rounds (a per-anchor mean would over-weight long accepted runs).

What counts as accepted, at anchor t and step k (the draft read token t+1+k and predicts token
t+2+k; `greedy[p]` is the target's full-vocabulary argmax of the final state at p):
- the draft's token (its draft-vocabulary argmax mapped through `d2t`) equals `greedy[t+1+k]`,
  the argmax over the target's whole lm_head — where that argmax lies outside the draft
  vocabulary, no draft token can match it: a miss, as in serving;
- position t+1+k lies in t's sequence;
- for k >= 1, the record's token t+1+k is the target's greedy token `greedy[t+k]`: teacher
  forcing fed the draft the record's token, serving would feed it the accepted draft token, and
  where the two differ the estimate cannot know what serving would do, so the round ends there.
On records that are the target's own greedy continuation every condition is what serving sees,
and the estimate equals the offline evaluator's acceptance on those prompts (tested).

Rounds: each supervised span (tokens with `loss_mask == 1`, its first token written as the
prefill would) starts a walk at the position before it; a round runs while the pending token
and the one after it are in the span, as 05 decodes while its budget has a token left. Draft
tokens past the span's end are checked where the record holds the target's states, as the
evaluator does. Beside the estimate: the loop share of the spans' text and the acceptance over
the rounds before each span's first loop (eagle3/core/loops.py), the share of supervised
tokens that are the target's greedy choice (1.0 for data the target wrote greedily) and the
share of the target's greedy choices inside the draft vocabulary.

Memory: `[T, target_vocab]` logits are never formed; the full argmax runs over `chunk_rows`
rows of the lm_head at a time (`[T, chunk_rows]` scores), and the lm_head itself stays on the
device in the compute dtype (2.35 GB in bf16 for Kimi-K2.5's 163840 x 7168), for evaluation
only: training steps never touch it.
"""

from __future__ import annotations

import torch

from eagle3.core.loops import loop_mask, rounds_before_loop

CHUNK_ROWS = 16384
# Sums kept per evaluation (one tensor, so ranks reduce it in one collective): the first
# WALKED from the rounds (walk_rounds; `samples` and the three products are per-sample moments,
# for the estimate's standard error), the rest from the target's greedy tokens.
FIELDS = ("accept_sum", "rounds", "loop_free_accept_sum", "loop_free_rounds", "loop_tokens",
          "span_tokens", "samples", "accept_sq", "rounds_sq", "accept_rounds",
          "greedy_tokens", "supervised_tokens", "greedy_in_vocab")
WALKED = 10


@torch.no_grad()
def full_argmax(final_BTH: torch.Tensor, lm_head_VH: torch.Tensor,
                chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """argmax over the whole target vocabulary of `final @ lm_head.T`, `[B, T]` int64, scoring
    `chunk_rows` vocabulary rows at a time (ties go to the lower id, as torch.argmax)."""
    x = final_BTH.to(lm_head_VH.dtype)
    best_val = best_idx = None
    for start in range(0, lm_head_VH.shape[0], chunk_rows):
        scores = (x @ lm_head_VH[start:start + chunk_rows].T).float()  # [B, T, chunk]
        val, idx = scores.max(-1)
        idx = idx + start
        if best_val is None:
            best_val, best_idx = val, idx
        else:
            better = val > best_val  # strict: an equal score keeps the lower id
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx, best_idx)
    return best_idx


def _shift(x_BT: torch.Tensor, n: int, fill) -> torch.Tensor:
    if n == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)


@torch.no_grad()
def accepted_per_anchor(draft_tokens: list[torch.Tensor], greedy_BT: torch.Tensor,
                        input_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """`[B, T]`: draft tokens a round at anchor t would have accepted (module doc).

    `draft_tokens[k]` `[B, T]` are the target ids the draft proposes at step k for every anchor.
    """
    follows = _shift(input_ids_BT, 1, -1) == greedy_BT  # record token p+1 is greedy[p]
    chain = torch.ones_like(greedy_BT, dtype=torch.bool)
    accepted = torch.zeros_like(greedy_BT)
    for k, tokens in enumerate(draft_tokens):
        n = 1 + k
        same_seq = (_shift(doc_ids_BT, n, -2) == doc_ids_BT) & (doc_ids_BT >= 0)
        hit = same_seq & (tokens == _shift(greedy_BT, n, -1))
        if k > 0:
            hit &= _shift(follows, k, False)
        chain &= hit
        accepted += chain
    return accepted


def walk_rounds(accepted_T: list[int], loss_mask_T: list[int], doc_T: list[int],
                input_ids_T: list[int]) -> dict:
    """Sums of the verify rounds of one packed row (host lists; see the module doc), with the
    per-sample moments of (accepted tokens a_i, rounds r_i) the standard error needs."""
    out = dict.fromkeys(FIELDS[:WALKED], 0)
    per_sample: dict[int, list[int]] = {}
    T = len(loss_mask_T)

    def in_span(p: int, doc: int) -> bool:
        return p < T and doc_T[p] == doc and loss_mask_T[p] == 1

    for s in range(T - 1):
        doc = doc_T[s]
        if doc < 0 or not in_span(s + 1, doc) or in_span(s, doc):
            continue  # not the position before a span's first token
        end = s + 1
        while in_span(end, doc):
            end += 1
        span = input_ids_T[s + 1:end]
        mask = loop_mask(span)
        first = next((i for i, m in enumerate(mask) if m), None)
        lengths, t = [], s
        while in_span(t + 1, doc) and in_span(t + 2, doc):
            a = accepted_T[t]
            lengths.append(a + 1)
            t += a + 1
        free = rounds_before_loop(lengths, first)
        out["accept_sum"] += sum(lengths)
        out["rounds"] += len(lengths)
        sample = per_sample.setdefault(doc, [0, 0])
        sample[0] += sum(lengths)
        sample[1] += len(lengths)
        out["loop_free_accept_sum"] += sum(free)
        out["loop_free_rounds"] += len(free)
        out["loop_tokens"] += sum(mask)
        out["span_tokens"] += len(span)
    for a, r in per_sample.values():  # a packed row holds whole samples: one doc id each
        if r:
            out["samples"] += 1
            out["accept_sq"] += a * a
            out["rounds_sq"] += r * r
            out["accept_rounds"] += a * r
    return out


class AcceptanceEstimate:
    """Accumulates the estimate over eval batches: `add(...)` per batch, `result(sums)` at the
    end (sums reduced over ranks)."""

    def __init__(self, lm_head_VH: torch.Tensor, t2d_V: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, chunk_rows: int = CHUNK_ROWS):
        self.lm_head = lm_head_VH.to(device, dtype)
        self.t2d = t2d_V.to(device)
        self.chunk_rows = chunk_rows
        self.sums = torch.zeros(len(FIELDS), dtype=torch.float64)

    @torch.no_grad()
    def add(self, draft, logits_steps: list[torch.Tensor], input_ids, loss_mask, doc_ids,
            final, target_top: torch.Tensor | None = None,
            greedy: torch.Tensor | None = None) -> torch.Tensor:
        """One packed batch: the draft's per-step logits `[B, T, Vd]` (TTTModel.unroll).

        `target_top` `[B, T]` (fp8-topk rows): the target's full-vocabulary argmax that 02b
        stored in place of the final state (-1 where a file stores the final state instead).
        Returns the target's greedy tokens `[B, T]`; an eval over the same rows again may pass
        them back as `greedy` (they depend on the data only) instead of scoring the lm_head.
        """
        if greedy is None:
            greedy = full_argmax(final, self.lm_head, self.chunk_rows)
            if target_top is not None:  # an fp8-topk position's final state is zero
                greedy = torch.where(target_top >= 0, target_top, greedy)
        tokens = [draft.draft_to_target(lg.argmax(-1)) for lg in logits_steps]
        accepted = accepted_per_anchor(tokens, greedy, input_ids, doc_ids)
        # supervised tokens p+1 (same sequence): are they greedy[p], is greedy[p] proposable?
        sup = (_shift(loss_mask, 1, 0) == 1) & (_shift(doc_ids, 1, -2) == doc_ids) & (doc_ids >= 0)
        greedy_sums = torch.stack([
            ((_shift(input_ids, 1, -1) == greedy) & sup).sum(), sup.sum(),
            (self.t2d[greedy] & sup).sum()]).double().cpu()
        rows = zip(accepted.cpu().tolist(), loss_mask.cpu().tolist(), doc_ids.cpu().tolist(),
                   input_ids.cpu().tolist())
        for acc, mask, doc, ids in rows:
            w = walk_rounds(acc, mask, doc, ids)
            self.sums[:WALKED] += torch.tensor([w[f] for f in FIELDS[:WALKED]],
                                              dtype=torch.float64)
        self.sums[WALKED:] += greedy_sums
        return greedy

    @staticmethod
    def result(sums: torch.Tensor) -> dict:
        s = dict(zip(FIELDS, sums.double().cpu().tolist()))
        return {
            "sim_accept": s["accept_sum"] / s["rounds"] if s["rounds"] else None,
            "sim_accept_se": standard_error(s),
            "sim_samples": int(s["samples"]),
            "sim_rounds": int(s["rounds"]),
            "sim_accept_loop_free": (s["loop_free_accept_sum"] / s["loop_free_rounds"]
                                     if s["loop_free_rounds"] else None),
            "loop_share": s["loop_tokens"] / s["span_tokens"] if s["span_tokens"] else 0.0,
            "greedy_share": (s["greedy_tokens"] / s["supervised_tokens"]
                             if s["supervised_tokens"] else None),
            "greedy_in_draft_vocab": (s["greedy_in_vocab"] / s["supervised_tokens"]
                                      if s["supervised_tokens"] else None),
        }


def standard_error(s: dict) -> float | None:
    """The standard error of the estimate R = sum(a_i) / sum(r_i) over n samples (a_i accepted
    tokens and r_i verify rounds of sample i): the ratio estimator's, with samples as the
    independent units (rounds within one sample are not independent),
    sqrt(n / (n - 1) * sum((a_i - R r_i)^2)) / sum(r_i), from the summed moments."""
    n, rounds = s["samples"], s["rounds"]
    if n < 2 or not rounds:
        return None
    R = s["accept_sum"] / rounds
    spread = s["accept_sq"] - 2 * R * s["accept_rounds"] + R * R * s["rounds_sq"]
    return (n / (n - 1) * max(spread, 0.0)) ** 0.5 / rounds
