"""Draft check: Kimi-K2.5-shaped drafts (real shapes, sparse files); every wrong folder is refused
with a message that names the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from eagle3.core.preflight import PreflightError
from eagle3.core.presets import draft_fields
from eagle3.draft.check import check_draft, check_vocab_coverage, load_t2d, read_tensor_shapes
from eagle3.draft.export import export_sglang
from eagle3.draft.model import DraftConfig, Eagle3Draft

# Kimi-K2.5: hidden 7168, vocab 163840, 61 layers -> captures [2, 30, 58]; the draft of
# `04_train.py --preset kimi-k2.5` (64 heads x 128, MLP 12288), a 32000-id draft vocabulary.
KIMI = DraftConfig(**draft_fields("kimi-k2.5"), max_position_embeddings=262144)
KIMI_CAPTURES = [2, 30, 58]
DTYPE_BYTES = {"BF16": 2, "I64": 8, "BOOL": 1, "I32": 4}


def kimi_config() -> dict:
    from eagle3.draft.export import sglang_config

    return sglang_config(KIMI)


def kimi_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    from eagle3.draft.export import expected_tensors

    out = {n: ("BF16", s) for n, s in expected_tensors(KIMI).items()}
    out.update(d2t=("I64", (32000,)), t2d=("BOOL", (163840,)))
    return out


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]):
    """A valid safetensors file with real shapes whose data is a hole (no disk, no RAM):
    the 2.4 GB Kimi-shaped draft costs a few KB."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def make_draft(tmp_path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or kimi_config()))
    write_sparse_safetensors(d / "model.safetensors", tensors or kimi_tensors())
    return d


def errors(problems) -> list[str]:
    return [p.message for p in problems if p.level == "error"]


def check_kimi(draft: Path, version: str | None = None):
    return check_draft(draft, target_hidden_size=7168, target_vocab_size=163840,
                       expected_captures=KIMI_CAPTURES, sglang_version=version)


def test_check_draft_passes_when_kimi_draft_is_right(tmp_path):
    draft = make_draft(tmp_path)
    assert read_tensor_shapes(draft)["fc.weight"] == ("BF16", (7168, 21504))
    for version in (None, "0.5.10", "0.5.13", "0.5.23"):
        assert check_kimi(draft, version) == []


def test_check_draft_agrees_with_an_exported_draft_when_read_from_headers(tmp_path):
    cfg = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=48, vocab_size=300, draft_vocab_size=40,
                      target_hidden_size=24, capture_layers=[2, 3, 4])
    draft = export_sglang(Eagle3Draft(cfg), tmp_path / "exported")
    shapes = read_tensor_shapes(draft)
    assert {n: s for n, (_, s) in shapes.items()} == {
        n: tuple(t.shape) for n, t in Eagle3Draft(cfg).state_dict().items()}
    assert check_draft(draft, 24, 300, [2, 3, 4]) == []


def test_check_draft_refuses_fc_when_it_is_7168_wide_for_a_7168_target(tmp_path):
    tensors = kimi_tensors()
    tensors["fc.weight"] = ("BF16", (7168, 7168))
    (msg,) = errors(check_kimi(make_draft(tmp_path, tensors=tensors)))
    assert "[7168, 7168]" in msg and "one hidden state" in msg and "[7168, 21504]" in msg
    assert "04_train.py" in msg


def test_check_draft_refuses_fc_when_config_names_another_target(tmp_path):
    config = kimi_config()
    config["target_hidden_size"] = 4096
    (msg,) = errors(check_kimi(make_draft(tmp_path, config=config)))
    assert "target_hidden_size=4096" in msg and "7168" in msg


@pytest.mark.parametrize("name", ["midlayer.mlp.up_proj.weight", "midlayer.hidden_norm.weight",
                                  "lm_head.weight", "d2t"])
def test_check_draft_refuses_when_a_weight_is_missing(tmp_path, name):
    tensors = kimi_tensors()
    del tensors[name]
    (msg,) = errors(check_kimi(make_draft(tmp_path, tensors=tensors)))
    assert repr(name) in msg and "missing" in msg and "randomly initialised" in msg
    assert "export_sglang" in msg


def test_check_draft_names_the_misnamed_copy_when_a_prefix_is_added(tmp_path):
    tensors = kimi_tensors()
    tensors["model.norm.weight"] = tensors.pop("norm.weight")
    problems = check_kimi(make_draft(tmp_path, tensors=tensors))
    (msg,) = errors(problems)
    assert "'norm.weight'" in msg and "model.norm.weight" in msg
    assert any(p.level == "warning" and "skips them silently" in p.message for p in problems)


def test_check_draft_refuses_a_weight_when_its_shape_is_wrong(tmp_path):
    tensors = kimi_tensors()
    tensors["midlayer.self_attn.q_proj.weight"] = ("BF16", (8192, 7168))  # 1H input, not 2H
    (msg,) = errors(check_kimi(make_draft(tmp_path, tensors=tensors)))
    assert "[8192, 7168]" in msg and "[8192, 14336]" in msg


def test_check_draft_refuses_d2t_when_its_length_differs_from_draft_vocab(tmp_path):
    tensors = kimi_tensors()
    tensors["d2t"] = ("I64", (16384,))
    (msg,) = errors(check_kimi(make_draft(tmp_path, tensors=tensors)))
    assert "d2t has 16384 entries" in msg and "draft_vocab_size is 32000" in msg
    assert "--draft-vocab 32000" in msg


def test_check_draft_refuses_d2t_when_it_is_not_int64(tmp_path):
    tensors = kimi_tensors()
    tensors["d2t"] = ("I32", (32000,))
    (msg,) = errors(check_kimi(make_draft(tmp_path, tensors=tensors)))
    assert "int64" in msg and "03_build_vocab_mapping.py" in msg


def test_check_draft_refuses_layer_ids_when_written_as_capture_indices(tmp_path):
    config = kimi_config()
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]
    draft = make_draft(tmp_path, config=config)
    (msg,) = errors(check_kimi(draft))  # no release named: both rules must read [2, 30, 58]
    assert "0.5.4.post2-0.5.12 captures [3, 31, 59]" in msg and "write [1, 29, 57]" in msg
    assert errors(check_kimi(draft, "0.5.12"))
    assert check_kimi(draft, "0.5.13") == []  # right on that release only
    (msg,) = errors(check_kimi(draft, "0.5.11"))
    assert "SGLang 0.5.11 captures [3, 31, 59]" in msg and "write [1, 29, 57]" in msg


def test_check_draft_refuses_layer_ids_when_shifted_by_one_layer(tmp_path):
    config = kimi_config()
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 28, 56]
    (msg,) = errors(check_kimi(make_draft(tmp_path, config=config), "0.5.23"))
    assert "captures [0, 28, 56]" in msg and "trained on captures [2, 30, 58]" in msg


def test_check_draft_refuses_architecture_when_it_is_an_eagle1_draft(tmp_path):
    config = kimi_config()
    config["architectures"] = ["LlamaForCausalLMEagle"]
    (msg,) = errors(check_kimi(make_draft(tmp_path, config=config)))
    assert "LlamaForCausalLMEagle3" in msg


def test_check_draft_refuses_a_folder_when_it_has_no_weights(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(kimi_config()))
    with pytest.raises(PreflightError, match="random weights"):
        check_kimi(d)
    with pytest.raises(PreflightError, match="04_train/final"):
        check_kimi(tmp_path / "nowhere")


def test_check_vocab_coverage_warns_when_draft_vocab_misses_many_tokens(tmp_path):
    t2d = torch.zeros(163840, dtype=torch.bool)
    t2d[:100] = True
    records = [{"input_ids": [5, 6, 500, 7, 900], "loss_mask": [0, 1, 1, 1, 0]},
               {"input_ids": [1, 2, 3, 99999], "loss_mask": [1, 1, 1, 1]}]
    coverage, problems = check_vocab_coverage(t2d.numpy(), records)
    assert coverage == pytest.approx(5 / 7)  # 6, 7, 1, 2, 3 inside; 500, 99999 outside
    assert "71.4%" in problems[0].message and "--draft-vocab" in problems[0].message
    assert check_vocab_coverage(t2d.numpy(), records, threshold=0.7)[1] == []


def test_load_t2d_reads_the_exported_mapping(tmp_path):
    cfg = DraftConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                      intermediate_size=32, vocab_size=50, draft_vocab_size=10,
                      target_hidden_size=16, capture_layers=[2, 3, 4])
    draft = Eagle3Draft(cfg)
    hot = torch.arange(10) * 5
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab_mapping(hot - torch.arange(10), t2d)
    assert load_t2d(export_sglang(draft, tmp_path / "d")).tolist() == t2d.tolist()


def test_preflight_coverage_counts_target_written_eval_tokens_when_there_are_any(tmp_path,
                                                                                caplog):
    import logging

    from eagle3.draft.check import check_draft_for_run
    from eagle3.draft.export import export_sglang
    from eagle3.draft.model import DraftConfig, Eagle3Draft

    cfg = DraftConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                      intermediate_size=32, vocab_size=40, draft_vocab_size=8,
                      target_hidden_size=16, capture_layers=[2, 4, 5])
    draft = Eagle3Draft(cfg)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[:8] = True
    draft.set_vocab_mapping(torch.zeros(8, dtype=torch.int64), t2d)
    export_sglang(draft, tmp_path / "draft")
    inside, outside = 3, 30
    (tmp_path / "01c_merged").mkdir()
    recs = [{"id": "chat/0", "source": "chat", "finish_reason": "stop",
             "input_ids": [inside, outside], "loss_mask": [1, 1]},
            {"id": "tools/0", "source": "tools", "finish_reason": "dataset",
             "input_ids": [inside] * 8, "loss_mask": [1] * 8}]
    (tmp_path / "01c_merged/eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    caplog.set_level(logging.INFO)
    problems, _ = check_draft_for_run(tmp_path / "draft", None, tmp_path)
    assert "covers 50.0% of target-written supervised eval tokens" in caplog.text
    assert any("50.0%" in p.message for p in problems)  # below 90 %: warned
