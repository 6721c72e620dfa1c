"""Stage 05's SGLang client against the real SGLang server (CPU, float32) without a draft, on every
tiny target of tests/sglang/conftest.py (DeepSeek-V3 of both latent widths, Llama, Qwen2): the
server's flags pass the baseline preflight, the
streamed answers parse, the figures are sane (tokens/s > 0, TTFT measured, no acceptance for a
server that decodes without a draft, with the reason), the outputs are lossless (equal at every
concurrency, and equal to transformers' greedy tokens).

A speculative server cannot run here (the torch_native backend has no target-verify or draft
mode; the GPU half of the tests serves drafts), so the same plain server is measured in both of
05's roles: `measure_server` is what `05_benchmark.py --backend sglang` runs for each."""

from __future__ import annotations

import asyncio

import aiohttp
import torch

from eagle3.bench.compare import check_lossless
from eagle3.bench.measure import LoadSettings
from eagle3.bench.preflight import check_baseline_server, check_speculative_server
from eagle3.bench.prompts import PromptSet
from eagle3.bench.sglang import measure_server
from eagle3.core.server import get_server_info

MAX_NEW = 12


def _info(url: str) -> dict:
    async def get():
        async with aiohttp.ClientSession() as session:
            return await get_server_info(session, url)

    return asyncio.run(get())


def test_bench_sglang_measures_a_plain_server_losslessly_with_sane_figures(sglang_server):
    from transformers import AutoModelForCausalLM

    info = _info(sglang_server.url)
    assert check_baseline_server(info) == [] and info["version"] == "0.5.23"
    # as the speculative server of 05 it is refused, naming the flag
    assert "--speculative-algorithm EAGLE3" in str(check_speculative_server(info)[0])
    prompts = PromptSet("p", [[3, 5, 100 + i, 200, 7 + i, 40 * i + 11] for i in range(3)])
    measured = {}
    for role in ("baseline", "speculative"):
        load = LoadSettings({"max_new_tokens": MAX_NEW, "temperature": 0.0}, stream=True,
                            incremental_stream=bool(info.get("incremental_streaming_output")),
                            speculative=role == "speculative", timeout_s=300)
        measured[role] = measure_server(sglang_server.url, role, [prompts], [1, 2], load,
                                        warmup_tokens=2)
    for role, levels in measured.items():
        for c, row in levels["p"].items():
            assert row["requests"] == 3 + (c == "2") and row["failed_requests"] == 0
            assert row["total_tok_s"] > 0 and row["per_request_tok_s"] > 0
            assert row["ttft_mean_s"] is not None and 0 < row["ttft_mean_s"] < row[
                "latency_mean_s"]
            assert 0 < row["completion_tokens"] <= row["requests"] * MAX_NEW
            assert row["acceptance_length"] is None and row["spec_verify_ct"] == 0
            if role == "speculative":  # "-" in the report, with the reason
                assert "report no spec_verify_ct" in row["acceptance_error"]
    mismatches, notes = check_lossless(measured, 0.0)
    assert mismatches == 0, notes
    model = AutoModelForCausalLM.from_pretrained(sglang_server.target,
                                                 dtype=torch.float32).eval()
    outputs = measured["baseline"]["p"]["1"]["outputs"]
    for i, ids in enumerate(prompts.prompts):
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                  do_sample=False)[0, len(ids):].tolist()  # stops at <|im_end|>
        assert outputs[i] == want, i
