"""The SGLang-loadable draft folder (PIPELINE.md, "Draft checkpoint") and the layer-id rule.

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and turns them into capture
indices: releases 0.5.4.post2 to 0.5.12 always add 1; from 0.5.13 it adds 1 only when the first
id is 1. Writing "capture index - 1" ([1, 29, 57] for captures [2, 30, 58]) therefore names the
same captures on every release, as long as the first capture is 2 (SGLang's default); other
layouts depend on the release and are refused unless a release is named.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.core.stage import atomic_save_safetensors, atomic_write_json

log = logging.getLogger(__name__)

OLD_RULE = ((0, 5, 4), (0, 5, 12))  # releases that always add 1 (0.5.4.post2 .. 0.5.12)
NEW_RULE_FROM = (0, 5, 13)  # first release that adds 1 only when the first id is 1

CONFIG_KEYS = frozenset({
    "architectures", "model_type", "hidden_act", "torch_dtype", "hidden_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "num_hidden_layers",
    "tie_word_embeddings", "draft_vocab_size", "target_hidden_size", "eagle_config",
})


class ExportError(ValueError):
    """A draft that cannot be exported or served as asked; the message says the fix."""


def parse_version(version: str) -> tuple[int, int, int]:
    parts = version.split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:3])  # type: ignore


def sglang_capture_layers(layer_ids: list[int], version: str) -> list[int]:
    """The capture indices an SGLang release derives from `eagle_aux_hidden_state_layer_ids`."""
    v = parse_version(version)
    if v >= NEW_RULE_FROM:
        return [i + 1 for i in layer_ids] if layer_ids and layer_ids[0] == 1 else list(layer_ids)
    if v >= OLD_RULE[0]:
        return [i + 1 for i in layer_ids]
    raise ExportError(f"SGLang {version} predates 0.5.4.post2: EAGLE-3 aux layer ids from the "
                      "draft config are not supported; upgrade SGLang (>= 0.5.10 for Kimi-K2.5)")


def layer_ids_for(capture_layers: list[int], sglang_version: str | None = None) -> list[int]:
    """Ids to write so that SGLang captures `capture_layers`.

    Without a version, the ids must work on every release; with one, for that release only.
    """
    candidate = [i - 1 for i in capture_layers]
    versions = [sglang_version] if sglang_version else ["0.5.12", "0.5.13"]
    for attempt in (candidate, list(capture_layers)):
        if all(sglang_capture_layers(attempt, v) == list(capture_layers) for v in versions):
            return attempt
    raise ExportError(
        f"no layer ids make every SGLang release capture {capture_layers} (only a first capture "
        "layer of 2 is read the same by 0.5.4.post2-0.5.12 and >= 0.5.13): pass "
        "--sglang-version with the release that will serve the draft"
    )


def describe_layers(layer_ids: list[int]) -> str:
    """Which capture indices each SGLang rule reads from these ids (for logs and reports)."""
    old = sglang_capture_layers(layer_ids, "0.5.12")
    new = sglang_capture_layers(layer_ids, "0.5.13")
    return (f"eagle_aux_hidden_state_layer_ids={layer_ids}: SGLang 0.5.4.post2-0.5.12 captures "
            f"{old}, SGLang >= 0.5.13 captures {new} (index i = residual entering layer i)")


def sglang_config(cfg: DraftConfig, sglang_version: str | None = None) -> dict:
    """config.json of the draft folder: exactly CONFIG_KEYS."""
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
        },
    }
    assert set(out) == CONFIG_KEYS
    return out


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the draft folder with its shape (SGLang leaves missing ones random)."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc.weight": (H, 3 * Ht),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
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


def draft_config_from_sglang(config: dict, sglang_version: str = "0.5.13") -> DraftConfig:
    """The DraftConfig of an SGLang draft config.json, captures read as `sglang_version` reads."""
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return DraftConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        capture_layers=sglang_capture_layers(ids, sglang_version),
    )


def load_draft(draft_dir: Path, device: str = "cpu", dtype=torch.float32) -> Eagle3Draft:
    """Load an SGLang draft folder (config.json + model.safetensors) into an Eagle3Draft."""
    draft_dir = Path(draft_dir)
    cfg = draft_config_from_sglang(json.loads((draft_dir / "config.json").read_text()))
    draft = Eagle3Draft(cfg)
    state = load_file(str(draft_dir / "model.safetensors"))
    draft.load_state_dict(state, strict=True)
    return draft.to(device=device, dtype=dtype).eval()
