#!/usr/bin/env python3
"""Stage 05: measure the draft — acceptance length, and speed against no draft.

`--backend hf`: chain speculative decoding of the draft against a transformers target (greedy at
temperature 0, checked token for token against plain greedy decoding; speculative sampling
above 0), for each `--steps`. `--backend sglang`: a baseline server (no draft) and one or more
speculative servers (EAGLE3 + this draft, one setting each: several `--spec-url`s, or several
`--spec-args` strings launched one after the other), attached by URL or launched here from
`--launch-args`, measured at each `--concurrency` on each prompt set: tokens/s in total and per
request, TTFT, acceptance length (sum completion_tokens / sum spec_verify_ct), speedup, outputs
against plain beside plain against itself across concurrencies, and the verdict: the fastest
setting at each level and the SGLang flags to serve it, or plain (eagle3/bench/verdict.py).
`--backend vllm`: the same
against a plain and an EAGLE-3 vLLM server (`--speculative-config`, `--steps K` draft tokens;
default draft: the folder 04 wrote for vLLM, `<workdir>/04_train/final_speculators`, or
`final/` for an MLA draft, as 04's manifest says), acceptance from vLLM's `/metrics`
counters, speculative outputs checked against plain ones at temperature 0 (eagle3/bench/vllm.py).
All write
`<workdir>/05_benchmark/results.json`, `report.md` and PNG plots (sglang: `requests.jsonl`
with every request and its output ids, and the server logs when launched here).

Before measuring, and alone with `--check-only`, the preflight reads the draft's config and
safetensors headers (names, shapes, fc width, d2t, layer ids on the SGLang release in use) and
the servers' flags, and refuses what would silently serve garbage (e.g. EAGLE with an EAGLE-3
draft). Prompt sets: `eval` (held-out split), `chat`, `code`, `math`, `tools` (prompts/), or
JSONL paths.

Faults (eagle3/bench/faults.py): a damaged draft file (cut safetensors, a NaN in a weight,
config.json not JSON or lacking keys, d2t of the wrong size) stops 05 naming it before any server
starts, `--check-only` too; bad prompt lines are skipped into `05_benchmark/skipped.jsonl`
(`--max-bad`); a request that fails after `--retries` (5xx, timeout, cut stream, an answer whose
counts cannot be) is listed in `failed_requests.jsonl`, left out of every figure, and makes the
exit code 1; an acceptance no count vouches for is "-" with the reason; speculative outputs
that differ from the baseline's at temperature 0 are flagged (exit code 1); a full disk stops
with the folder and the bytes needed; SIGTERM keeps the levels measured in a partial
results.json and exits 143.

Tiny target (demo):
    python 05_benchmark.py --workdir runs/demo --target runs/demo/target --backend hf \
        --steps 3 7 --max-new-tokens 32 --num-prompts 8 --prompt-sets eval
Three speculative settings against one baseline, attached (each labelled from its /server_info):
    python 05_benchmark.py --workdir runs/demo --target runs/demo/target --backend sglang \
        --baseline-url http://127.0.0.1:30000 --spec-url http://127.0.0.1:30001 \
        http://127.0.0.1:30002 http://127.0.0.1:30003 --prompt-sets chat code
Real run against SGLang servers: see train_plan_v4.md.
"""

from __future__ import annotations

import sys

from eagle3.bench.stage import STAGE, BenchmarkConfig, check_inputs, check_only, run
from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.faults import script_main
from eagle3.core.progress import format_summary
from eagle3.core.stage import open_stage

__all__ = ["BenchmarkConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(BenchmarkConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    if cfg.check_only:
        return check_only(cfg)
    check = check_inputs(cfg)  # before any folder is made or server started
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    result = run(cfg, stage, check)
    print(format_summary("05 benchmark", result.rows))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(script_main(main, "05"))
