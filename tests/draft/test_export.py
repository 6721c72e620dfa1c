"""The SGLang draft folder: exact config keys, tensor names and shapes, and layer ids."""

from __future__ import annotations

import json

from safetensors import safe_open

from eagle3.core.presets import draft_fields
from eagle3.draft.export import CONFIG_KEYS, expected_tensors, export_sglang, load_draft
from eagle3.draft.model import DraftConfig, Eagle3Draft

PIPELINE_CONFIG_KEYS = {  # docs/PIPELINE.md, "Draft checkpoint"
    "architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
    "num_hidden_layers", "tie_word_embeddings", "draft_vocab_size", "target_hidden_size",
    "eagle_config"}
# Needed by transformers' AutoConfig / SGLang's LlamaMLP beyond the docs/PIPELINE.md list.
LOADER_KEYS = {"model_type", "hidden_act", "torch_dtype"}


def _kimi_cfg(**kw) -> DraftConfig:
    base = draft_fields("kimi-k2.5")
    base.update(kw)
    return DraftConfig(**base)


def test_expected_tensors_at_kimi_dimensions_have_the_sglang_shapes():
    t = expected_tensors(_kimi_cfg())
    assert t["fc.weight"] == (7168, 3 * 7168)
    assert t["midlayer.self_attn.q_proj.weight"] == (64 * 128, 2 * 7168)
    assert t["midlayer.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert t["lm_head.weight"] == (32000, 7168)
    assert t["d2t"] == (32000,) and t["t2d"] == (163840,)


def test_export_has_exactly_the_pipeline_keys_and_tensors(tmp_path):
    cfg = _kimi_cfg(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, vocab_size=500, draft_vocab_size=100,
                    target_hidden_size=64, capture_layers=[2, 4, 5])
    draft = Eagle3Draft(cfg)
    export_sglang(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) == CONFIG_KEYS == PIPELINE_CONFIG_KEYS | LOADER_KEYS
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 500 and config["draft_vocab_size"] == 100
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                      "use_aux_hidden_state": True,
                                      "trained_capture_layers": [2, 4, 5]}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("d2t").dtype.is_floating_point is False
    assert shapes == expected_tensors(cfg)  # nothing missing, nothing extra
    assert not any("embed" in k for k in shapes)
    back = load_draft(tmp_path)
    assert back.cfg.capture_layers == [2, 4, 5]


def test_demo_exports_every_expected_tensor_and_nothing_else(demo_run):
    from eagle3.draft.export import draft_config_from_sglang
    from eagle3.draft.speculators import speculators_name

    final = demo_run / "04_train/final"
    cfg = draft_config_from_sglang(json.loads((final / "config.json").read_text()))
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == expected_tensors(cfg)
    with safe_open(str(demo_run / "04_train/final_speculators/model.safetensors"), "pt") as f:
        spec = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert spec == {speculators_name(k): v for k, v in expected_tensors(cfg).items()}
