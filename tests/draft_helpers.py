"""Helpers of the draft tests: packed rows and a differentiable CPU stand-in for flex attention."""

from __future__ import annotations

import torch

from eagle3.draft.attention import FLEX_BLOCK
from eagle3.draft.mla import Eagle3MLADraft
from eagle3.draft.model import DraftConfig, Eagle3Draft

# A small MLA draft; the MLA sizes are deliberately unequal, so a mixed-up split fails.
H, HEADS, INTER, VT, VD = 32, 4, 48, 60, 24
QL, KVL, NOPE, ROPE, V = 20, 12, 8, 6, 10


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


def masked_math_flex(q, k, v, block_mask=None, scale=None, enable_gqa=False, return_aux=None):
    """flex_attention's semantics, differentiable on CPU: a key is visible only if its block is
    listed in the block mask (partial or full) and, in a partial block, the mask_mod allows it.
    With `return_aux` (AuxRequest(lse=True)): (out, AuxOutput with the natural-log lse)."""
    from torch.nn.attention.flex_attention import AuxOutput

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
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    if return_aux is None:
        return out
    return out, AuxOutput(lse=torch.logsumexp(scores, -1), max_scores=None)


def _randomise(draft, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
        draft.d2t.copy_(torch.randint(0, VT - VD, (VD,)))
    return draft


def mla_draft(seed: int = 0, fc_norm: bool = False, norm_output: bool = False) -> Eagle3MLADraft:
    """The small MLA draft with random weights (norm weights near 1) and a random d2t."""
    cfg = DraftConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      head_dim=NOPE + ROPE, intermediate_size=INTER, vocab_size=VT,
                      draft_vocab_size=VD, target_hidden_size=H, rope_theta=500.0,
                      capture_layers=[2, 4, 5], fc_norm=fc_norm, norm_output=norm_output,
                      arch="mla", q_lora_rank=QL, kv_lora_rank=KVL, qk_nope_head_dim=NOPE,
                      qk_rope_head_dim=ROPE, v_head_dim=V)
    return _randomise(Eagle3MLADraft(cfg), seed)


def llama_draft(seed: int = 0, fc_norm: bool = False, norm_output: bool = False,
                rope_theta: float = 10000.0) -> Eagle3Draft:
    """A small Llama-style draft of the same widths (GQA: 4 heads, 2 kv heads of 8), random
    weights and d2t."""
    cfg = DraftConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2,
                      head_dim=8, intermediate_size=INTER, vocab_size=VT, draft_vocab_size=VD,
                      target_hidden_size=H, capture_layers=[2, 4, 5], fc_norm=fc_norm,
                      norm_output=norm_output, rope_theta=rope_theta)
    return _randomise(Eagle3Draft(cfg), seed)


class ChainReference:
    """Base of the tests' float64 serving references: `extend(ids, aux)` -> (rows, cache) and
    `token(id, hidden, pos, cache)` -> (logits, next hidden) come from the subclass."""

    def decode(self, ids: list[int], rows, cache, anchor: int, steps: int, feed=None):
        """Logits of steps 0..steps-1 at `anchor`: decode steps on a copy of the cache holding
        rows 0..anchor. `feed(k, logits)` picks step k's input token (default: ids[anchor+1+k])."""
        cache = list(cache[: anchor + 1])
        logits, hidden = rows[anchor]
        out = [logits]
        for k in range(1, steps):
            token = ids[anchor + 1 + k] if feed is None else feed(k, out[-1])
            logits, hidden = self.token(token, hidden, anchor + k, cache)
            out.append(logits)
        return out


def assert_unroll_matches(ref: ChainReference, logits: list, seqs: list[list[int]], aux,
                          steps: int) -> None:
    """Every training-unroll logit `logits[k][0, row]` of the packed `seqs` equals the
    reference's step k at that anchor (step k needs token t+1+k inside its sequence)."""
    start, compared = 0, 0
    for s in seqs:
        rows, cache = ref.extend(s, aux[0, start:start + len(s)])
        for t in range(len(s) - 1):
            for k, expected in enumerate(ref.decode(s, rows, cache, t,
                                                    min(steps, len(s) - 1 - t))):
                torch.testing.assert_close(logits[k][0, start + t].double(), expected,
                                           rtol=1e-4, atol=1e-4)
                compared += 1
        start += len(s)
    assert compared == sum(sum(min(steps, n - 1 - t) for t in range(n - 1))
                           for n in map(len, seqs))
