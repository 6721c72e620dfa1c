"""The EAGLE-3 draft: one Llama-style layer, computing what SGLang's `LlamaForCausalLMEagle3`
computes at serving time (sglang/srt/models/llama_eagle3.py), parameter names included.

    h      = fc(cat(aux_low, aux_mid, aux_high))          # [T, 3*Ht] -> [T, H], once per step 0
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))   # [T, 2H]
    a      = o_proj(attention(q/k/v_proj(x)))              # RoPE, neox style
    n, r   = post_attention_layernorm(a + h), a + h        # fused add + norm
    out    = mlp(n) + r                                    # pre-norm: next step's hidden
    logits = lm_head(norm(out))                            # [T, draft_vocab]

Training-time test (TTT) unrolls this k steps: step j feeds `out` of step j-1 as the hidden and
the token j positions further as the input, at RoPE position t + j. Step j's query at anchor t
attends to step 0's keys at positions <= t (the draft's KV cache after extend) and to the keys of
steps 1..j at the same anchor t (the draft tokens it proposed itself) — exactly what the draft
sees when serving a chain.

Shapes: B batch, T positions, H draft hidden, Ht target hidden, V draft vocab, h heads,
d head dim, S steps so far.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    """Architecture of the draft; defaults are overridden from the target (see from_target)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (the embedding the draft borrows)
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    capture_layers: list[int] = field(default_factory=lambda: [2, 30, 58])

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """RMSNorm in float32, optionally fused with a residual add (SGLang `RMSNorm.forward`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin `[..., d]` for integer positions (neox layout: halves, not interleaved)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BhTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor):
    x1, x2 = x_BhTd.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BhTd * cos_BTd[:, None] + rotated * sin_BTd[:, None]


@dataclass
class StepCache:
    """Keys/values of step 0 (all positions) and of later steps (one row per anchor)."""

    k0: torch.Tensor | None = None  # [B, hkv, T0, d]
    v0: torch.Tensor | None = None
    ks: list = field(default_factory=list)  # per step >= 1: [B, hkv, Tq, d]
    vs: list = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * H, h * d, bias=False)
        self.k_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)

    def forward(self, x_BT2H, positions_BT, cache: StepCache, anchors_T: torch.Tensor):
        """Attention of one TTT step; fills `cache`. `anchors_T[i]`: step-0 row of query i."""
        cfg = self.cfg
        B, T, _ = x_BT2H.shape
        q = self.q_proj(x_BT2H).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x_BT2H).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x_BT2H).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions_BT, cfg.head_dim, cfg.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache.k0 is None:
            cache.k0, cache.v0 = k, v
        else:
            cache.ks.append(k)
            cache.vs.append(v)
        out = _ttt_attention(q, cache, anchors_T, cfg.num_attention_heads // cfg.num_key_value_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _ttt_attention(q_BhTd, cache: StepCache, anchors_T, groups: int) -> torch.Tensor:
    """Softmax over [step-0 keys at rows <= anchor] + [each later step's key at the anchor]."""
    scale = 1.0 / math.sqrt(q_BhTd.shape[-1])
    k0 = cache.k0.repeat_interleave(groups, dim=1)
    v0 = cache.v0.repeat_interleave(groups, dim=1)
    scores_ctx = torch.matmul(q_BhTd, k0.transpose(-1, -2)).float() * scale  # [B, h, Tq, T0]
    key_rows = torch.arange(k0.shape[-2], device=q_BhTd.device)
    visible = key_rows[None, :] <= anchors_T[:, None]  # [Tq, T0]
    scores_ctx = scores_ctx.masked_fill(~visible, float("-inf"))
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


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, embeds_BTH, hidden_BTH, positions_BT, cache, anchors_T):
        """Returns the pre-norm output `[B, T, H]` (the next step's hidden)."""
        residual = hidden_BTH
        x = torch.cat([self.input_layernorm(embeds_BTH), self.hidden_norm(hidden_BTH)], dim=-1)
        attn = self.self_attn(x, positions_BT, cache, anchors_T)
        residual = attn + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Draft(nn.Module):
    """The draft; `state_dict()` keys are exactly the SGLang checkpoint names."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes {tuple(d2t.shape)}, {tuple(t2d.shape)} do "
                             f"not match the draft ({tuple(self.d2t.shape)}, "
                             f"{tuple(self.t2d.shape)}): rebuild 03 with --draft-vocab "
                             f"{self.cfg.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def step(self, embeds_BTH, hidden_BTH, positions_BT, cache: StepCache,
             anchors_T: torch.Tensor | None = None):
        """One TTT step: (draft logits `[B, T, V]`, pre-norm hidden `[B, T, H]`).

        `hidden_BTH` is `fc(aux)` for step 0 and the previous step's output after. `anchors_T`
        maps each query row to its step-0 row (default: row i -> i, as in training).
        """
        if anchors_T is None:
            anchors_T = torch.arange(embeds_BTH.shape[1], device=embeds_BTH.device)
        out = self.midlayer(embeds_BTH, hidden_BTH, positions_BT, cache, anchors_T)
        return self.lm_head(self.norm(out)), out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (`id + d2t[id]`)."""
        return draft_ids + self.d2t[draft_ids]
