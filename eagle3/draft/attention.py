"""The attention of the draft's TTT unroll (eagle3/train/ttt.py) and of serving (`StepCache`).

Step j's query at anchor t attends to step 0's keys at rows <= t of its own sequence (the draft's
KV cache after extend) and to the keys of steps 1..j at the same anchor (the tokens it drafted
itself). Two implementations compute that softmax:
- `naive`: materialised scores (any device; the reference, and serving through `StepCache`);
- `flex`: `torch.nn.attention.flex_attention`, on CUDA compiled (no score matrix in memory), in
  one of two forms: over step 0's keys with the batch's causal block mask, the later steps' own
  keys (one per query, at its row) merged in by log-sum-exp (`merged_flex_attention`, the
  shared unroll's); or over the keys of all steps so far concatenated, with a block mask that
  adds one diagonal block per later step (`flex_ttt_attention`, the per-step unroll's). Both
  masks come from `TTTMasks`, built once per batch.

Shapes: B batch, T positions, h heads, hkv kv heads, d head dim, S steps so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FLEX_BLOCK = 128  # flex attention block size; packed rows are padded to a multiple of it


@dataclass
class StepCache:
    """Keys/values of step 0 (all positions) and of later steps (one row per query)."""

    k0: torch.Tensor | None = None  # [B, hkv, T0, d]
    v0: torch.Tensor | None = None
    ks: list = field(default_factory=list)  # per step >= 1: [B, hkv, Tq, d]
    vs: list = field(default_factory=list)


def naive_ttt_attention(q_BhTd, cache: StepCache, anchors_T, doc_BT=None) -> torch.Tensor:
    """Softmax over [step-0 keys at rows <= anchor, same sequence] + [each later step's key at
    the anchor], with materialised scores. `doc_BT` (packed rows): sequence id per row."""
    groups = q_BhTd.shape[1] // cache.k0.shape[1]
    scale = 1.0 / math.sqrt(q_BhTd.shape[-1])
    k0 = cache.k0.repeat_interleave(groups, dim=1)
    v0 = cache.v0.repeat_interleave(groups, dim=1)
    scores_ctx = torch.matmul(q_BhTd, k0.transpose(-1, -2)).float() * scale  # [B, h, Tq, T0]
    key_rows = torch.arange(k0.shape[-2], device=q_BhTd.device)
    visible = (key_rows[None, :] <= anchors_T[:, None])[None]  # [1, Tq, T0]
    if doc_BT is not None:
        visible = visible & (doc_BT[:, anchors_T][:, :, None] == doc_BT[:, None, :])
    scores_ctx = scores_ctx.masked_fill(~visible[:, None], float("-inf"))
    if not cache.ks:
        probs = torch.softmax(scores_ctx, dim=-1).to(q_BhTd.dtype)
        return torch.matmul(probs, v0)
    ks = torch.stack([k.repeat_interleave(groups, dim=1) for k in cache.ks], dim=-2)  # [B,h,Tq,S,d]
    vs = torch.stack([v.repeat_interleave(groups, dim=1) for v in cache.vs], dim=-2)
    scores_diag = (q_BhTd.unsqueeze(-2) * ks).sum(-1).float() * scale  # [B, h, Tq, S]
    probs = torch.softmax(torch.cat([scores_ctx, scores_diag], dim=-1), dim=-1).to(q_BhTd.dtype)
    T0 = k0.shape[-2]
    out = torch.matmul(probs[..., :T0], v0)
    return out + (probs[..., T0:, None] * vs).sum(-2)


class TTTMasks:
    """Flex-attention block masks of one packed batch, one per TTT step.

    Step s sees keys [step 0 | step 1 | ... | step s], each segment T rows long. Step 0's block
    mask (causal within a sequence) is built once with `create_block_mask`; step s adds one
    partial block per query block and later segment (the diagonal), so no mask is evaluated
    over the whole `T x (s+1)T` grid. T must be a multiple of FLEX_BLOCK.
    """

    def __init__(self, doc_BT: torch.Tensor, compile_mask: bool = False):
        from torch.nn.attention.flex_attention import create_block_mask

        B, T = doc_BT.shape
        if T % FLEX_BLOCK:
            raise ValueError(f"flex attention needs rows padded to a multiple of {FLEX_BLOCK}, "
                             f"got {T}")
        self.T, self.doc = T, doc_BT
        self._masks: dict[int, object] = {}
        self._base = create_block_mask(self._mask_mod(0), B, None, T, T, device=doc_BT.device,
                                       BLOCK_SIZE=FLEX_BLOCK, _compile=compile_mask)

    def _mask_mod(self, steps: int):
        doc, T = self.doc, self.T

        def mask_mod(b, h, q_idx, kv_idx):
            segment = kv_idx // T
            row = kv_idx - segment * T
            context = (row <= q_idx) & (doc[b, row] == doc[b, q_idx])
            return torch.where(segment == 0, context, row == q_idx)

        return mask_mod

    def for_step(self, s: int):
        """The block mask of step s (queries T, keys (s+1)T)."""
        if s == 0:
            return self._base
        if s not in self._masks:
            self._masks[s] = self._extend(s)
        return self._masks[s]

    def all_steps(self, steps: int) -> list:
        """The block masks of steps 0..steps-1."""
        return [self.for_step(s) for s in range(steps)]

    def _extend(self, s: int):
        from torch.nn.attention.flex_attention import BlockMask

        base, nb = self._base, self.T // FLEX_BLOCK
        B, Hm, Qb, _ = base.kv_indices.shape
        dev = base.kv_indices.device
        width = (s + 1) * nb
        kv_indices = torch.zeros(B, Hm, Qb, width, dtype=torch.int32, device=dev)
        kv_indices[..., :nb] = base.kv_indices[..., :nb]
        # the diagonal block of query block qb in segment j is key block j * nb + qb
        slots = base.kv_num_blocks[..., None].long() + torch.arange(s, device=dev)
        diag = (torch.arange(1, s + 1, device=dev) * nb + torch.arange(Qb, device=dev)[:, None])
        kv_indices.scatter_(-1, slots, diag.to(torch.int32).expand(B, Hm, Qb, s).contiguous())
        full_indices = torch.zeros_like(kv_indices)
        full_indices[..., :nb] = base.full_kv_indices[..., :nb]
        return BlockMask.from_kv_blocks(
            base.kv_num_blocks + s, kv_indices, base.full_kv_num_blocks, full_indices,
            BLOCK_SIZE=FLEX_BLOCK, mask_mod=self._mask_mod(s),
            seq_lengths=(self.T, width * FLEX_BLOCK))


_compiled_flex = None
FLEX_RECOMPILE_LIMIT = 64  # >= 2 x ttt_steps x (distinct row widths); see flex_ttt_attention


def _flex(q_BhTd, k, v, block_mask, lse: bool = False):
    """flex_attention (compiled when called eagerly on CUDA); with `lse`, (out, logsumexp
    `[B, h, T]` float32, natural log) and the gradient flows through both."""
    global _compiled_flex
    from torch.nn.attention import flex_attention as fa

    fn = fa.flex_attention  # inside a torch.compile'd forward, traced into its graph as is
    if q_BhTd.is_cuda and not torch.compiler.is_compiling():
        # eager flex is a reference (materialised scores); compiled, it is the fused kernel
        if _compiled_flex is None:
            _compiled_flex = torch.compile(fa.flex_attention, dynamic=False)
        fn = _compiled_flex
    kwargs = dict(block_mask=block_mask, scale=1.0 / math.sqrt(q_BhTd.shape[-1]),
                  enable_gqa=q_BhTd.shape[1] != k.shape[1])
    if lse:
        kwargs["return_aux"] = fa.AuxRequest(lse=True)
    if fn is not _compiled_flex:  # traced into an outer compiled graph, or the CPU reference
        out = fn(q_BhTd, k, v, **kwargs)
    else:
        # Each distinct key length and grad mode is a compiled graph of its own (per-step
        # unroll: about 2 x ttt_steps per row width). Past dynamo's default recompile limit (8)
        # the call silently falls back to eager flex, which materialises the scores: the
        # reference run trained a 512-wide draft at ~1 s/step that way.
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
            out = fn(q_BhTd, k, v, **kwargs)
    return (out[0], out[1].lse) if lse else out


def flex_ttt_attention(q_BhTd, cache: StepCache, block_mask) -> torch.Tensor:
    """Attention of TTT step len(cache.ks) over the keys of all steps so far, concatenated;
    `block_mask` is `TTTMasks.for_step(len(cache.ks))` (the per-step unroll)."""
    k = torch.cat([cache.k0, *cache.ks], dim=2) if cache.ks else cache.k0
    v = torch.cat([cache.v0, *cache.vs], dim=2) if cache.vs else cache.v0
    return _flex(q_BhTd, k, v, block_mask)


def merged_flex_attention(q_BhTd, cache: StepCache, block_mask) -> torch.Tensor:
    """The same softmax as flex_ttt_attention, computed as: flex over step 0's keys alone
    (`block_mask` = `TTTMasks.for_step(0)`, every step the same), then the keys of steps
    1..S at the query's own row merged in by log-sum-exp, in float32:

        out = (e^lse0 * out0 + sum_j e^s_j * v_j) / (e^lse0 + sum_j e^s_j),  s_j = q.k_j / sqrt(d)

    No keys are concatenated and no diagonal mask blocks are computed (the shared unroll)."""
    out0, lse0 = _flex(q_BhTd, cache.k0, cache.v0, block_mask, lse=True)
    if not cache.ks:
        return out0
    B, h, T, d = q_BhTd.shape
    hkv = cache.k0.shape[1]
    g = h // hkv  # query heads per kv head (GQA): kv heads broadcast over a view, no copies
    q = q_BhTd.view(B, hkv, g, T, d).float()
    scores = torch.stack([(q * k[:, :, None].float()).sum(-1) for k in cache.ks], dim=-1)
    scores = scores / math.sqrt(d)  # [B, hkv, g, T, S]
    lse0 = lse0.view(B, hkv, g, T)
    top = torch.maximum(lse0, scores.amax(-1))  # the largest term, for a stable exp
    w0, w = torch.exp(lse0 - top), torch.exp(scores - top[..., None])
    dv = out0.shape[-1]  # the value width (MLA: not the query's)
    num = w0[..., None] * out0.view(B, hkv, g, T, dv).float()
    for j, v in enumerate(cache.vs):
        num = num + w[..., j, None] * v[:, :, None].float()
    out = num / (w0 + w.sum(-1))[..., None]
    return out.view(B, h, T, dv).to(q_BhTd.dtype)


def store(cache: StepCache, k, v) -> None:
    """A step's keys/values into the cache: step 0's (the extend) first, then one per step."""
    if cache.k0 is None:
        cache.k0, cache.v0 = k, v
    else:
        cache.ks.append(k)
        cache.vs.append(v)
