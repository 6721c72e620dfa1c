"""The MLA EAGLE-3 draft: the Llama-style draft of model.py with DeepSeek-V2 multi-latent attention,
computing what SGLang's `Eagle3DeepseekV2ForCausalLM` (sglang/srt/models/kimi_k25_eagle3.py,
0.5.23) and vLLM's class of the same name (vllm/model_executor/models/deepseek_eagle3.py) compute
when serving, parameter names included.

Everything but the attention is the Llama draft's (fc, fc_norm, the two input norms, the fused
residual norms, the dense SiLU MLP, norm, lm_head, norm_output). The attention, on the same
`x = cat(input_layernorm(embed), hidden_norm(h))` `[T, 2H]`:

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))              # [T, h, nope + rope]
    c, k_pe = split(kv_a_proj_with_mqa(x), [kv_lora, rope])     # the latent the KV cache holds
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)), [nope, v])  # per head
    q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)                         # interleaved pairs; k_pe shared
    attn    = softmax((q_nope.k_nope + q_pe.k_pe) / sqrt(nope + rope)) v
    out     = o_proj(attn)                                      # [T, h*v] -> [T, H]

SGLang serves this in the "absorbed" form (the cache holds `c` and `k_pe`, `kv_b_proj` is folded
into the query and the output); training uses the expanded form above, which is the same
arithmetic. RoPE is interleaved (GPT-J pairs), as both engines apply it (`rope_interleave`
defaults to true in SGLang; vLLM's MLA passes `is_neox_style=False`), with plain `rope_theta` and
no YaRN scaling (the draft config carries none, so neither engine scales the softmax).

The draft keeps the TTT interface of model.py (`step`, `flex_step`, the masks): the query/key
width is nope + rope and the value width v, which both attention paths accept.

Shapes: B batch, T positions, H draft hidden, h heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle3.draft.model import DraftConfig, Eagle3Draft, RMSNorm

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class MLAConfigError(ValueError):
    """A target (or draft) config that cannot size an MLA draft; the message says the fix."""


def read_mla_dims(target_dir: Path) -> dict:
    """The target's MLA sizes (`MLA_FIELDS` and `num_attention_heads`) from its config.json."""
    path = Path(target_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    missing = [k for k in MLA_FIELDS if not cfg.get(k)]
    if missing:
        raise MLAConfigError(f"{path} has no {missing}: the target does not use multi-latent "
                             "attention, so --draft-arch mla cannot be sized from it; train the "
                             "Llama-style draft (--draft-arch llama)")
    return {**{k: int(cfg[k]) for k in MLA_FIELDS},
            "num_attention_heads": int(cfg["num_attention_heads"])}


def rope_interleaved(x_BhTr: torch.Tensor, positions_BT: torch.Tensor, theta: float):
    """RoPE on interleaved pairs (x[2i], x[2i+1]) rotated by position * theta^(-2i/r)."""
    r = x_BhTr.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, device=x_BhTr.device,
                                              dtype=torch.float32) / r))
    freqs = positions_BT.float()[..., None] * inv_freq  # [B, T, r/2]
    cos = freqs.cos().repeat_interleave(2, -1).to(x_BhTr.dtype)[:, None]  # [B, 1, T, r]
    sin = freqs.sin().repeat_interleave(2, -1).to(x_BhTr.dtype)[:, None]
    pairs = x_BhTr.unflatten(-1, (r // 2, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x_BhTr * cos + rotated * sin


class MLAAttention(nn.Module):
    """DeepSeek-V2 MLA over the draft's 2H-wide input (q_lora_rank required, as in SGLang)."""

    in_projections = ("q_a_proj", "kv_a_proj_with_mqa")  # the linears over the 2H input

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, H2 = cfg.num_attention_heads, 2 * cfg.hidden_size
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_a_proj = nn.Linear(H2, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H2, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def qkv(self, project, positions_BT):
        """q, k `[B, h, T, nope + rope]`, v `[B, h, T, v]`, RoPE applied at `positions_BT`;
        `project(name)`: the output of the input projection `name` (model.py `layer`)."""
        cfg = self.cfg
        h, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(project("q_a_proj")))
        B, T, _ = q.shape
        q_nope, q_pe = q.view(B, T, h, nope + rope).transpose(1, 2).split([nope, rope], -1)
        latent, k_pe = project("kv_a_proj_with_mqa").split([cfg.kv_lora_rank, rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, h, nope + cfg.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([nope, cfg.v_head_dim], -1)
        q_pe = rope_interleaved(q_pe, positions_BT, cfg.rope_theta)
        k_pe = rope_interleaved(k_pe[:, None], positions_BT, cfg.rope_theta)  # one shared head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, h, T, rope)], dim=-1)
        return q, k, v.contiguous()

    def out(self, attn_BhTv):
        B, _, T, _ = attn_BhTv.shape
        return self.o_proj(attn_BhTv.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLADraft(Eagle3Draft):
    """The MLA draft; `state_dict()` keys are the checkpoint names both engines load."""

    attention_cls = MLAAttention

    def __init__(self, cfg: DraftConfig):
        if cfg.arch != "mla":
            raise ValueError(f"Eagle3MLADraft needs DraftConfig(arch='mla'), got {cfg.arch!r}")
        super().__init__(cfg)


def build_draft_model(cfg: DraftConfig) -> Eagle3Draft:
    """The draft class of `cfg.arch`."""
    return Eagle3MLADraft(cfg) if cfg.arch == "mla" else Eagle3Draft(cfg)


def mla_draft_config(base: DraftConfig, dims: dict, heads: int = 0) -> DraftConfig:
    """`base` (the Llama-style sizes 04 derives) turned into the MLA draft of `dims`
    (`read_mla_dims`): `heads` (0 = the target's), head_dim = nope + rope for the record."""
    fields = {**base.to_dict(), **{k: dims[k] for k in MLA_FIELDS}, "arch": "mla"}
    fields["num_attention_heads"] = fields["num_key_value_heads"] = (
        heads or dims["num_attention_heads"])
    fields["head_dim"] = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    return DraftConfig(**fields)
