"""The draft computes what SGLang's EAGLE-3 draft computes when serving, in training and serving.

The reference below is written independently of eagle3.draft.model: float64, one token at a
time, an explicit list of (key, value) per position — SGLang's serving sequence: a draft extend
over the prefix (row i reads token i+1 and fc(aux_i) at position i, attending to rows <= i), then
decode steps that read one token at the next position with the previous step's pre-norm hidden,
appending their key/value to the cache. The training unroll must give, at every anchor and step,
the logits this serving sequence gives at that anchor.
"""

from __future__ import annotations

import math

import pytest
import torch
from draft_helpers import (
    ChainReference,
    assert_unroll_matches,
    llama_draft,
    masked_math_flex,
    packed_row,
)

from eagle3.draft.attention import FLEX_BLOCK, StepCache, TTTMasks
from eagle3.draft.model import Eagle3Draft
from eagle3.train.ttt import SoftCrossEntropy, TTTModel

H, HEADS, KV_HEADS, D, INTER, VT, VD, K = 32, 4, 2, 8, 48, 60, 24, 4


def _draft(seed: int = 0, fc_norm: bool = False, norm_output: bool = False) -> Eagle3Draft:
    return llama_draft(seed, fc_norm, norm_output, rope_theta=500.0)


# ---------------------------------------------------------------- the independent reference


class Reference(ChainReference):
    """SGLang's draft computation, float64, token by token, with an explicit KV list."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor):
        self.w = {k: v.double() for k, v in draft.state_dict().items()}
        self.embed = embed.double()
        self.eps, self.theta = draft.cfg.rms_norm_eps, draft.cfg.rope_theta
        self.fc_norm, self.norm_output = draft.cfg.fc_norm, draft.cfg.norm_output

    def rms(self, x, name):
        return x / torch.sqrt((x * x).mean() + self.eps) * self.w[name]

    def rope(self, x_hd, pos):
        half = D // 2
        inv = torch.tensor([self.theta ** (-2 * i / D) for i in range(half)], dtype=torch.float64)
        cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
        x1, x2 = x_hd[:, :half], x_hd[:, half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def token(self, token_id: int, hidden, pos: int, kv: list):
        """One draft forward of one token: (logits [VD], pre-norm hidden [H]); appends to kv."""
        w = self.w
        x = torch.cat([self.rms(self.embed[token_id], "midlayer.input_layernorm.weight"),
                       self.rms(hidden, "midlayer.hidden_norm.weight")])
        q = self.rope((w["midlayer.self_attn.q_proj.weight"] @ x).view(HEADS, D), pos)
        k = self.rope((w["midlayer.self_attn.k_proj.weight"] @ x).view(KV_HEADS, D), pos)
        v = (w["midlayer.self_attn.v_proj.weight"] @ x).view(KV_HEADS, D)
        kv.append((k, v))
        heads = []
        for i in range(HEADS):
            g = i // (HEADS // KV_HEADS)
            scores = torch.stack([q[i] @ kj[g] for kj, _ in kv]) / math.sqrt(D)
            p = torch.softmax(scores, dim=0)
            heads.append(sum(pj * vj[g] for pj, (_, vj) in zip(p, kv)))
        residual = w["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads) + hidden
        n = self.rms(residual, "midlayer.post_attention_layernorm.weight")
        gate = w["midlayer.mlp.gate_proj.weight"] @ n
        mlp = w["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate)
                                                     * (w["midlayer.mlp.up_proj.weight"] @ n))
        out = mlp + residual
        normed = self.rms(out, "norm.weight")
        # EAGLE-3.1 norm_output: the next step reads the normed state (llama_eagle3.py `aux`)
        return w["lm_head.weight"] @ normed, (normed if self.norm_output else out)

    def extend(self, ids: list[int], aux):
        """Draft extend over rows 0..len(ids)-2: per-row (logits, hidden) and the KV list."""
        kv, rows = [], []
        for i in range(len(ids) - 1):
            x = aux[i].double()
            if self.fc_norm:  # EAGLE-3.1: each aux state RMS-normed by fc_norm.{j} before fc
                x = torch.cat([self.rms(c, f"fc_norm.{j}.weight") for j, c in
                               enumerate(x.chunk(3))])
            h = self.w["fc.weight"] @ x
            rows.append(self.token(ids[i + 1], h, i, kv))
        return rows, kv


@pytest.mark.parametrize("attention,options,unroll", [
    ("naive", False, "shared"), ("flex", False, "shared"), ("naive", True, "shared"),
    ("naive", False, "per-step"), ("flex", False, "per-step")])
def test_training_unroll_matches_serving_reference_when_sequences_are_packed(attention, options,
                                                                             unroll):
    torch.manual_seed(1)
    draft = _draft(fc_norm=options, norm_output=options)
    embed = torch.randn(VT, H)
    seqs = [torch.randint(0, VT, (n,)).tolist() for n in (13, 9)]
    width = FLEX_BLOCK if attention == "flex" else 26
    ids, doc, pos = packed_row(seqs, width)
    aux = torch.randn(1, width, 3 * H)
    model = TTTModel(draft, embed, torch.randn(VD, H), K, 0.8, attention, unroll=unroll)
    with torch.no_grad():
        logits = list(model.unroll(ids, doc, pos, aux, model.build_masks(doc)))
    assert_unroll_matches(Reference(draft, embed), logits, seqs, aux, K)


def test_serving_steps_match_reference_when_one_anchor_drafts_a_chain():
    from eagle3.bench.evaluate import Eagle3Proposer

    torch.manual_seed(2)
    draft = _draft(3).eval()
    embed = torch.randn(VT, H)
    ids = torch.randint(0, VT, (10,)).tolist()
    aux = torch.randn(9, 3 * H)  # target states of ids[0..8]; ids[9] is the pending token
    ref = Reference(draft, embed)
    rows, kv = ref.extend(ids, aux)
    hot = draft.d2t.clone()
    to_target = lambda logits: int(logits.argmax()) + int(hot[int(logits.argmax())])  # noqa: E731
    expected = [to_target(lg) for lg in ref.decode(ids, rows, kv, 8, 5,
                                                   feed=lambda k, lg: to_target(lg))]
    assert Eagle3Proposer(draft, embed).propose(ids, aux, 5) == expected
    # the same chain through the step API, logits compared to float tolerance
    cache, n = StepCache(), 9
    with torch.no_grad():
        logits, hidden = draft.step(embed[ids[1:]][None], draft.fc(aux[None]),
                                    torch.arange(n)[None], cache)
        chain = [logits[0, -1]]
        hidden = hidden[:, -1:]
        for k in range(1, 5):
            tok = torch.tensor([[to_target(chain[-1])]])
            logits, hidden = draft.step(embed[tok], hidden, torch.tensor([[n - 1 + k]]), cache,
                                        anchors_T=torch.tensor([n - 1]))
            chain.append(logits[0, -1])
    ref_chain = ref.decode(ids, rows, kv, 8, 5, feed=lambda k, lg: to_target(lg))
    for got, exp in zip(chain, ref_chain):
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-4)


def test_flex_block_masks_match_dense_mask_when_sequences_are_packed():
    from torch.nn.attention.flex_attention import create_block_mask

    T = 3 * FLEX_BLOCK
    doc = torch.tensor([[0] * 100 + [1] * 200 + [2] * 50 + [-1] * 34], dtype=torch.int32)
    masks = TTTMasks(doc)
    for s in range(4):
        def dense_rule(b, h, q, kv, s=s):
            seg, row = kv // T, kv % T
            ctx = (row <= q) & (doc[b, row] == doc[b, q])
            return torch.where(seg == 0, ctx, row == q)

        ref = create_block_mask(dense_rule, 1, None, T, (s + 1) * T, device="cpu",
                                BLOCK_SIZE=FLEX_BLOCK)
        got = masks.for_step(s)
        assert torch.equal(got.to_dense(), ref.to_dense()), s
        assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks), s
        assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks), s


def test_unrolls_and_attentions_give_equal_loss_and_gradients(monkeypatch):
    # flex_attention has no CPU backward: its documented semantics (block sparsity + mask_mod,
    # the log-sum-exp on request) stand in for the kernel, so everything around it (the shared
    # embedding half, the log-sum-exp merge and its gradient, concatenated keys, the block
    # masks, GQA, positions) is checked with gradients; the kernel itself runs on the GPU.
    # Reference: the naive attention with the per-step unroll (the layer as served, per step).
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "flex_attention", masked_math_flex)
    torch.manual_seed(4)
    embed, teacher = torch.randn(VT, H), torch.randn(VD, H)
    ids, doc, pos = packed_row([torch.randint(0, VT, (n,)).tolist() for n in (70, 40)],
                               FLEX_BLOCK)
    mask = (torch.rand(1, FLEX_BLOCK) < 0.7).long()
    aux, final = torch.randn(1, FLEX_BLOCK, 3 * H), torch.randn(1, FLEX_BLOCK, H)
    grads, results = [], []
    runs = [("naive", "per-step"), ("naive", "shared"), ("flex", "per-step"), ("flex", "shared")]
    for attention, unroll in runs:
        model = TTTModel(_draft(5), embed, teacher, K, 0.8, attention, unroll=unroll)
        loss, stats = model(ids, mask, doc, pos, aux, final, model.build_masks(doc))
        loss.backward()
        results.append((loss.detach(), stats))
        grads.append({n: p.grad for n, p in model.draft.named_parameters()})
    for run, result, grad in zip(runs[1:], results[1:], grads[1:]):
        torch.testing.assert_close(result[0], results[0][0], rtol=1e-5, atol=1e-6, msg=run)
        torch.testing.assert_close(result[1], results[0][1], rtol=1e-5, atol=1e-5, msg=run)
        for name in grads[0]:
            assert grad[name] is not None and grad[name].abs().sum() > 0, (run, name)
            torch.testing.assert_close(grad[name], grads[0][name], rtol=1e-4, atol=1e-6,
                                       msg=f"{run} {name}")


def test_soft_cross_entropy_matches_autograd_reference():
    torch.manual_seed(6)
    logits = torch.randn(7, 11, requires_grad=True)
    target = torch.softmax(torch.randn(7, 11), -1)
    w = torch.tensor([1.0, 0, 1, 1, 0, 1, 1])
    SoftCrossEntropy.apply(logits, target, w).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = (-(target * torch.log_softmax(logits, -1)).sum(-1) * w).sum()
    ref.backward()
    torch.testing.assert_close(ours, logits.grad)
    torch.testing.assert_close(SoftCrossEntropy.apply(logits, target, w), ref)
