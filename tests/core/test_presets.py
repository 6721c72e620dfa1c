"""The preset table: exact keys, and the tiny entries equal to the targets they name."""

from __future__ import annotations

import pytest

from eagle3.core.presets import PRESETS, check_target, draft_fields, get_preset
from eagle3.core.target import read_target_info
from eagle3.tiny.target import TinyTargetConfig, make_tiny_target
from eagle3.train.config import TrainConfig, draft_shape


def test_get_preset_refuses_a_name_when_it_is_not_an_exact_key():
    assert get_preset("kimi-k2.5").draft.head_dim == 128
    with pytest.raises(ValueError, match="kimi-k2.5"):
        get_preset("Kimi-K2.5")


@pytest.mark.parametrize("name,arch", [("tiny-deepseek-v3", "deepseek_v3"),
                                       ("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_tiny_preset_is_the_draft_04_derives_when_given_the_tiny_target(tmp_path, name, arch):
    target = make_tiny_target(tmp_path / "t", TinyTargetConfig(arch=arch))
    info = read_target_info(target)
    check_target(name, info.hidden_size, info.num_hidden_layers, info.vocab_size)
    derived = draft_shape(TrainConfig(target=target), info)
    assert derived == draft_shape(TrainConfig(target=target, preset=name), info)
    assert derived == PRESETS[name].draft


def test_preset_refuses_a_target_when_its_config_is_another_model(tmp_path):
    target = make_tiny_target(tmp_path / "t", TinyTargetConfig())
    info = read_target_info(target)
    with pytest.raises(ValueError, match="--preset kimi-k2.5"):
        draft_shape(TrainConfig(target=target, preset="kimi-k2.5"), info)


def test_draft_fields_give_the_published_kimi_draft_with_sglangs_default_captures():
    f = draft_fields("kimi-k2.5")
    assert (f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"],
            f["intermediate_size"], f["capture_layers"]) == (64, 64, 128, 12288, [2, 30, 58])
