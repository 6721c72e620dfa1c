#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft and export it for SGLang (and vLLM's speculators format).

Reads `<workdir>/02b_hidden_states/{train,eval}/`, `<workdir>/03_vocab/vocab_mapping.safetensors`
and, from the target's safetensors files (through the index), only its embedding and its lm_head
(the draft-vocabulary rows teach the draft; the whole head gives the evaluation's
full-vocabulary argmax). Writes checkpoints to `<workdir>/04_train/checkpoints/step_NNNNNN/`
(re-running the same command resumes at the exact batch), `metrics.jsonl`, `plots/*.png`,
`tensorboard/` (when installed), the SGLang draft folder `<workdir>/04_train/final/` and the
speculators-format folder `<workdir>/04_train/final_speculators/`.

Bad input: the files trained on are those 02b's `<split>/index.jsonl` lists, each checked before
the first step (header, dtypes, shapes, hidden size, capture layers, agreement with its index
line) and where it is read (the index's sha256, NaN/Inf); a bad one is skipped and listed once
in `04_train/skipped.jsonl`, counted in the summary and the manifest, up to `--max-bad`. SIGTERM
stops between rows (the step in flight is abandoned; exit 143, re-run to resume from the last
checkpoint); a full or read-only disk stops with the folder and the bytes needed.

Stream mode (`--stream`, beside `02b ... --stream`): the train split's files come through 02b's
spool as 02b writes them, in the order this run publishes there, and are deleted once loaded;
`--gpu-memory-fraction` caps this run's GPU memory beside a colocated target server
(eagle3/train/stream.py; docs/stream.md).

Tiny target (demo):
    OMP_NUM_THREADS=1 python 04_train.py --workdir runs/demo --target runs/demo/target \
        --epochs 6 --lr 1e-3 --max-seq-len 512 --num-workers 1 --eval-every 100 --log-every 50
Real run, one 8-GPU host (several hosts: add --nnodes/--node-rank/--rdzv-endpoint):
    torchrun --nproc-per-node 8 04_train.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5 \
        --device cuda --epochs 3 --lr 1e-4 --grad-accum 2 --compile
"""

from __future__ import annotations

import sys

from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.faults import script_main
from eagle3.core.progress import format_summary
from eagle3.core.stage import open_stage, read_manifest
from eagle3.train import distributed
from eagle3.train.stage import STAGE, TrainConfig, check_inputs, run

__all__ = ["TrainConfig", "main"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv, __doc__)
    dist_info = distributed.env_dist_info()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    setup_logging(cfg.log_level if dist_info.is_main else "WARNING")
    device = distributed.init(dist_info, cfg.device)
    capture_layers = check_inputs(cfg)
    done = bool((read_manifest(cfg.workdir / STAGE) or {}).get("complete")) and not cfg.force
    # rank 0 opens the stage (a no-op that says so when complete; --force clears the folder)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force) \
        if dist_info.is_main else None
    distributed.barrier()
    if done:
        distributed.shutdown()
        return 0
    result = run(cfg, stage, dist_info, device, capture_layers)
    if result is not None:
        print(format_summary("04 train", result.rows))
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main, "04"))
