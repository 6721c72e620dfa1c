"""Exact FLOPs of one training micro-step (for MFU), counted GEMM by GEMM.

Per TTT step and row: q/k/v over the 2H input, o_proj, the gated MLP and the draft lm_head.
Once per row: `fc` (3Ht -> H; its input needs no gradient, so forward + weight gradient = 2x)
and the teacher logits (target hidden -> draft vocabulary, forward only). Everything trained
costs 3x its forward (forward, input gradient, weight gradient). Attention counts only the keys
a query really sees: the causal prefix of its own sequence plus one diagonal key per earlier
step (QK^T and PV: 4 * heads * head_dim per query-key pair). Elementwise work (norms, RoPE,
softmax, loss) is not counted, as usual for MFU.
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

    @property
    def train(self) -> int:
        """Forward + backward of everything trained, plus the teacher's forward."""
        return 3 * (self.layer_gemms + self.attention) + 2 * self.fc + self.teacher


def layer_gemm_flops_per_row(cfg: DraftConfig) -> int:
    H, inter = cfg.hidden_size, cfg.intermediate_size
    if cfg.arch == "mla":  # q_a, kv_a over 2H; q_b, kv_b from the latents; o_proj (mla.py)
        h, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = (2 * H * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                + cfg.q_lora_rank * h * qk
                + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                + h * cfg.v_head_dim * H)
        return 2 * (attn + 3 * H * inter + H * cfg.draft_vocab_size)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * (2 * H * (q + 2 * kv) + q * H + 3 * H * inter + H * cfg.draft_vocab_size)


def micro_step_flops(cfg: DraftConfig, rows: int, seq_lengths: list[int], steps: int,
                     dense_attention: bool = False) -> StepFlops:
    """FLOPs of one packed row of `rows` positions holding sequences of `seq_lengths`.

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
    return StepFlops(
        layer_gemms=steps * rows * layer_gemm_flops_per_row(cfg),
        attention=attention,
        fc=2 * rows * 3 * cfg.target_hidden_size * cfg.hidden_size,
        teacher=2 * rows * cfg.target_hidden_size * cfg.draft_vocab_size,
    )
