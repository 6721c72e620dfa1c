"""The tiny DeepSeek-V3 targets carry the config fields the serving engines read
(eagle3/tiny/archs.py: `deepseek_v3_serving_fields`), and transformers computes the same model
with them as without them."""

from __future__ import annotations

import pytest
import torch

from eagle3.tiny.archs import deepseek_v3_serving_fields
from eagle3.tiny.target import TinyTargetConfig, build_model


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_vllm"])
def test_serving_fields_leave_the_transformers_forward_unchanged(arch):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = TinyTargetConfig(arch=arch)
    model = build_model(cfg, vocab_size=554)
    fields = deepseek_v3_serving_fields(cfg.max_position_embeddings)
    for key, value in fields.items():
        assert getattr(model.config, key) == value
    plain = model.config.to_dict()
    for key in fields:
        plain.pop(key)
    plain_cfg = DeepseekV3Config(**plain)  # transformers' defaults: plain RoPE, no routing keys
    assert plain_cfg.rope_parameters["rope_type"] == "default"
    without = DeepseekV3ForCausalLM(plain_cfg).eval()
    without.load_state_dict(model.state_dict())
    ids = torch.arange(5, 300, 3)[None]
    with torch.no_grad():
        got, want = model(ids).logits, without(ids).logits
    # YaRN at factor 1 has plain RoPE's frequencies up to float32 rounding of its blend
    # (measured: exact with 8 rope dims, 1.7e-6 on logits ~1 with 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
