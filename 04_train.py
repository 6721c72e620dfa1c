#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft and export it for SGLang.

Reads `<workdir>/02b_hidden_states/{train,eval}/`, `<workdir>/03_vocab/vocab_mapping.safetensors`
and the target's embedding and lm_head (only those tensors, from its safetensors files). Writes
checkpoints to `<workdir>/04_train/checkpoints/step_NNNNNN/` (re-running the same command resumes
from the latest) and the SGLang draft folder `<workdir>/04_train/final/`.

Tiny target (demo):
    python 04_train.py --workdir runs/demo --target runs/demo/target --epochs 4 --lr 1e-3 \
        --num-workers 0 --eval-every 50 --log-every 10
Real run (8 GPUs): see train_plan_v4.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from eagle3.cli import config_dict, parse_config, setup_logging
from eagle3.export import describe_layers, export_sglang, layer_ids_for
from eagle3.progress import format_summary, human_seconds
from eagle3.stage import open_stage, require_upstream
from eagle3.target import load_embedding, load_lm_head, read_target_info
from eagle3.train import TrainConfig, build_draft, build_draft_config, list_files, train
from eagle3.vocab import hot_ids_from_d2t

STAGE = "04_train"


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    hs_manifest = require_upstream(cfg.workdir / "02b_hidden_states", cfg.allow_partial) or {}
    require_upstream(cfg.workdir / "03_vocab", cfg.allow_partial)
    info = read_target_info(cfg.target)
    capture_layers = hs_manifest.get("capture_layers")
    if not capture_layers:
        raise SystemExit("02b_hidden_states/manifest.json names no capture_layers: re-run 02b")
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    mapping = load_file(str(cfg.workdir / "03_vocab" / "vocab_mapping.safetensors"))
    dcfg = build_draft_config(cfg, info, mapping["d2t"].numel(), capture_layers)
    layer_ids_for(capture_layers, cfg.sglang_version)  # refuse an unservable layout up front
    draft = build_draft(dcfg, cfg.seed, mapping["d2t"], mapping["t2d"])
    teacher = load_lm_head(cfg.target)[hot_ids_from_d2t(mapping["d2t"])]  # [draft_vocab, Ht]
    embed = load_embedding(cfg.target)
    for name in ("02b_hidden_states", "03_vocab"):
        stage.add_input(cfg.workdir / name)
    hs_root = cfg.workdir / "02b_hidden_states"
    summary = train(cfg, stage.dir, list_files(hs_root / "train"), list_files(hs_root / "eval"),
                    draft, embed, teacher)
    export_sglang(draft.cpu(), stage.dir / "final", cfg.sglang_version)
    stage.finish(outputs={"final": str(stage.dir / "final"), **summary},
                 extra={"draft_config": dcfg.to_dict()})
    ids = layer_ids_for(capture_layers, cfg.sglang_version)
    rows = {"steps": summary["num_steps"], "tokens": summary["tokens"],
            "eval acc per step": str([round(a, 3) for a in summary.get("eval_acc", [])]),
            "eval simulated acceptance": round(summary.get("eval_sim_accept", 0.0), 3),
            "layers": describe_layers(ids), "draft": str(stage.dir / "final"),
            "time": human_seconds(time.time() - t0)}
    print(format_summary("04 train", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
