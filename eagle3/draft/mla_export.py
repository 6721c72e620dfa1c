"""The MLA draft's folder: one config.json + model.safetensors that SGLang and vLLM both serve.

Both engines name the class `Eagle3DeepseekV2ForCausalLM` (sglang/srt/models/kimi_k25_eagle3.py,
vllm/model_executor/models/deepseek_eagle3.py) and read the same tensor names (ours: `midlayer.*`;
SGLang maps `layers.0.` -> `midlayer.`, vLLM `midlayer.` -> `layers.0.`). What each reads, from
their sources (SGLang 0.5.23, vLLM 0.32):

- `model_type` must be `deepseek_v2`: vLLM rewrites a `deepseek_v3` draft config to its MTP class
  (`SpeculativeConfig.hf_config_override`) and fails.
- `num_hidden_layers` 1 (SGLang raises otherwise) and a `q_lora_rank` (SGLang raises without).
- `fc_norm` / `norm_output` (EAGLE-3.1) are top-level in both; SGLang also takes `use_aux_norm`
  for `fc_norm`, and an fc bias from `bias` (we write `false`: the draft has none).
- Layer ids: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` only
  (spec_aux_hidden_state.py), with its version rule (export.py: "capture index - 1"); vLLM reads
  the top-level `eagle_aux_hidden_state_layer_ids` first (gpu_model_runner.py; its v2 runner reads
  nothing else) as capture indices. Writing both makes one folder serve both engines.
- vLLM's speculators-format reader maps only Llama/Qwen3 layer configs: there is no
  speculators-format MLA draft; vLLM serves this folder directly
  (`--speculative-config '{"method": "eagle3", "model": DIR}'`).
"""

from __future__ import annotations

from eagle3.draft.layers import TRAINED_CAPTURES
from eagle3.draft.model import DraftConfig

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"  # not deepseek_v3: vLLM turns that into its MTP draft


def eagle31_fields(cfg: DraftConfig) -> dict:
    """The EAGLE-3.1 switches as both engines read them (top-level config.json fields)."""
    return {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output}


def mla_config(cfg: DraftConfig, sglang_layer_ids: list[int]) -> dict:
    """config.json of the MLA draft; `sglang_layer_ids` as export.layer_ids_for gives them."""
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": MLA_MODEL_TYPE,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,  # plain RoPE, no YaRN softmax scaling (see mla.py)
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "bias": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(sglang_layer_ids),
                         "use_aux_hidden_state": True,
                         TRAINED_CAPTURES: list(cfg.capture_layers)},
        "eagle_aux_hidden_state_layer_ids": list(cfg.capture_layers),  # vLLM: capture indices
        **eagle31_fields(cfg),
    }


def mla_draft_fields(config: dict) -> dict:
    """The DraftConfig fields an MLA config.json sets beyond the Llama-style ones."""
    return {"arch": "mla", **{k: config[k] for k in ("q_lora_rank", "kv_lora_rank",
                                                     "qk_nope_head_dim", "qk_rope_head_dim",
                                                     "v_head_dim")},
            "num_key_value_heads": config["num_attention_heads"],
            "head_dim": config["qk_nope_head_dim"] + config["qk_rope_head_dim"]}


def mla_attention_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The attention tensors of the MLA draft with their shapes."""
    H2, h = 2 * cfg.hidden_size, cfg.num_attention_heads
    a = "midlayer.self_attn."
    return {
        a + "q_a_proj.weight": (cfg.q_lora_rank, H2),
        a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
        a + "q_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                                cfg.q_lora_rank),
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H2),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (cfg.hidden_size, h * cfg.v_head_dim),
    }
