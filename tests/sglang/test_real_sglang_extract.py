"""Stage 02b against the real patched SGLang server (CPU, float32) on every tiny target of
tests/sglang/conftest.py (DeepSeek-V3 of both latent widths through the hook in deepseek_v2.py,
Llama through llama.py, Qwen2 through qwen2.py): `--backend sglang` writes the files `--backend hf` writes, file by file and state
by state, for records with ids a rid must escape and lengths from 1 to 130 tokens (up to 17
chunks of the server's 8-token prefill budget, several requests in flight)."""

from __future__ import annotations

import json

import pytest
import torch
from extract_helpers import STAGE, copy_merged, data_files, main_02b, write_merged
from sglang_helpers import assert_bf16_close


@pytest.fixture(scope="module")
def merged(sglang_server, tmp_path_factory):
    # token ids drawn from this target's vocabulary (the tiny targets' sizes differ by arch)
    vocab = json.loads((sglang_server.target / "config.json").read_text())["vocab_size"]
    return write_merged(tmp_path_factory.mktemp("merged") / "w", n_train=6, n_eval=2,
                        vocab=vocab)


def test_extract_sglang_writes_the_hf_backend_files_state_by_state(sglang_server, merged,
                                                                    tmp_path):
    hf = copy_merged(merged, tmp_path / "hf")
    assert main_02b()(["--workdir", str(hf), "--target", str(sglang_server.target), "--backend",
                       "hf", "--max-batch-size", "1"]) == 0
    work = copy_merged(merged, tmp_path / "sglang")
    assert main_02b()(["--workdir", str(work), "--target", str(sglang_server.target),
                       "--server-url", sglang_server.url, "--dump-dir",
                       str(sglang_server.dump_dir), "--verify-against-hf", "2"]) == 0
    files = data_files(work)
    assert files == data_files(hf) and len(files) == 8
    for rel in files:
        got, want = (torch.load(w / STAGE / rel, weights_only=True) for w in (work, hf))
        assert got.keys() == want.keys(), rel
        assert torch.equal(got["input_ids"], want["input_ids"]), rel
        assert torch.equal(got["loss_mask"], want["loss_mask"]), rel
        assert len(got["hidden_states"]) == len(want["hidden_states"]) == 4
        for k, (g, w) in enumerate(zip(got["hidden_states"], want["hidden_states"])):
            assert g.dtype == w.dtype == torch.bfloat16
            # Both are bf16 roundings of float32 states that differ by float32 noise: one bf16
            # step apart at most (sglang_helpers.assert_bf16_close).
            assert_bf16_close(g, w.float(), f"{rel} state {k}")
    manifest = json.loads((work / STAGE / "manifest.json").read_text())
    assert manifest["complete"] and manifest["backend"] == "sglang"
    assert manifest["server"]["flags"]["version"] == "0.5.23"
    report = manifest["verify_against_hf"]
    assert [row["nearest_layer"] for row in report] == [manifest["capture_layers"]] * 2
    assert list(sglang_server.dump_dir.iterdir()) == []  # every dump was picked up
