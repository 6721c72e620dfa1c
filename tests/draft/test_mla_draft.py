"""The MLA draft computes what SGLang's `Eagle3DeepseekV2ForCausalLM` computes when serving.

The reference is written from sglang/srt/models/kimi_k25_eagle3.py and the MLA it builds on
(deepseek_v2.py `DeepseekV2AttentionMLA`, forward_mla.py `forward_absorb_prepare`), independently
of eagle3.draft.mla: float64, one token at a time, in SGLang's serving ("absorbed") form: the cache
holds the normed latent `c = kv_a_layernorm(kv_a[:kv_lora])` and the roped shared `k_pe` per
position; `kv_b_proj` is split into `w_kc` / `w_vc` (post_load_weights) and folded into the query
and the output; RoPE rotates interleaved pairs as complex numbers. The training unroll (packed
rows, every TTT step) and the serving proposer (one anchor) must give the logits it gives.
"""

from __future__ import annotations

import math

import pytest
import torch
from draft_helpers import (
    HEADS,
    KVL,
    NOPE,
    ROPE,
    VD,
    VT,
    ChainReference,
    H,
    V,
    assert_unroll_matches,
    masked_math_flex,
    mla_draft,
    packed_row,
)

from eagle3.draft.attention import FLEX_BLOCK
from eagle3.draft.mla import mla_draft_config, read_mla_dims
from eagle3.draft.model import DraftConfig
from eagle3.train.ttt import TTTModel

K = 4

class SGLangMLAReference(ChainReference):
    """kimi_k25_eagle3.py's draft, float64, token by token, absorbed MLA with a latent cache."""

    def __init__(self, draft, embed):
        self.w = {k: v.double() for k, v in draft.state_dict().items()}
        self.embed = embed.double()
        cfg = draft.cfg
        self.eps, self.theta = cfg.rms_norm_eps, cfg.rope_theta
        self.fc_norm, self.norm_output = cfg.fc_norm, cfg.norm_output
        # post_load_weights: kv_b_proj.unflatten(0, (-1, nope + v)).split([nope, v], dim=1)
        kv_b = self.w["midlayer.self_attn.kv_b_proj.weight"].unflatten(0, (HEADS, NOPE + V))
        self.w_kc, self.w_vc = kv_b[:, :NOPE], kv_b[:, NOPE:]  # [h, nope, kvl], [h, v, kvl]

    def rms(self, x, name):
        return x / torch.sqrt((x * x).mean() + self.eps) * self.w[name]

    def rope(self, x_r, pos):
        """Interleaved pairs (x[2i], x[2i+1]) as complex numbers times e^{i pos theta^(-2i/r)}."""
        freq = torch.tensor([self.theta ** (-2 * i / ROPE) for i in range(ROPE // 2)],
                            dtype=torch.float64)
        z = torch.view_as_complex(x_r.reshape(-1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(freq), pos * freq)).flatten()

    def token(self, token_id: int, hidden, pos: int, cache: list):
        """One draft forward of one token: (logits [VD], next hidden [H]); appends (c, k_pe)."""
        w, a = self.w, "midlayer.self_attn."
        x = torch.cat([self.rms(self.embed[token_id], "midlayer.input_layernorm.weight"),
                       self.rms(hidden, "midlayer.hidden_norm.weight")])
        q = w[a + "q_b_proj.weight"] @ self.rms(w[a + "q_a_proj.weight"] @ x,
                                                a + "q_a_layernorm.weight")
        latent = w[a + "kv_a_proj_with_mqa.weight"] @ x  # [kv_lora | rope]
        cache.append((self.rms(latent[:KVL], a + "kv_a_layernorm.weight"),
                      self.rope(latent[KVL:], pos)))
        heads = []
        for i in range(HEADS):
            qi = q.view(HEADS, NOPE + ROPE)[i]
            q_abs = self.w_kc[i].T @ qi[:NOPE]  # the query in latent space [kv_lora]
            q_pe = self.rope(qi[NOPE:], pos)
            scores = torch.stack([q_abs @ c + q_pe @ kp for c, kp in cache])
            p = torch.softmax(scores / math.sqrt(NOPE + ROPE), dim=0)
            o_latent = sum(pj * c for pj, (c, _) in zip(p, cache))
            heads.append(self.w_vc[i] @ o_latent)  # [v]
        residual = w[a + "o_proj.weight"] @ torch.cat(heads) + hidden
        n = self.rms(residual, "midlayer.post_attention_layernorm.weight")
        gate = w["midlayer.mlp.gate_proj.weight"] @ n
        mlp = w["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate)
                                                     * (w["midlayer.mlp.up_proj.weight"] @ n))
        out = mlp + residual
        normed = self.rms(out, "norm.weight")
        return w["lm_head.weight"] @ normed, (normed if self.norm_output else out)

    def extend(self, ids, aux):
        cache, rows = [], []
        for i in range(len(ids) - 1):
            x = aux[i].double()
            if self.fc_norm:  # `chunks = hidden_states.chunk(num_aux)`, one RMSNorm each
                x = torch.cat([self.rms(c, f"fc_norm.{j}.weight") for j, c in
                               enumerate(x.chunk(3))])
            rows.append(self.token(ids[i + 1], self.w["fc.weight"] @ x, i, cache))
        return rows, cache


@pytest.mark.parametrize("attention,options,unroll", [
    ("naive", False, "shared"), ("naive", True, "shared"), ("flex", True, "shared"),
    ("naive", False, "per-step"), ("flex", True, "per-step")])
def test_mla_training_unroll_matches_sglang_reference_when_sequences_are_packed(attention,
                                                                                 options, unroll):
    torch.manual_seed(1)
    draft = mla_draft(fc_norm=options, norm_output=options)
    embed = torch.randn(VT, H)
    seqs = [torch.randint(0, VT, (n,)).tolist() for n in (11, 8)]
    width = FLEX_BLOCK if attention == "flex" else 21
    ids, doc, pos = packed_row(seqs, width)
    aux = torch.randn(1, width, 3 * H)
    model = TTTModel(draft, embed, torch.randn(VD, H), K, 0.8, attention, unroll=unroll)
    with torch.no_grad():
        logits = model.unroll(ids, doc, pos, aux, model.build_masks(doc))
    assert_unroll_matches(SGLangMLAReference(draft, embed), logits, seqs, aux, K)


@pytest.mark.parametrize("options", [False, True])
def test_mla_serving_chain_matches_sglang_reference_when_one_anchor_drafts(options):
    from eagle3.bench.evaluate import Eagle3Proposer

    torch.manual_seed(2)
    draft = mla_draft(3, fc_norm=options, norm_output=options).eval()
    embed = torch.randn(VT, H)
    ids = torch.randint(0, VT, (10,)).tolist()
    aux = torch.randn(9, 3 * H)
    ref = SGLangMLAReference(draft, embed)
    rows, cache = ref.extend(ids, aux)
    hot = draft.d2t  # SGLang: hot_token_id = d2t + arange
    to_target = lambda lg: int(lg.argmax()) + int(hot[int(lg.argmax())])  # noqa: E731
    expected = [to_target(lg) for lg in ref.decode(ids, rows, cache, 8, 5,
                                                   feed=lambda k, lg: to_target(lg))]
    assert Eagle3Proposer(draft, embed).propose(ids, aux, 5) == expected


def test_mla_unrolls_and_attentions_give_equal_loss_and_gradients(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "flex_attention", masked_math_flex)  # see test_draft_model.py
    torch.manual_seed(4)
    embed, teacher = torch.randn(VT, H), torch.randn(VD, H)
    ids, doc, pos = packed_row([torch.randint(0, VT, (n,)).tolist() for n in (70, 40)],
                               FLEX_BLOCK)
    mask = (torch.rand(1, FLEX_BLOCK) < 0.7).long()
    aux, final = torch.randn(1, FLEX_BLOCK, 3 * H), torch.randn(1, FLEX_BLOCK, H)
    losses, grads = [], []
    runs = [("naive", "per-step"), ("naive", "shared"), ("flex", "per-step"), ("flex", "shared")]
    for attention, unroll in runs:  # against the first: the layer as served, per step
        model = TTTModel(mla_draft(5, fc_norm=True), embed, teacher, K, 0.8, attention,
                         unroll=unroll)
        loss, _ = model(ids, mask, doc, pos, aux, final, model.build_masks(doc))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.draft.named_parameters()})
    for run, loss, grad in zip(runs[1:], losses[1:], grads[1:]):
        torch.testing.assert_close(loss, losses[0], rtol=1e-5, atol=1e-6, msg=run)
        for name in grads[0]:
            assert grad[name] is not None and grad[name].abs().sum() > 0, (run, name)
            torch.testing.assert_close(grad[name], grads[0][name], rtol=1e-4, atol=1e-6,
                                       msg=f"{run} {name}")


def test_mla_draft_is_sized_from_the_target_when_it_uses_mla(tmp_path):
    import json

    from eagle3.draft.mla import MLAConfigError

    kimi = {"hidden_size": 7168, "num_attention_heads": 64, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": kimi}))
    dims = read_mla_dims(tmp_path)
    base = DraftConfig(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8,
                       head_dim=128, intermediate_size=18432, vocab_size=163840,
                       draft_vocab_size=32000, target_hidden_size=7168)
    cfg = mla_draft_config(base, dims)
    assert (cfg.arch, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        "mla", 64, 1536, 512, 64, 128, 128)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64,
                                                      "num_attention_heads": 2}))
    with pytest.raises(MLAConfigError, match="--draft-arch llama"):
        read_mla_dims(tmp_path)


@pytest.mark.parametrize("unroll", ["shared", "per-step"])
def test_mla_flop_count_matches_torch_flop_counter_when_attention_is_dense(unroll):
    from torch.utils.flop_counter import FlopCounterMode

    from eagle3.train.flops import micro_step_flops

    draft = mla_draft(6)
    model = TTTModel(draft, torch.randn(VT, H), torch.randn(VD, H), steps=3, step_weight=0.8,
                     unroll=unroll)
    T = 20
    ids, mask = torch.randint(0, VT, (1, T)), torch.ones(1, T, dtype=torch.long)
    doc, pos = torch.zeros(1, T, dtype=torch.int32), torch.arange(T)[None]
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(ids, mask, doc, pos, torch.randn(1, T, 3 * H), torch.randn(1, T, H))
        loss.backward()
    assert counter.get_total_flops() == micro_step_flops(draft.cfg, T, [T], 3,
                                                         dense_attention=True,
                                                         unroll=unroll).train
