"""Flags of the patched SGLang server stage 02b dumps hidden states from.

Server flags are the keys of SGLang's `/server_info` answer (the `ServerArgs` field names, plus
`version`). Each flag refused here makes the dump silently incomplete or wrong.
"""

from __future__ import annotations

from eagle3.core.preflight import Problem


def check_dump_server(info: dict) -> list[Problem]:
    """Flags of a patched SGLang server used to dump hidden states (stage 02b)."""
    problems = []

    def err(msg):
        problems.append(Problem("error", msg))

    if not info.get("disable_radix_cache"):
        err("radix cache is on: cached prefixes are not recomputed, so their states would be "
            "missing. Start the server with --disable-radix-cache")
    if info.get("enable_mixed_chunk"):
        err("--enable-mixed-chunk is on: chunks run in MIXED passes are not dumped. Remove it")
    if info.get("speculative_algorithm"):
        err(f"a speculative draft is loaded ({info['speculative_algorithm']}): target-verify "
            "passes would mix with prefill. Start the dump server without --speculative-*")
    if (info.get("pp_size") or 1) > 1:
        err("pipeline parallelism is on: no rank sees the final state of every layer. Use plain "
            "TP (--pp-size 1)")
    if info.get("enable_two_batch_overlap"):
        err("two-batch overlap splits batches. Remove --enable-two-batch-overlap")
    if info.get("allow_auto_truncate"):
        err("--allow-auto-truncate would cut prompts silently. Remove it")
    # Prefill CUDA graph replays rebuild the batch without request ids: nothing gets dumped.
    if "cuda_graph_backend_prefill" in info:
        if info["cuda_graph_backend_prefill"] not in ("disabled", None):
            err("prefill CUDA graphs are on (cuda_graph_backend_prefill="
                f"{info['cuda_graph_backend_prefill']!r}): start the server with "
                "--cuda-graph-backend-prefill disabled")
    elif "disable_piecewise_cuda_graph" in info and not info["disable_piecewise_cuda_graph"]:
        err("piecewise (prefill) CUDA graphs are on: start the server with "
            "--disable-piecewise-cuda-graph")
    if not info.get("skip_server_warmup", True):
        problems.append(Problem("warning", "server warmup is on; its requests are ignored by the "
                                           "dump (rid prefix), --skip-server-warmup saves time"))
    return problems
