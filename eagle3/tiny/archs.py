"""Other architectures of the embedded tiny target, next to the DeepSeek-V3 one (target.py).

`--arch` of `python -m eagle3.tiny.target` picks one; the tokenizer and chat template are the same
Kimi-style ones in every case, so every stage runs unchanged on each (qwen2's tokenizer splits
text as Qwen2's does, below).

- `deepseek_v3` (target.py): MLA with a 16-wide latent and MoE; transformers and SGLang.
- `llama`: a dense Llama (head_dim 32, GQA 4/2). vLLM's CPU build serves it with an EAGLE-3
  draft (`LlamaForCausalLMEagle3`, the draft 04 trains), which a DeepSeek (MLA) target cannot
  do on CPU: vLLM finds no common KV block size for the MLA target (16) and the Llama draft
  (multiples of 32). An MLA draft (`Eagle3DeepseekV2ForCausalLM`) is the seam for that.
- `deepseek_v3_vllm`: the DeepSeek-V3 target in the shape vLLM's CPU MLA kernel accepts:
  `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (latent 576, the only size it has; Kimi-K2.5's).
- `qwen2`: a dense Qwen2 in Qwen2.5-Coder-Instruct's layout: biases on the q/k/v projections
  (none on o), grouped KV heads (4/2, head_dim 16), an untied head, rope base 1e6. Its BPE is
  learned and applied with Qwen2's text split (NFC, Qwen2's pre-tokenizer regex, byte level)
  and its vocabulary holds Qwen's `<|endoftext|>` and `<|im_start|>` beside the Kimi-style
  tokens: what a qwen2 GGUF can say of a tokenizer (`tokenizer.ggml.pre` "qwen2"), and what
  transformers rebuilds a Qwen2Tokenizer as, so that the tiny target survives a round trip
  through a GGUF (tests/targets/test_gguf.py).

Both DeepSeek-V3 shapes carry `deepseek_v3_serving_fields`: fields real DeepSeek-V3 and
Kimi-K2.5 configs carry and transformers does not write by default, which the engines read.

    python -m eagle3.tiny.target --out runs/llama/target --arch llama
"""

from __future__ import annotations

import torch

ARCHS = ("deepseek_v3", "llama", "deepseek_v3_vllm", "qwen2")
# Qwen2's ChatML tokens the Kimi-style set lacks (<|im_end|> it has); transformers 5.17 adds these
# to every tokenizer it reads from a qwen2 GGUF
QWEN2_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>"]


def qwen2_text_split():
    """(normalizer, pre-tokenizer) of transformers' Qwen2Tokenizer: NFC, then Qwen2's regex
    split, then byte level without GPT-2's regex."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _dense_fields(cfg, vocab_size: int, heads: int) -> dict:
    """The config fields the dense tiny targets share: sizes, grouped KV heads (half the heads),
    an untied head, no special-token ids (the tokenizer carries them)."""
    return {"vocab_size": vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None}


def build_llama(cfg, vocab_size: int):
    """A randomly initialised LlamaForCausalLM, seeded: head_dim = hidden / heads = 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = cfg.hidden_size // 32  # head_dim 32: the smallest vLLM's CPU attention serves
    model_cfg = LlamaConfig(**_dense_fields(cfg, vocab_size, heads), head_dim=32)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(model_cfg)


def build_qwen2(cfg, vocab_size: int):
    """A randomly initialised Qwen2ForCausalLM, seeded, in Qwen2.5-Coder's layout (q/k/v bias,
    grouped KV heads, untied head, rope base 1e6); its q/k/v biases are drawn too (they start
    at zero, which would leave them untested)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_cfg = Qwen2Config(**_dense_fields(cfg, vocab_size, cfg.num_attention_heads),
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                            rms_norm_eps=1e-6, use_sliding_window=False)
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(model_cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
    return model


def deepseek_v3_vllm_fields() -> dict:
    """The DeepSeek-V3 latent sizes vLLM's CPU MLA kernel serves (Kimi-K2.5's: 512 + 64)."""
    return {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def deepseek_v3_serving_fields(max_position_embeddings: int) -> dict:
    """DeepSeek-V3 config fields the serving engines read, as Kimi-K2.5's config has them.

    transformers' DeepseekV3 computes the same model with or without them (checked by
    tests/tiny/test_tiny_target.py: same logits):
    - `topk_method: "noaux_tc"`, `scoring_func: "sigmoid"`: the routing transformers always does;
      without them vLLM's loader looks for no `e_score_correction_bias` (`KeyError`) and SGLang's
      `DeepseekV2MoE` reads `config.topk_method` (`AttributeError`).
    - `moe_layer_freq: 1`: every layer after `first_k_dense_replace` is MoE, as transformers
      builds them; SGLang reads it.
    - a yarn `rope_parameters` with `factor` 1.0: YaRN at factor 1 is plain RoPE (same inverse
      frequencies, mscale 1); SGLang's CPU rotary embedding exists only as its `deepseek_yarn`
      one (it asserts that type), which it picks only for a config with rope scaling.
    """
    return {
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "rope_parameters": {"rope_type": "yarn", "factor": 1.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": max_position_embeddings,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0},
    }
