"""SGLang plugin: DeepSeek MLA under the `torch_native` attention backend always takes the
absorbed (MLA) path, which is right; as shipped, fresh prefill takes an MHA path that is wrong.

Why: SGLang 0.5.23 picks a DeepSeek attention layer's forward method per batch from
`AttentionBackendRegistry` (`sglang.srt.models.deepseek_common.attention_backend_handler`).
`torch_native` has no entry, so it gets the `triton` handler, which sends an extend batch with no
cached prefix (every fresh prefill) to `AttnForwardMethod.MHA`: `forward_normal_prepare` calls the
backend with `save_kv_cache=False` and the latent `k`/`v`, and `TorchNativeAttnBackend`
then attends over the latent KV pool, which holds nothing of this prefill. The result is silently
wrong with a 16-wide latent (aux hidden states off by 0.66 at values of 0.07) and a shape error
with a 576-wide one (Kimi-K2.5's); a later chunk of the same prompt (cached prefix) takes the MLA
path and reads the KV the first chunk never saved. The absorbed path (`AttnForwardMethod.MLA`)
writes the latent KV and attends over it, for prefill, chunked prefill and decode alike; with it
greedy output equals transformers' and the dumps equal the HF hidden states
(tests/sglang/test_real_sglang_dump.py, test_real_sglang_generate.py).

How it loads: `tests/sglang_support/eagle3_sglang_test_support-0.dist-info/entry_points.txt`
declares `register` in SGLang's general plugin group `sglang.srt.plugins`, which SGLang's scheduler
loads (`sglang.srt.plugins.load_plugins`) before it builds the model, in every process that runs
it. SGLang logs a plugin that raises and goes on ("Failed to execute general plugin"), so the
tests check the server log for `LOADED_MARK` and the dumps against transformers.

What would make it go: an SGLang release that registers a `torch_native` handler for DeepSeek
MLA (or whose `triton` fallback saves the KV it attends over). Then delete this file and the
entry point, and the real-SGLang tests must still pass.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND = "torch_native"
LOADED_MARK = "eagle3 test support: DeepSeek MLA forward method registered for torch_native"


def register() -> None:
    """Register the absorbed-MLA dispatch for `torch_native` (SGLang calls this at start-up)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    def handle_attention_torch_native(attn, forward_batch) -> AttnForwardMethod:
        return AttnForwardMethod.MLA

    AttentionBackendRegistry.register(BACKEND, handle_attention_torch_native)
    logger.warning(LOADED_MARK)
