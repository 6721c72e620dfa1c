"""The SGLang-loadable draft folder (docs/PIPELINE.md, "Draft checkpoint").

Which layer ids config.json names (and which captures each SGLang release reads from them) is
`eagle3/draft/layers.py`; checking a folder someone else wrote is `eagle3/draft/check.py`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.core.stage import atomic_save_safetensors, atomic_write_json
from eagle3.draft.layers import (
    TRAINED_CAPTURES,
    describe_layers,
    layer_ids_for,
    sglang_capture_layers,
)
from eagle3.draft.mla import build_draft_model
from eagle3.draft.mla_export import (
    MLA_ARCHITECTURE,
    eagle31_fields,
    mla_attention_tensors,
    mla_config,
    mla_draft_fields,
)
from eagle3.draft.model import DraftConfig, Eagle3Draft

log = logging.getLogger(__name__)

CONFIG_KEYS = frozenset({
    "architectures", "model_type", "hidden_act", "torch_dtype", "hidden_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "num_hidden_layers",
    "tie_word_embeddings", "draft_vocab_size", "target_hidden_size", "eagle_config",
})


class ExportError(ValueError):
    """A draft that cannot be exported or served as asked; the message says the fix."""


def sglang_config(cfg: DraftConfig, sglang_version: str | None = None) -> dict:
    """config.json of the draft folder: CONFIG_KEYS and the EAGLE-3.1 switches (the MLA draft's
    folder, which vLLM serves as well, is mla_export.mla_config)."""
    if cfg.arch == "mla":
        return mla_config(cfg, layer_ids_for(cfg.capture_layers, sglang_version))
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layer_ids_for(cfg.capture_layers, sglang_version),
            "use_aux_hidden_state": True,
            TRAINED_CAPTURES: list(cfg.capture_layers),
        },
        # EAGLE-3.1 switches, written when on (llama_eagle3.py reads both; default off)
        **{k: v for k, v in eagle31_fields(cfg).items() if v},
    }
    assert CONFIG_KEYS <= set(out)
    return out


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the draft folder with its shape (SGLang leaves missing ones random)."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = mla_attention_tensors(cfg) if cfg.arch == "mla" else {
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
    }
    fc_norm = {f"fc_norm.{i}.weight": (Ht,) for i in range(3)} if cfg.fc_norm else {}
    return {
        "fc.weight": (H, 3 * Ht),
        **fc_norm,
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        **attention,
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def export_sglang(draft: Eagle3Draft, out_dir: Path, sglang_version: str | None = None) -> Path:
    """Write config.json + model.safetensors (bf16 weights, int64 d2t, bool t2d)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = sglang_config(draft.cfg, sglang_version)
    tensors = {}
    for name, t in draft.state_dict().items():
        t = t.detach().cpu()
        tensors[name] = t.to(torch.bfloat16).contiguous() if t.is_floating_point() else t
    expected = expected_tensors(draft.cfg)
    if set(tensors) != set(expected):
        raise ExportError(f"draft tensors {sorted(set(tensors) ^ set(expected))} differ from "
                          "the SGLang names")
    atomic_save_safetensors(tensors, out_dir / "model.safetensors", {"format": "pt"})
    atomic_write_json(out_dir / "config.json", config)
    log.info("exported draft to %s; %s", out_dir,
             describe_layers(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    return out_dir


def draft_captures(config: dict) -> list[int] | None:
    """The capture layers a draft folder's config.json says its draft was trained on (the
    `eagle_config.trained_capture_layers` 04 writes in final/); None for a folder that does not
    say (a speculators folder, or one written before the key)."""
    declared = (config.get("eagle_config") or {}).get(TRAINED_CAPTURES)
    return list(declared) if declared else None


def draft_config_from_sglang(config: dict, sglang_version: str = "0.5.13") -> DraftConfig:
    """The DraftConfig of an SGLang draft config.json, captures read as `sglang_version` reads."""
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    is_mla = MLA_ARCHITECTURE in config.get("architectures", [])
    extra = mla_draft_fields(config) if is_mla else {
        "num_key_value_heads": config["num_key_value_heads"], "head_dim": config["head_dim"]}
    return DraftConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        capture_layers=draft_captures(config) or sglang_capture_layers(ids, sglang_version),
        # SGLang reads fc_norm or its older name use_aux_norm; both engines read norm_output
        fc_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
        norm_output=bool(config.get("norm_output")),
        **extra,
    )


def load_draft(draft_dir: Path, device: str = "cpu", dtype=torch.float32) -> Eagle3Draft:
    """Load an SGLang draft folder (config.json + model.safetensors) into an Eagle3Draft."""
    draft_dir = Path(draft_dir)
    cfg = draft_config_from_sglang(json.loads((draft_dir / "config.json").read_text()))
    draft = build_draft_model(cfg)
    state = load_file(str(draft_dir / "model.safetensors"))
    draft.load_state_dict(state, strict=True)
    return draft.to(device=device, dtype=dtype).eval()
