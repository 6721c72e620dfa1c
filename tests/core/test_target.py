"""Reading the target's embedding and lm_head rows from a sharded checkpoint through its index."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from dataset_helpers import code_shipping_target
from safetensors.torch import save_file

from eagle3.core import target as target_mod
from eagle3.core.target import TargetError, load_embedding, load_lm_head, read_target_info


def _sharded(tmp_path, prefix: str = ""):
    """A 3-shard checkpoint: embed in shard 1, lm_head in shard 2, and a shard 3 of 'layers'
    that is not even a valid file: loading must never open it."""
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    save_file({f"{prefix}model.embed_tokens.weight": embed,
               f"{prefix}model.layers.0.mlp.weight": torch.ones(4, 4)},
              str(tmp_path / "model-00001-of-00003.safetensors"))
    save_file({f"{prefix}lm_head.weight": head, f"{prefix}model.norm.weight": torch.ones(8)},
              str(tmp_path / "model-00002-of-00003.safetensors"))
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {f"{prefix}model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  f"{prefix}model.layers.0.mlp.weight": "model-00001-of-00003.safetensors",
                  f"{prefix}lm_head.weight": "model-00002-of-00003.safetensors",
                  f"{prefix}model.norm.weight": "model-00002-of-00003.safetensors",
                  f"{prefix}model.layers.1.mlp.weight": "model-00003-of-00003.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return embed, head


def _record_reads(monkeypatch) -> list:
    """Every (file, tensor name, how) read through safetensors."""
    import safetensors

    reads, real_open = [], safetensors.safe_open

    class Recording:
        def __init__(self, path, framework, **kw):
            self.path, self.f = str(path), real_open(path, framework, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            reads.append((self.path.rsplit("/", 1)[-1], name, "whole"))
            return self.f.get_tensor(name)

        def get_slice(self, name):
            reads.append((self.path.rsplit("/", 1)[-1], name, "rows"))
            return self.f.get_slice(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return reads


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_only_the_embedding_and_lm_head_rows_are_read_when_the_checkpoint_is_sharded(
        tmp_path, monkeypatch, prefix):
    embed, head = _sharded(tmp_path, prefix)
    reads = _record_reads(monkeypatch)
    rows = torch.tensor([0, 1, 2, 7, 9, 10, 31, 49])  # runs [0,2], [7], [9,10], [31], [49]
    assert torch.equal(load_lm_head(tmp_path, rows), head[rows])
    assert torch.equal(load_embedding(tmp_path), embed)
    assert reads == [("model-00002-of-00003.safetensors", f"{prefix}lm_head.weight", "rows"),
                     ("model-00001-of-00003.safetensors", f"{prefix}model.embed_tokens.weight",
                      "whole")]


def test_lm_head_rows_must_be_ascending(tmp_path):
    _sharded(tmp_path)
    with pytest.raises(TargetError, match="ascending"):
        load_lm_head(tmp_path, torch.tensor([3, 2]))


def _headless(tmp_path, config: dict | None) -> torch.Tensor:
    """A checkpoint with an embedding and no lm_head, and `config` as its config.json."""
    embed = torch.randn(20, 4)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return embed


@pytest.mark.parametrize("config", [{"tie_word_embeddings": True},
                                    {"text_config": {"tie_word_embeddings": True}}])
def test_a_target_whose_config_ties_its_embeddings_reads_the_embedding_without_a_warning(
        tmp_path, caplog, config):
    """SmolLM2 (the demo's target) ships no lm_head because its config ties it: the normal
    case, logged at INFO, never a WARNING on the demo's happy path."""
    embed = _headless(tmp_path, config)
    with caplog.at_level("INFO", logger="eagle3.core.target"):
        assert torch.equal(load_lm_head(tmp_path, torch.tensor([1, 5])), embed[[1, 5]])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "tied" in caplog.text


def test_a_target_whose_config_does_not_say_it_is_tied_reads_the_embedding_with_a_warning(
        tmp_path, caplog):
    embed = _headless(tmp_path, None)
    with caplog.at_level("INFO", logger="eagle3.core.target"):
        assert torch.equal(load_lm_head(tmp_path, torch.tensor([1, 5])), embed[[1, 5]])
    assert [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_target_whose_config_says_untied_and_has_no_lm_head_is_an_error(tmp_path):
    """Untied and no head: the output head is missing (a cut download), and the embedding is
    not it."""
    _headless(tmp_path, {"tie_word_embeddings": False})
    with pytest.raises(TargetError, match="tie_word_embeddings: false"):
        load_lm_head(tmp_path)


def test_target_info_reads_a_multimodal_wrapper_and_rope_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
        "num_attention_heads": 64, "intermediate_size": 18432,
        "rope_parameters": {"rope_theta": 50000.0}}}))
    info = read_target_info(tmp_path)
    assert (info.hidden_size, info.vocab_size, info.rope_theta) == (7168, 163840, 50000.0)
    assert target_mod.default_capture_layers(info.num_hidden_layers) == [2, 30, 58]


def test_load_tokenizer_runs_the_folder_code_when_the_tokenizer_is_custom(tiny_target_dir,
                                                                          tmp_path):
    """Kimi-K2.5 ships its tokenizer as code (`auto_map`); with the flag it loads as shipped."""
    from eagle3.core.target import load_tokenizer

    folder = code_shipping_target(tiny_target_dir, tmp_path / "custom")
    tok = load_tokenizer(folder, trust_remote_code=True)
    assert type(tok).__name__ == "CustomTokenizer"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith(
        "<|im_assistant|>assistant<|im_middle|>")


def test_target_shipping_code_is_refused_naming_the_flag_when_not_trusted(tiny_target_dir,
                                                                          tmp_path):
    """transformers alone would load a built-in tokenizer class instead, silently."""
    from eagle3.core.target import check_remote_code, load_hf_model, load_tokenizer

    folder = code_shipping_target(tiny_target_dir, tmp_path / "custom")
    (folder / "code_ran").unlink(missing_ok=True)
    (folder / "tokenization_custom.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('code_ran').touch()\n")
    for load in (lambda: load_tokenizer(folder), lambda: check_remote_code(folder, False)):
        with pytest.raises(TargetError, match="pass --trust-remote-code"):
            load()
    load_hf_model(folder)  # the model itself is plain: its loading runs no folder code
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}  # as Kimi-K2.5's
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match="config.json auto_map AutoConfig"):
        load_hf_model(folder)
    assert not (folder / "code_ran").exists()
    check_remote_code(tiny_target_dir, False)  # a plain target needs no flag
    load_tokenizer(tiny_target_dir)
