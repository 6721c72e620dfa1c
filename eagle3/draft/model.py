"""The EAGLE-3 draft: one Llama-style layer, computing what SGLang's `LlamaForCausalLMEagle3`
computes at serving time (sglang/srt/models/llama_eagle3.py), parameter names included.

    h        = fc(cat(aux_low, aux_mid, aux_high))            # [T, 3*Ht] -> [T, H], step 0 only
                                                               # (fc_norm: each aux RMS-normed)
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))   # [T, 2H]
    a        = o_proj(attention(q/k/v_proj(x)))                # RoPE, neox style
    n, r     = post_attention_layernorm(a, residual=h)         # fused add: r = a + h
    n2, out  = norm(mlp(n), residual=r)                        # fused add: out = mlp(n) + r
    logits   = lm_head(n2)                                     # [T, draft_vocab]

`out` (the pre-norm sum, rounded to the compute dtype; `n2` with EAGLE-3.1's `norm_output`) is
the next draft step's hidden, as in SGLang, whose fused RMSNorm adds in float32, returns the sum cast back, and normalises the float32
sum. Training-time test (TTT) unrolls k steps: step j reads the token j positions further, at RoPE
position t + j, with step j-1's `out` as its hidden. Step j's query at anchor t attends to step
0's keys at rows <= t of its own sequence (the draft's KV cache after extend) and to the keys of
steps 1..j at the same anchor (the tokens it drafted itself) — what the draft sees serving a chain.

eagle3/draft/attention.py computes that softmax (naive, or flex attention in two forms).

The input projections of the attention read `x = [e | h]`, whose embedding half `e` at step k,
anchor t is step 0's at anchor t + k (both read token t+1+k). The shared TTT unroll
(eagle3/train/ttt.py) therefore computes `e`'s share of every input projection once per batch
(`embed_projections`) and each step adds only `h`'s share (`layer(..., embed_part=...)`): the
same sums in another order, with 1/K of the embedding half's GEMMs.

Shapes: B batch, T positions, H draft hidden, Ht target hidden, V draft vocab, h heads, hkv kv
heads, d head dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.draft.attention import (
    StepCache,
    flex_ttt_attention,
    merged_flex_attention,
    naive_ttt_attention,
    store,
)

DRAFT_ARCHS = ("llama", "mla")


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
    # EAGLE-3.1 options (both engines read these config.json fields under these names):
    fc_norm: bool = False  # RMSNorm each aux state (its own weight) before fc
    norm_output: bool = False  # the next step's hidden is the post-norm output, not the sum
    # "llama" (this file) or "mla" (eagle3/draft/mla.py: DeepSeek-V2 multi-latent attention,
    # whose sizes below are 0 for "llama")
    arch: str = "llama"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.arch not in DRAFT_ARCHS:
            raise ValueError(f"draft arch {self.arch!r}: expected one of {DRAFT_ARCHS} "
                             "(--draft-arch)")
        mla = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
               self.qk_rope_head_dim, self.v_head_dim)
        if self.arch == "mla" and min(mla) < 1:
            raise ValueError(f"an MLA draft needs q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                             f"qk_rope_head_dim, v_head_dim > 0, got {mla}: size it from an MLA "
                             "target (DeepSeek-V3 / Kimi-K2.5 config.json)")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """RMSNorm in float32, optionally fused with a residual add (SGLang `RMSNorm.forward`).

    With `residual`, returns (norm(x + residual), x + residual cast to x's dtype); the sum is
    formed in float32 and the normalised output is computed from the float32 sum.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
            residual = xf.to(x.dtype)
        # x * rsqrt(mean(x^2) + eps) * w in float32, one fused kernel where torch has one
        out = F.rms_norm(xf, (xf.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


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


def linear_columns(linear: nn.Linear, x: torch.Tensor, start: int) -> torch.Tensor:
    """`x @ W[:, start:start + x.shape[-1]]^T`: the share of one block of `linear`'s input
    columns (the draft's linears have no bias). A layer with its own way (FP8 training:
    eagle3/train/fp8.py) provides `forward_columns`."""
    own = getattr(linear, "forward_columns", None)
    if own is not None:
        return own(x, start)
    return F.linear(x, linear.weight[:, start:start + x.shape[-1]])


# ---------------------------------------------------------------- the layer


class Attention(nn.Module):
    in_projections = ("q_proj", "k_proj", "v_proj")  # the linears over the 2H input

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(2 * H, h * d, bias=False)
        self.k_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)

    def qkv(self, project, positions_BT):
        """q `[B, h, T, d]`, k and v `[B, hkv, T, d]`, RoPE applied at `positions_BT`;
        `project(name)` is the output `[B, T, N]` of the input projection `name` (see layer)."""
        cfg = self.cfg
        q = project("q_proj")
        B, T, _ = q.shape
        q = q.view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = project("k_proj").view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = project("v_proj").view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions_BT, cfg.head_dim, cfg.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn_BhTd):
        B, _, T, _ = attn_BhTd.shape
        return self.o_proj(attn_BhTd.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, attention_cls: type = Attention):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg)  # qkv(x, positions) -> q, k, v; out(attn)
        self.mlp = MLP(cfg)


class Eagle3Draft(nn.Module):
    """The draft; `state_dict()` keys are exactly the SGLang checkpoint names."""

    attention_cls: type = Attention  # the MLA draft (eagle3/draft/mla.py) swaps this only

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.fc_norm:  # EAGLE-3.1: one RMSNorm per aux state, `fc_norm.{i}.weight`
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                         for _ in range(3))
        self.midlayer = MidLayer(cfg, self.attention_cls)
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

    def project_aux(self, aux_BT3H: torch.Tensor) -> torch.Tensor:
        """Step 0's hidden: fc over the 3 aux states, each RMS-normed first with `fc_norm`."""
        if self.cfg.fc_norm:
            chunks = aux_BT3H.chunk(3, dim=-1)
            aux_BT3H = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_BT3H)

    def embed_projections(self, embeds_BTH) -> dict:
        """The embedding half's share of every attention input projection, `{name: [B, T, N]}`
        (`input_layernorm(embed) @ W[:, :H]^T`): the shared TTT unroll computes it once per
        batch and shifts it one row per step (eagle3/train/ttt.py)."""
        attn = self.midlayer.self_attn
        e = self.midlayer.input_layernorm(embeds_BTH)
        return {name: linear_columns(getattr(attn, name), e, 0) for name in attn.in_projections}

    def layer(self, embeds_BTH, hidden_BTH, positions_BT, attend, embed_part=None):
        """One pass of the layer: (normed output `[B, T, H]`, next hidden): the pre-norm sum, or
        with `norm_output` the normed output itself (EAGLE-3.1).

        `attend(q, k, v)` stores this step's keys/values and returns the attention `[B,h,T,d]`.
        `embed_part` (`embed_projections` of this step's tokens, `embeds_BTH` then unused): each
        input projection is that share plus the hidden half's, `hidden_norm(h) @ W[:, H:]^T`.
        """
        mid, attn = self.midlayer, self.midlayer.self_attn
        if embed_part is None:
            x = torch.cat([mid.input_layernorm(embeds_BTH), mid.hidden_norm(hidden_BTH)], dim=-1)

            def project(name):
                return getattr(attn, name)(x)
        else:
            h = mid.hidden_norm(hidden_BTH)

            def project(name):
                return embed_part[name] + linear_columns(getattr(attn, name), h,
                                                         self.cfg.hidden_size)
        q, k, v = attn.qkv(project, positions_BT)
        out = attn.out(attend(q, k, v))
        normed, residual = mid.post_attention_layernorm(out, hidden_BTH)
        out, summed = self.norm(mid.mlp(normed), residual)
        return out, (out if self.cfg.norm_output else summed)

    def step(self, embeds_BTH, hidden_BTH, positions_BT, cache: StepCache,
             anchors_T: torch.Tensor | None = None, doc_BT: torch.Tensor | None = None,
             embed_part: dict | None = None):
        """One draft step with the naive attention: (logits `[B, T, V]`, next hidden `[B,T,H]`).

        `hidden_BTH` is `fc(aux)` for step 0 and the previous step's output after. The first
        call fills the step-0 cache (the draft extend); later calls are decode steps whose query
        row i belongs to step-0 row `anchors_T[i]` (default: row i -> i, as in training).
        `embed_part`: see `layer`.
        """
        if anchors_T is None:
            anchors_T = torch.arange(hidden_BTH.shape[1], device=hidden_BTH.device)

        def attend(q, k, v):
            store(cache, k, v)
            return naive_ttt_attention(q, cache, anchors_T, doc_BT)

        normed, hidden = self.layer(embeds_BTH, hidden_BTH, positions_BT, attend, embed_part)
        return self.lm_head(normed), hidden

    def flex_step(self, embeds_BTH, hidden_BTH, positions_BT, cache: StepCache, block_mask,
                  embed_part: dict | None = None, merged: bool = True):
        """One TTT step with flex attention (training): (logits, next hidden). `cache` holds the
        earlier steps' keys/values and receives this step's; `merged`: merged_flex_attention
        (`block_mask` = the step-0 mask) or flex_ttt_attention (this step's extended mask)."""
        attention = merged_flex_attention if merged else flex_ttt_attention

        def attend(q, k, v):
            store(cache, k, v)
            return attention(q, cache, block_mask)

        normed, hidden = self.layer(embeds_BTH, hidden_BTH, positions_BT, attend, embed_part)
        return self.lm_head(normed), hidden

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (`id + d2t[id]`)."""
        return draft_ids + self.d2t[draft_ids]
