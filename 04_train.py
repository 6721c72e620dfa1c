#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft and export it for SGLang (and vLLM's speculators format).

Reads `<workdir>/02b_hidden_states/{train,eval}/`, `<workdir>/03_vocab/vocab_mapping.safetensors`
and, from the target's safetensors files (through the index), only its embedding and its lm_head
(the draft-vocabulary rows teach the draft; the whole head gives the evaluation's
full-vocabulary argmax). Writes checkpoints to `<workdir>/04_train/checkpoints/step_NNNNNN/`
(re-running the same command resumes at the exact batch), `metrics.jsonl`, `plots/*.png`,
`tensorboard/` (when installed), the SGLang draft folder `<workdir>/04_train/final/` and the
speculators-format folder `<workdir>/04_train/final_speculators/`.

Tiny target (demo):
    OMP_NUM_THREADS=1 python 04_train.py --workdir runs/demo --target runs/demo/target \
        --epochs 6 --lr 1e-3 --max-seq-len 512 --num-workers 1 --eval-every 100 --log-every 50
Real run, one 8-GPU host (several hosts: add --nnodes/--node-rank/--rdzv-endpoint):
    torchrun --nproc-per-node 8 04_train.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5 \
        --device cuda --epochs 3 --lr 1e-4 --grad-accum 2 --compile
"""

from __future__ import annotations

import sys
import time

from safetensors.torch import load_file

from eagle3.core.cli import config_dict, parse_config, setup_logging
from eagle3.core.hidden_states import read_capture_layers
from eagle3.core.progress import format_summary, human_seconds, progress
from eagle3.core.stage import STAGE_DIRS, open_stage, read_manifest, require_upstream
from eagle3.core.target import load_embedding, load_lm_head, read_target_info
from eagle3.draft.export import export_sglang
from eagle3.draft.layers import describe_layers, layer_ids_for
from eagle3.draft.speculators import export_speculators
from eagle3.train import distributed
from eagle3.train.data import check_teacher_vocab, index_files, list_files
from eagle3.train.log import plot_metrics
from eagle3.train.loop import (
    TrainConfig,
    TrainData,
    acceptance_note,
    build_draft,
    build_draft_config,
    build_runtime,
    train,
)
from eagle3.vocab.mapping import hot_ids_from_d2t, vocab_sha256

STAGE = STAGE_DIRS["04"]


def load_data(cfg: TrainConfig, stage_dir, is_main: bool, d2t) -> TrainData:
    """File lists, token counts and layouts of both splits (read once, cached in the stage
    folder); files of every layout mix, those with a top-k teacher must match the vocab."""
    root = cfg.workdir / STAGE_DIRS["02b"]
    out, topk = {}, 0
    if not is_main:
        distributed.barrier()  # rank 0 counts first; the others read its cache
    for split in ("train", "eval"):
        files = list_files(root / split)
        bar = progress(total=len(files), desc=f"04 index {split}", unit="file") if is_main else None
        index = index_files(files, stage_dir / f"lengths_{split}.json", bar)
        check_teacher_vocab(files, index, vocab_sha256(d2t))
        out[split] = (files, index.lengths)
        topk = max([topk, *index.topk])
        if bar is not None:
            bar.close()
    if is_main:
        distributed.barrier()
    return TrainData(*out["train"], *out["eval"], teacher_topk=topk)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv, __doc__)
    dist_info = distributed.env_dist_info()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK
    setup_logging(cfg.log_level if dist_info.is_main else "WARNING")
    device = distributed.init(dist_info, cfg.device)
    require_upstream(cfg.workdir / STAGE_DIRS["02b"], cfg.allow_partial)
    require_upstream(cfg.workdir / STAGE_DIRS["03"], cfg.allow_partial)
    capture_layers = read_capture_layers(cfg.workdir)
    if not capture_layers:
        raise SystemExit("02b_hidden_states/manifest.json names no capture_layers: re-run 02b")
    layer_ids_for(capture_layers, cfg.sglang_version)  # refuse an unservable layout up front
    done = bool((read_manifest(cfg.workdir / STAGE) or {}).get("complete")) and not cfg.force
    # rank 0 opens the stage (a no-op that says so when complete; --force clears the folder)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force) \
        if dist_info.is_main else None
    distributed.barrier()
    if done:
        distributed.shutdown()
        return 0
    t0 = time.time()
    stage_dir = cfg.workdir / STAGE
    info = read_target_info(cfg.target)
    mapping = load_file(str(cfg.workdir / STAGE_DIRS["03"] / "vocab_mapping.safetensors"))
    dcfg = build_draft_config(cfg, info, mapping["d2t"].numel(), capture_layers)
    draft = build_draft(dcfg, cfg.seed, mapping["d2t"], mapping["t2d"])
    lm_head = load_lm_head(cfg.target)  # [target_vocab, Ht]: the eval's full argmax
    teacher = lm_head[hot_ids_from_d2t(mapping["d2t"])]  # [draft_vocab, Ht]
    embed = load_embedding(cfg.target)
    data = load_data(cfg, stage_dir, dist_info.is_main, mapping["d2t"])
    summary = train(cfg, stage_dir, data, draft, embed, teacher,
                    build_runtime(cfg, device, dist_info), lm_head)
    distributed.shutdown()
    if not dist_info.is_main:
        return 0
    export_sglang(draft.cpu(), stage_dir / "final", cfg.sglang_version)
    vllm_dir = stage_dir / "final"  # the MLA folder is vLLM's too (eagle3/draft/mla_export.py)
    if dcfg.arch == "llama":
        vllm_dir = export_speculators(draft, stage_dir / "final_speculators", str(cfg.target),
                                      cfg.ttt_steps)
    plots = plot_metrics(stage_dir / "metrics.jsonl", stage_dir / "plots")
    for name in (STAGE_DIRS["02b"], STAGE_DIRS["03"]):
        stage.add_input(cfg.workdir / name)
    stage.finish(outputs={"final": str(stage_dir / "final"), **summary},
                 extra={"draft_config": dcfg.to_dict(), "world_size": dist_info.world})
    rows = {"steps": summary["num_steps"], "tokens": summary["tokens"],
            "tokens/s (all ranks)": f"{summary['tok_s']:,.0f}",
            "data wait": f"{100 * summary['data_wait']:.1f}%",
            "padding": f"{100 * summary['padding']:.1f}%",
            "eval acc per step": str([round(a, 3) for a in summary.get("eval_acc", [])]),
            f"eval acceptance estimate ({cfg.ttt_steps} steps)": acceptance_note(summary),
            "layers": describe_layers(layer_ids_for(capture_layers, cfg.sglang_version)),
            "draft (SGLang)": str(stage_dir / "final"),
            "draft (vLLM)": str(vllm_dir),
            "plots": f"{len(plots)} PNG in {stage_dir / 'plots'}",
            "time": human_seconds(time.time() - t0)}
    print(format_summary("04 train", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
