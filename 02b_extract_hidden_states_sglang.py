#!/usr/bin/env python3
"""Stage 02b: hidden states of the target for every merged sample.

Reads `<workdir>/01c_merged/{train,eval}.jsonl`; writes
`<workdir>/02b_hidden_states/<split>/shard_NNNNN/data_<idx>.pt` (docs/PIPELINE.md layout): the aux
states at the capture layers ([2, N//2, N-3]; [2, 30, 58] for Kimi-K2.5) and the final
post-norm state, bf16 or fp8 (`--dtype fp8`: e4m3 aux states with a per-token scale;
`fp8-all`: the final state in e4m3 too; `fp8-topk`: instead of the final state, the teacher's
`--teacher-topk` largest draft-vocabulary log-probs, which needs 03's vocab mapping first).

Backends: `sglang` (default) sends every sample to a patched SGLang server (see
`patches/README.md`; `eagle3/extract/sglang.py` for what is checked) and converts the dumps it
writes; `hf` runs the target in-process with transformers (small targets, the demo, tests).
Before the first request it checks the server's flags and that the disk holds the estimated
output. Re-running resumes by record id; records that failed every attempt are listed in
`<split>/failures.jsonl`, retried by a re-run, and keep the stage incomplete unless
`--accept-failures`.

Faults: a merged line that is not a valid record (bad JSON, missing or out-of-vocabulary
input_ids, a loss_mask of another length, a repeated id) and a record whose target states hold
NaN/Inf are skipped into `02b_hidden_states/skipped.jsonl` and counted in the summary and the
manifest; past `--max-bad` the stage stops naming the list. A server fault (HTTP error, no
answer, a cut answer, a wrong token count, a bad dump) is retried with backoff, then the record
goes to `failures.jsonl`. Each file's sha256 is in `<split>/index.jsonl`. A full or read-only
disk stops the stage naming the folder and the bytes needed; SIGTERM stops it after the records
in flight (exit 143). Either way the files written are kept: re-run the same command.

Stream mode (`--stream`, beside `04_train.py --stream`): the eval split as above, then the train
split in 04's reading order through a spool of at most `--spool-gb` (`<workdir>/02b_spool`), each
file deleted by 04 once read; records are kept for later epochs while they fit, the rest are
extracted again each epoch (eagle3/extract/stream.py; docs/stream.md).

Tiny target (demo):
    python 02b_extract_hidden_states_sglang.py --workdir runs/demo --target runs/demo/target \\
        --backend hf
Real run: patch SGLang (`python -m eagle3.extract.patching`), start the dump server, then the client.
The dump directory in RAM (/dev/shm) saves writing every state to disk twice; it holds only the
dumps in flight (checked at start).
    EAGLE3_DUMP_DIR=/dev/shm/eagle3-dump python -m sglang.launch_server \\
        --model-path /models/Kimi-K2.5 --tp 8 --trust-remote-code --disable-radix-cache \\
        --skip-server-warmup --cuda-graph-backend-prefill disabled
    (SGLang <= 0.5.13: --disable-piecewise-cuda-graph instead of --cuda-graph-backend-prefill)
    python 02b_extract_hidden_states_sglang.py --workdir runs/kimi-k25 \\
        --target /models/Kimi-K2.5 --server-url http://127.0.0.1:30000 \\
        --dump-dir /dev/shm/eagle3-dump
"""

from __future__ import annotations

import sys

from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.faults import script_main
from eagle3.core.progress import format_summary
from eagle3.core.stage import open_stage
from eagle3.extract.stage import STAGE, ExtractConfig, check_inputs, run

__all__ = ["ExtractConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ExtractConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    check_inputs(cfg)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    result = run(cfg, stage)
    print(format_summary("02b extract hidden states", result.rows))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(script_main(main, "02b"))
