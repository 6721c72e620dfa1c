"""Exact FLOPs of one training micro-step (for MFU), counted GEMM by GEMM.

Per TTT step and row: q/k/v over the 2H input, o_proj, the gated MLP and the draft lm_head.
Once per row: `fc` (3Ht -> H; its input needs no gradient, so forward + weight gradient = 2x)
and the teacher logits (target hidden -> draft vocabulary, forward only). Everything trained
costs 3x its forward (forward, input gradient, weight gradient). Attention counts only the keys
a query really sees: the causal prefix of its own sequence plus one diagonal key per earlier
step (QK^T and PV: 4 * heads * head_dim per query-key pair). Elementwise work (norms, RoPE,
softmax, loss) is not counted, as usual for MFU.

The shared unroll (eagle3/train/ttt.py, the default) computes the embedding half of the attention's
input projections (`input_layernorm(embed) @ W[:, :H]^T`) once per row instead of once per step and
row: `embed_half` counts it once, `layer_gemms` the rest. What is counted is what runs, so MFU
compares unrolls by the work each one does, and tokens/s is the figure to compare them by.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.draft.model import DraftConfig


@dataclass
class StepFlops:
    layer_gemms: int  # per-TTT-step GEMMs over every row, forward, summed over steps
    attention: int  # QK^T + PV over visible keys, forward, summed over steps
    fc: int  # forward, once per row
    teacher: int  # forward only
    embed_half: int = 0  # the shared unroll's embedding half of the input projections, forward

    @property
    def train(self) -> int:
        """Forward + backward of everything trained, plus the teacher's forward (the embedding
        half's input gradient feeds input_layernorm's weight: 3x as well)."""
        return (3 * (self.layer_gemms + self.attention + self.embed_half) + 2 * self.fc
                + self.teacher)


def input_projection_width(cfg: DraftConfig) -> int:
    """Output columns of the attention's projections over the 2H input (model.py
    `in_projections`): q, k, v; or MLA's q_a and kv_a (latent + shared rope key)."""
    if cfg.arch == "mla":
        return cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim


def layer_gemm_flops_per_row(cfg: DraftConfig) -> int:
    """Forward FLOPs of one TTT step per row, the input projections over the whole 2H input."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    inputs = 2 * H * input_projection_width(cfg)
    if cfg.arch == "mla":  # q_b, kv_b from the latents; o_proj (mla.py)
        h, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = (inputs + cfg.q_lora_rank * h * qk
                + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                + h * cfg.v_head_dim * H)
        return 2 * (attn + 3 * H * inter + H * cfg.draft_vocab_size)
    q = cfg.num_attention_heads * cfg.head_dim
    return 2 * (inputs + q * H + 3 * H * inter + H * cfg.draft_vocab_size)


def micro_step_flops(cfg: DraftConfig, rows: int, seq_lengths: list[int], steps: int,
                     dense_attention: bool = False, unroll: str = "shared") -> StepFlops:
    """FLOPs of one packed row of `rows` positions holding sequences of `seq_lengths`, for the
    TTT `unroll` ("shared" or "per-step", eagle3/train/ttt.py).

    `dense_attention` counts the full `rows x rows` score matrix per step instead (what the
    naive implementation multiplies; used to check this count against a FLOP counter).
    """
    pair = 4 * cfg.num_attention_heads * cfg.head_dim  # QK^T and PV: 2 x 2 h d per pair
    if cfg.arch == "mla":  # QK^T over nope + rope, PV over v
        pair = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                              + cfg.v_head_dim)
    if dense_attention:
        attention = steps * pair * rows * rows
    else:
        context = sum(n * (n + 1) // 2 for n in seq_lengths)  # causal keys, summed over queries
        queries = sum(seq_lengths)
        attention = sum(pair * (context + s * queries) for s in range(steps))
    if unroll not in ("shared", "per-step"):  # eagle3/train/ttt.py UNROLLS
        raise ValueError(f"unroll {unroll!r}: expected 'shared' or 'per-step'")
    layer = steps * rows * layer_gemm_flops_per_row(cfg)
    embed_half = 0
    if unroll == "shared":  # H of the 2H input columns: once per row, not once per step
        embed_half = 2 * rows * cfg.hidden_size * input_projection_width(cfg)
        layer -= steps * embed_half
    return StepFlops(
        layer_gemms=layer,
        attention=attention,
        fc=2 * rows * 3 * cfg.target_hidden_size * cfg.hidden_size,
        teacher=2 * rows * cfg.target_hidden_size * cfg.draft_vocab_size,
        embed_half=embed_half,
    )
