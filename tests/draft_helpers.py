"""Helpers of the draft tests: packed rows and a differentiable CPU stand-in for flex attention."""

from __future__ import annotations

import torch

from eagle3.draft.model import FLEX_BLOCK


def packed_row(seqs: list[list[int]], width: int):
    """A packed row of `seqs`: ids, doc ids (-1 = padding), positions, all [1, width]."""
    ids, doc, pos = [], [], []
    for j, s in enumerate(seqs):
        ids += s
        doc += [j] * len(s)
        pos += list(range(len(s)))
    pad = width - len(ids)
    return (torch.tensor([ids + [0] * pad]), torch.tensor([doc + [-1] * pad], dtype=torch.int32),
            torch.tensor([pos + [0] * pad]))


def masked_math_flex(q, k, v, block_mask=None, scale=None, enable_gqa=False):
    """flex_attention's semantics, differentiable on CPU: a key is visible only if its block is
    listed in the block mask (partial or full) and, in a partial block, the mask_mod allows it."""
    T, S = q.shape[2], k.shape[2]
    qi, ki = torch.arange(T)[:, None], torch.arange(S)[None, :]
    blocks = block_mask.to_dense()[0, 0].bool()  # [Qb, Kb]: listed blocks
    listed = blocks.repeat_interleave(FLEX_BLOCK, 0).repeat_interleave(FLEX_BLOCK, 1)
    full = torch.zeros_like(blocks)
    for qb in range(blocks.shape[0]):
        n = int(block_mask.full_kv_num_blocks[0, 0, qb])
        full[qb, block_mask.full_kv_indices[0, 0, qb, :n].long()] = True
    full = full.repeat_interleave(FLEX_BLOCK, 0).repeat_interleave(FLEX_BLOCK, 1)
    allowed = listed & (full | block_mask.mask_mod(torch.tensor(0), torch.tensor(0), qi, ki))
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
