"""eagle3/targets/gguf.py on a qwen2 GGUF written from the tiny qwen2 target
(tests/gguf_helpers.py: F32 tensors under GGUF names, the tokenizer as `tokenizer.ggml.*`):
the converted folder computes the tiny target's forward and tokenizes, renders and stops as it
does. Qwen2.5-Coder's own 1.1 GB GGUF goes the same way (docs/PIPELINE.md, "A real small
target")."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3.targets import gguf as converter
from eagle3.targets.packaged import PackagedTarget, PackagedTargetError

PROBES = [
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "x = 1000 + 23; it's caf\u0065\u0301 (decomposed) and caf\u00e9  \t\n\n  done",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_start|><|endoftext|>[PAD]",
]


@pytest.fixture(scope="module")
def qwen2_gguf(qwen2_target_dir, tmp_path_factory):
    from gguf_helpers import packaged, write_qwen2_gguf

    path = write_qwen2_gguf(qwen2_target_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, packaged(path)


@pytest.fixture(scope="module")
def converted(qwen2_gguf, tmp_path_factory):
    path, target = qwen2_gguf
    out = tmp_path_factory.mktemp("converted") / "target"
    converter.convert(path, out, target)
    return out


def _model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_converted_weights_are_the_tiny_targets_in_bf16_biases_and_untied_head_included(
        converted, qwen2_target_dir):
    want, got = _model(qwen2_target_dir).state_dict(), _model(converted).state_dict()
    assert set(got) == set(want)
    assert any(k.endswith("q_proj.bias") for k in got) and "lm_head.weight" in got
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(torch.bfloat16).float()), name
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    config = json.loads((converted / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"], config["num_key_value_heads"],
            config["rope_parameters"]["rope_theta"]) == ("qwen2", False, 2, 1000000.0)
    assert "quantization_config" not in config and "_model_name_or_path" not in config


def test_converted_model_computes_the_tiny_targets_forward(converted, qwen2_target_dir):
    reference = _model(qwen2_target_dir)
    with torch.no_grad():  # the reference's weights rounded as the folder stores them
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = _model(converted)
    ids = torch.arange(3, 500, 7)[None]
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # the GGUF's rms_norm_eps is 1e-6 in float32 (9.99999997e-07): a last-bit difference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_converted_tokenizer_tokenizes_renders_and_stops_as_the_tiny_targets(
        converted, qwen2_target_dir):
    from eagle3.core.target import load_tokenizer

    want, got = load_tokenizer(qwen2_target_dir), load_tokenizer(converted)
    assert len(got) == len(want)
    for text in PROBES:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(got.encode(text)) == want.decode(want.encode(text))
    assert {i: (t.content, t.special) for i, t in got.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in want.added_tokens_decoder.items()}
    for name in ("eos_token", "pad_token", "bos_token", "unk_token"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Write a function."},
                {"role": "assistant", "content": "def f(): pass"}, {"role": "user", "content": "?"}]
    assert got.chat_template == want.chat_template
    assert (got.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == want.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    config = json.loads((converted / "config.json").read_text())
    generation = json.loads((converted / "generation_config.json").read_text())
    ids = {k: getattr(got, f"{k}_id") for k in ("bos_token", "eos_token", "pad_token")}
    for k, token_id in ids.items():
        assert config[f"{k}_id"] == generation[f"{k}_id"] == token_id, k
    leftovers = set(json.loads((converted / "tokenizer_config.json").read_text()))
    assert not leftovers & set(converter.READER_LEFTOVERS)


def test_the_manifest_records_the_gguf_and_every_file(converted, qwen2_gguf):
    from eagle3.targets.packaged import sha256_of

    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["gguf_sha256"] == qwen2_gguf[1].sha256
    assert manifest["files"] == {p.name: sha256_of(p) for p in sorted(converted.iterdir())
                                 if p.name != "manifest.json"}


def _other(target: PackagedTarget, **changes) -> PackagedTarget:
    return PackagedTarget(**{**target.__dict__, **changes})


def test_a_gguf_whose_eos_is_not_the_end_of_turn_is_refused(qwen2_gguf, tmp_path):
    path, target = qwen2_gguf
    with pytest.raises(PackagedTargetError, match=r"eos is '<\|im_end\|>', not the end of turn"):
        converter.convert(path, tmp_path / "t", _other(target, end_of_turn="[EOS]"))
    assert not (tmp_path / "t").exists()


def test_a_folder_unlike_the_table_is_refused_before_it_is_renamed_into_place(qwen2_gguf,
                                                                               tmp_path):
    path, target = qwen2_gguf
    wrong = _other(target, config={**target.config, "num_key_value_heads": 4,
                                   "tie_word_embeddings": True})
    with pytest.raises(PackagedTargetError, match="num_key_value_heads: 2, expected 4.*"
                                                  "tie_word_embeddings: False, expected True"):
        converter.convert(path, tmp_path / "t", wrong)
    assert not (tmp_path / "t").exists()


def test_build_target_converts_once_and_refuses_a_folder_of_another_gguf(
        qwen2_gguf, converted, tmp_path, monkeypatch):
    from eagle3.targets import packaged

    path, target = qwen2_gguf
    monkeypatch.setitem(packaged.PACKAGED_TARGETS, target.name, target)
    out = tmp_path / "target"
    shutil.copytree(converted, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert converter.build_target(target.name, out, path) == out  # complete: a no-op
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    monkeypatch.setitem(packaged.PACKAGED_TARGETS, target.name,
                        _other(target, sha256="0" * 64))
    with pytest.raises(PackagedTargetError, match="holds the folder of another GGUF"):
        converter.build_target(target.name, out)
    assert converter.main(["--target", "smollm2-135m", "--out", str(out)]) == 2


def test_a_tokenizer_read_as_5_17_reads_it_says_what_the_gguf_says(
        qwen2_gguf, tmp_path, monkeypatch):
    """5.17 (the GPU machine's) reads Qwen2.5-Coder's GGUF with eos `<|endoftext|>`, no bos,
    and writes `eos_token_id` / `model_type: gpt2` into tokenizer_config.json (measured on the
    real GGUF); the folder must still say the GGUF's tokens."""
    from transformers import AutoTokenizer

    read = AutoTokenizer.from_pretrained

    def as_5_17(*args, **kwargs):
        tok = read(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.eos_token, tok.bos_token, tok.pad_token = "<|endoftext|>", None, None
            tok.init_kwargs.update(eos_token_id=tok.eos_token_id, model_type="gpt2")
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", as_5_17)
    path, target = qwen2_gguf
    converter.convert(path, tmp_path / "t", target)
    monkeypatch.undo()
    tok = AutoTokenizer.from_pretrained(tmp_path / "t")
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "[BOS]", "[PAD]")
    saved = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    assert "eos_token_id" not in saved and "model_type" not in saved


def test_a_conversion_parses_the_gguf_once_and_writes_the_bytes_of_one_that_does_not(
        qwen2_gguf, converted, tmp_path, monkeypatch):
    import contextlib

    import gguf

    parses = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    path, target = qwen2_gguf
    converter.convert(path, tmp_path / "shared", target)
    assert len(parses) == 1
    monkeypatch.setattr(converter, "one_parse", lambda *a, **k: contextlib.nullcontext())
    converter.convert(path, tmp_path / "plain", target)
    assert len(parses) > 2  # the converter's own read and transformers' (tokenizer, config, weights)
    files = [json.loads((tmp_path / d / "manifest.json").read_text())["files"]
             for d in ("shared", "plain")]
    assert files[0] == files[1] == json.loads((converted / "manifest.json").read_text())["files"]


def test_dequantized_ahead_are_gguf_s_own_arrays_in_any_order_and_other_calls_pass_through(
        tmp_path):
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for i in range(7):
        data = rng.standard_normal((4 + i, 64)).astype(np.float32)
        writer.add_tensor(f"t{i}", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader(path)
    want = [gguf.dequantize(t.data, t.tensor_type) for t in plain.tensors]
    with converter.one_parse(path, workers=2) as reader:
        assert gguf.GGUFReader(path) is reader
        assert gguf.GGUFReader(path, "r") is not reader  # other arguments: a reader of its own
        order = [0, 1, 2, 5, 3, 6, 4]  # ahead, then out of the order it dequantizes in
        got = {i: gguf.dequantize(reader.tensors[i].data, reader.tensors[i].tensor_type)
               for i in order}
        again = gguf.dequantize(reader.tensors[2].data, reader.tensors[2].tensor_type)
        other = gguf.dequantize(plain.tensors[3].data, plain.tensors[3].tensor_type)
    for i, w in enumerate(want):
        assert got[i].dtype == w.dtype and np.array_equal(got[i], w)
    assert np.array_equal(again, want[2]) and np.array_equal(other, want[3])
    assert gguf.GGUFReader(path) is not reader  # closed: gguf's own again
