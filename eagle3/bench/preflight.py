"""Preflight checks of the two servers stage 05 compares (the draft folder: eagle3/draft/check.py).

Each check returns a list of Problems (error or warning, each naming the flag or file and the
fix); `raise_on_errors` turns errors into one PreflightError. Server flags are the keys of
SGLang's `/server_info` answer (the `ServerArgs` field names, plus `version`).

- `check_speculative_server` / `check_baseline_server`: the two servers stage 05 compares.
  `--speculative-algorithm EAGLE` with an EAGLE-3 draft starts and serves without a warning, but
  the target captures no aux states, the draft's `fc` is skipped and `d2t` ignored: acceptance
  collapses to about 1 (docs/PIPELINE.md).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.core.preflight import Problem
from eagle3.draft.check import is_eagle3_draft


def check_speculative_server(info: dict, draft_config: dict | None = None,
                             draft_dir: Path | None = None) -> list[Problem]:
    """The speculative server of a benchmark: EAGLE3 for an EAGLE-3 draft, sane chain flags."""
    problems = []
    algo = info.get("speculative_algorithm")
    eagle3 = draft_config is None or is_eagle3_draft(draft_config)
    if not algo:
        problems.append(Problem("error", "the server runs no speculative decoding "
                                "(speculative_algorithm None): a plain server, where a "
                                "speculative one belongs. Start it with "
                                "--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                                "<draft>, or give it as the baseline"))
    elif eagle3 and algo != "EAGLE3":
        effect = (" — it starts fine, but the target captures no aux states, the draft gets one "
                  "hidden state instead of three, fc is skipped and d2t ignored: acceptance "
                  "collapses to about 1" if algo == "EAGLE" else "")
        problems.append(Problem("error", f"speculative_algorithm={algo!r} with an EAGLE-3 draft"
                                f"{effect}. Restart the server with "
                                "--speculative-algorithm EAGLE3"))
    served = info.get("speculative_draft_model_path")
    if draft_dir is not None and served and Path(served).name != Path(draft_dir).name:
        problems.append(Problem("warning", f"the server serves the draft {served}, the check "
                                f"read {draft_dir}: make sure they are the same files"))
    if info.get("disable_cuda_graph"):
        problems.append(Problem("warning", "CUDA graphs are off (--disable-cuda-graph): every "
                                "draft step pays kernel-launch overhead and speculative decoding "
                                "can end up slower than no draft. Remove the flag"))
    steps, topk = info.get("speculative_num_steps"), info.get("speculative_eagle_topk")
    tokens = info.get("speculative_num_draft_tokens")
    if topk == 1 and steps and tokens and tokens != steps + 1:
        problems.append(Problem("warning", f"a chain (--speculative-eagle-topk 1) of {steps} steps "
                                f"verifies {steps + 1} tokens, the server says "
                                f"--speculative-num-draft-tokens {tokens}: set it to {steps + 1}"))
    return problems


# Server settings that change decoding speed on their own: a benchmark whose two servers differ
# in any of them does not measure the draft alone.
SPEED_KEYS = ("model_path", "tp_size", "dp_size", "ep_size", "quantization", "dtype",
              "kv_cache_dtype", "attention_backend", "disable_cuda_graph", "cuda_graph_max_bs",
              "mem_fraction_static", "max_running_requests", "chunked_prefill_size",
              "context_length", "enable_dp_attention")


def check_server_pair(baseline: dict, speculative: dict) -> list[Problem]:
    """Warnings for settings (other than the draft) in which the two servers differ."""
    diff = {k: (baseline.get(k), speculative.get(k)) for k in SPEED_KEYS
            if baseline.get(k) != speculative.get(k)}
    if not diff:
        return []
    listed = ", ".join(f"{k}: {b!r} vs {s!r}" for k, (b, s) in diff.items())
    return [Problem("warning", f"the baseline and speculative servers differ in more than the "
                               f"draft ({listed}): the speedup does not measure the draft alone. "
                               "Start both with the same flags")]


def check_streaming(info: dict) -> list[Problem]:
    """A benchmark that streams (for TTFT) wants deltas, not the whole output in every chunk."""
    if info.get("incremental_streaming_output"):
        return []
    return [Problem("warning", "the server streams cumulative output ids: every chunk re-sends "
                               "the whole reply (bytes grow with the square of its length), "
                               "which can make the benchmark client the bottleneck for long "
                               "replies at high concurrency. Start it with "
                               "--incremental-streaming-output (05 adds it to servers it "
                               "launches)")]


def check_baseline_server(info: dict) -> list[Problem]:
    """The baseline of a benchmark decodes without a draft."""
    algo = info.get("speculative_algorithm")
    if algo:
        return [Problem("error", f"the baseline server runs speculative decoding ({algo}): "
                                 "start it without --speculative-* flags")]
    return []
