"""The project's dump hook inside the real SGLang server (CPU, float32), on every tiny target: the
DeepSeek-V3 of both latent widths (deepseek_v2.py), the Llama (llama.py) and the Qwen2 (qwen2.py).
Every dump equals the HF hidden states state by state, also for prompts prefilled in several
chunks and for requests that share a prefill pass; the patch, applied and reverted by its CLI,
leaves SGLang's files byte-identical. SGLang release and flags: tests/sglang_helpers.py; servers:
tests/sglang/conftest.py."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from sglang_helpers import (
    assert_bf16_close,
    file_sha256,
    get_json,
    hf_states,
    log_problems,
    patch_cli,
    post_generate,
    recorded_sha256,
    tree_sha256,
)

from eagle3.core.target import default_capture_layers
from eagle3.extract.sglang_dump import dump_file_path, load_dump

# Short prompts share a prefill pass (chunk budget 8 tokens); long ones take 3 and 5 chunks.
LENGTHS = [3, 4, 2, 21, 37, 5]


@pytest.fixture(scope="module")
def hf_model(sglang_server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sglang_server.target,
                                                dtype=torch.float32).eval()


def test_patch_cli_reverts_leaving_sglang_byte_identical(patched_sglang):
    package, model_files = patched_sglang.package_dir, patched_sglang.model_files
    assert set(model_files) == {"srt/models/deepseek_v2.py", "srt/models/qwen2.py",
                                "srt/models/llama.py"}
    # patched by the session fixture (`python -m eagle3.extract.patching --sglang-dir ...`)
    for rel in model_files:
        assert file_sha256(package / rel) != patched_sglang.pristine[rel], rel
    assert patch_cli(package, "--revert").returncode == 0
    try:
        assert tree_sha256(package) == patched_sglang.pristine  # the backups are gone too
        for rel in model_files:
            assert patched_sglang.pristine[rel] == recorded_sha256(package, rel), rel
        assert patch_cli(package, "--check").returncode == 1  # unpatched
    finally:
        assert patch_cli(package).returncode == 0  # the servers of this session need it


def test_dumps_equal_hf_states_when_prompts_are_chunked_and_share_passes(sglang_server,
                                                                         hf_model):
    info = get_json(sglang_server.url, "/server_info")
    assert info["chunked_prefill_size"] == 8 and info["dtype"] == "float32"
    gen = torch.Generator().manual_seed(len(sglang_server.name))
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in LENGTHS]
    rids = [f"eagle3-dump-{sglang_server.name}-{i}" for i in range(len(prompts))]
    log_start = sglang_server.log.stat().st_size
    with ThreadPoolExecutor(len(prompts)) as pool:  # all in flight at once
        answers = list(pool.map(lambda a: post_generate(sglang_server.url, {
            "input_ids": a[0], "rid": a[1], "sampling_params": {"max_new_tokens": 1}}),
            zip(prompts, rids)))
    H = hf_model.config.hidden_size
    layers = default_capture_layers(hf_model.config.num_hidden_layers)
    for ids, rid, answer in zip(prompts, rids, answers):
        assert answer["meta_info"]["id"] == rid and answer["meta_info"]["cached_tokens"] == 0
        path = dump_file_path(sglang_server.dump_dir, rid)
        dump = load_dump(path)
        path.unlink()
        assert dump["input_ids"].tolist() == ids and dump["capture_layers"] == layers
        states, final = hf_states(hf_model, ids)
        for k, layer in enumerate(layers):
            assert_bf16_close(dump["aux_hidden_states"][:, k * H:(k + 1) * H], states[layer],
                              f"{rid} ({len(ids)} tokens) capture {layer}")
        assert_bf16_close(dump["final_hidden_states"], final, f"{rid} final")
    # The server did chunk and batch them: a pass with several new requests, and the 37-token
    # prompt in 5 passes of at most 8 tokens.
    passes = [(int(m[1]), int(m[2])) for m in re.finditer(
        r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)",
        sglang_server.log.read_bytes()[log_start:].decode(errors="replace"))]
    assert max(seqs for seqs, _ in passes) >= 2, passes
    assert max(tokens for _, tokens in passes) <= 8 and len(passes) >= sum(LENGTHS) / 8, passes


def test_server_calls_no_stand_in_and_runs_the_hook_in_its_class(sglang_server):
    # and, for a DeepSeek target, the MLA fix (sglang_helpers.log_problems)
    assert log_problems(sglang_server.log, sglang_server.served) == []
