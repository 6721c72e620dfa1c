"""benchmarks/bench_sglang_gpu.py's own pieces, without a GPU or a server: the state comparison
its dump phase reports, the Kimi-width target and MLA draft its kimi phase serves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config

from eagle3.core.target import default_capture_layers
from eagle3.draft.layers import sglang_capture_layers

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_sglang_gpu",
                                               ROOT / "benchmarks/bench_sglang_gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def _write(folder: Path, states: list[torch.Tensor]) -> None:
    folder.mkdir(parents=True)
    torch.save({"input_ids": torch.arange(states[0].shape[0]), "hidden_states": states},
               folder / "data_0.pt")


def test_compare_states_gives_the_worst_and_mean_relative_l2_error_by_hand(tmp_path):
    ref = [torch.tensor([[3.0, 4.0], [1.0, 0.0]])] * 4
    got = [torch.tensor([[3.0, 4.5], [1.0, 0.0]])] * 3 + [torch.tensor([[3.0, 4.0], [0.0, 1.0]])]
    _write(tmp_path / "a", ref)
    _write(tmp_path / "b", got)
    out = gpu.compare_states(tmp_path / "a", tmp_path / "b")
    # rows: |(0, 0.5)| / 5 = 0.1 and 0; the last state: 0 and |(-1, 1)| / 1 = sqrt(2)
    assert out["files"] == 1 and out["tokens"] == 2
    assert out["worst_rel_l2"] == pytest.approx([0.1, 0.1, 0.1, 2 ** 0.5])
    assert out["mean_rel_l2"] == pytest.approx([0.05, 0.05, 0.05, 2 ** 0.5 / 2])


def test_compare_states_refuses_files_of_other_prompts(tmp_path):
    _write(tmp_path / "a", [torch.ones(2, 2)] * 4)
    _write(tmp_path / "b", [torch.ones(3, 2)] * 4)
    with pytest.raises(AssertionError):
        gpu.compare_states(tmp_path / "a", tmp_path / "b")


def test_kimi_width_target_and_mla_draft_name_the_same_captures(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "run", lambda cmd, log_path, **kw: 0.0)  # no tiny target build
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "tokenizer.json").write_text("{}")
    target = gpu.kimi_target(tmp_path)
    config = json.loads((target / "config.json").read_text())
    hf = DeepseekV3Config(**{k: v for k, v in config.items() if k != "architectures"})
    assert (hf.hidden_size, hf.kv_lora_rank + hf.qk_rope_head_dim, hf.vocab_size) == (
        7168, 576, 163840)
    assert config["rope_parameters"]["factor"] == 1.0 and config["moe_layer_freq"] == 1
    assert (target / "tokenizer.json").exists()
    captures = default_capture_layers(hf.num_hidden_layers)
    draft = json.loads((gpu.mla_draft(target, tmp_path / "draft") / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers(ids, "0.5.17") == captures
