"""A qwen2 GGUF written from the tiny qwen2 target (eagle3/tiny/archs.py), as llama.cpp's
convert_hf_to_gguf.py writes Qwen2.5's: F32 tensors under GGUF names, the `qwen2.*` keys, and
the tokenizer as `tokenizer.ggml.*` (model "gpt2", pre "qwen2", tokens by id, merges, token
types, bos/eos/pad ids, the chat template). It stands in for Qwen2.5-Coder's 1.1 GB file, so that
tests/targets/test_gguf.py converts a qwen2 GGUF without downloading one.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.targets.packaged import PackagedTarget, Part

# HF parameter name (after `model.layers.{i}.`) -> GGUF tensor name (after `blk.{i}.`)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
OTHER_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in OTHER_NAMES:
        return OTHER_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def _write_tokenizer(w, tok) -> None:
    from gguf import TokenType

    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    added = {i: t.special for i, t in tok.added_tokens_decoder.items()}
    types = [int(TokenType.NORMAL) if i not in added else
             int(TokenType.CONTROL if added[i] else TokenType.USER_DEFINED)
             for i in range(len(tokens))]
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if tok.unk_token_id is not None:
        w.add_unk_token_id(tok.unk_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)


def write_qwen2_gguf(target_dir: Path, path: Path) -> Path:
    """The tiny qwen2 target at `target_dir` as one F32 GGUF at `path`."""
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target_dir)
    c = model.config
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(0)  # all F32
    _write_tokenizer(w, tok)
    for name, tensor in model.state_dict().items():
        w.add_tensor(gguf_name(name), tensor.numpy(), raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def packaged(path: Path, name: str = "tiny-qwen2") -> PackagedTarget:
    """A table entry for the GGUF at `path` (its preset: eagle3/core/presets.py)."""
    from eagle3.targets.packaged import sha256_of

    return PackagedTarget(
        name=name, model="tiny qwen2", gguf_name=path.name,
        parts=(Part("tiny-qwen2-gguf", "0.0.1", f"tiny_qwen2_gguf/{path.name}"),),
        size=path.stat().st_size, sha256=sha256_of(path), end_of_turn="<|im_end|>",
        config={"model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": False,
                "rope_theta": 1000000.0})
