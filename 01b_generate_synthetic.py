#!/usr/bin/env python3
"""Stage 01b: regenerate responses with the target -> tokenized records per dataset.

Reads `<workdir>/01_prepared/*/conversations.jsonl`; writes
`<workdir>/01b_generated/<dataset>/tokenized.jsonl` (input_ids + loss_mask per docs/PIPELINE.md),
`raw.jsonl` (every answer as received), `failures.jsonl` (records that failed, with the reason)
and `quarantine.jsonl` (conversations that cannot be rendered). Datasets whose recipe entry says
`"regenerate": false` keep their replies, rendered with the target's chat template.
Faults: a damaged input line (torn, not JSON, not a conversation record) is skipped and listed in
`01b_generated/skipped.jsonl` (past `--max-bad` of them the stage stops); a server fault (HTTP
5xx/429, no answer within --request-timeout-s, a body cut half-way, an answer that contradicts
itself) is retried with backoff, then the record goes to failures.jsonl, never to the records;
a full or read-only disk stops the stage naming the folder and the bytes needed.
Killed (even with SIGKILL) and re-run with the same command, it resumes by record id; Ctrl-C or
SIGTERM once lets the requests in flight finish (exit 128 + the signal, with a line saying how to
resume), twice abandons them. Answers are appended as they complete; once every answer is in
each dataset's files are rewritten in the order of its conversations, so a resumed run ends with
the files of an uninterrupted one. On a server backend every regenerated dataset's requests go
through one pool (--concurrency over all of them, dataset after dataset), so that no dataset
waits for the last long replies of the one before.

Backends: `sglang` (the real run: native /generate, exact output ids), `openai` (any
/v1/chat/completions server; the reply is re-rendered with the template), `hf` (in process).
The hf backend's engine (`--hf-engine`): `fast` (default; a static KV cache and decode steps
replayed from CUDA graphs on a GPU, greedy or sampled, Llama / Qwen2 / Qwen3 / DeepSeek-V3
targets; at temperature 0 the tokens of `generate`, bf16 near-ties aside) or `generate`
(transformers' generate, greedy, any target). Both run fixed batches of --batch-size prompts
in one order, so a resumed run writes the tokens an uninterrupted one would.

Tiny target (demo):
    python 01b_generate_synthetic.py --workdir runs/demo --target runs/demo/target \\
        --backend hf --max-new-tokens 48
A small target on one GPU (benchmarks/bench_generate.py measures the engines):
    python 01b_generate_synthetic.py --workdir runs/smollm2 --target runs/smollm2/target \
        --backend hf --device cuda --dtype bfloat16 --batch-size 512 --max-new-tokens 2048
Real run (see train_plan_v4.md for the SGLang server; several --server-url for several servers):
    python 01b_generate_synthetic.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5 \\
        --backend sglang --server-url http://127.0.0.1:30000 --max-new-tokens 8192 \\
        --concurrency 192 --long-concurrency 32
An OpenAI-compatible server with a key:
    OPENAI_API_KEY=... python 01b_generate_synthetic.py ... --backend openai \\
        --server-url https://host:8000 --api-key-env OPENAI_API_KEY --served-model NAME
"""

from __future__ import annotations

import os
import sys

from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.faults import script_main
from eagle3.core.progress import format_summary
from eagle3.core.stage import open_stage, require_upstream
from eagle3.generate.stage import STAGE, UPSTREAM, GenerateConfig, run

__all__ = ["GenerateConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(GenerateConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    api_key = os.environ.get(cfg.api_key_env) or None if cfg.api_key_env else None
    if cfg.api_key_env and api_key is None:
        raise SystemExit(f"--api-key-env {cfg.api_key_env}: that environment variable is "
                         "not set or empty")
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    result = run(cfg, stage, upstream, api_key)
    if result.rows is not None:
        title = "01b generate" + (" (INCOMPLETE)" if result.exit_code else "")
        print(format_summary(title, result.rows))
    if result.error:
        print(result.error, file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(script_main(main, "01b"))
