"""Stage 04's door: `check_inputs(cfg)` before the stage folder is opened, `run(cfg, stage, ...)`
after (the config, `TrainConfig`, is eagle3/train/config.py; the loop, eagle3/train/loop.py)."""

from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

from eagle3.core.hidden_states import read_capture_layers
from eagle3.core.progress import human_seconds, progress
from eagle3.core.stage import STAGE_DIRS, Stage, StageError, StageResult, require_upstream
from eagle3.core.target import load_embedding, load_lm_head, read_target_info
from eagle3.draft.export import export_sglang
from eagle3.draft.layers import describe_layers, layer_ids_for
from eagle3.draft.speculators import export_speculators
from eagle3.train import distributed
from eagle3.train.config import TrainConfig, build_draft_config
from eagle3.train.data import check_teacher_vocab, index_files, list_files
from eagle3.train.distributed import DistInfo
from eagle3.train.log import plot_metrics
from eagle3.train.loop import TrainData, acceptance_note, build_draft, build_runtime, train
from eagle3.vocab.mapping import MAPPING_FILE, hot_ids_from_d2t, vocab_sha256

__all__ = ["STAGE", "TrainConfig", "check_inputs", "run"]

STAGE = STAGE_DIRS["04"]


def check_inputs(cfg: TrainConfig) -> list[int]:
    """02b and 03 complete, their captures servable: the capture layers, before any folder is
    made."""
    require_upstream(cfg.workdir / STAGE_DIRS["02b"], cfg.allow_partial)
    require_upstream(cfg.workdir / STAGE_DIRS["03"], cfg.allow_partial)
    capture_layers = read_capture_layers(cfg.workdir)
    if not capture_layers:
        raise StageError("02b_hidden_states/manifest.json names no capture_layers: re-run 02b")
    layer_ids_for(capture_layers, cfg.sglang_version)  # refuse an unservable layout up front
    return capture_layers


def run(cfg: TrainConfig, stage: Stage | None, dist_info: DistInfo, device: torch.device,
        capture_layers: list[int]) -> StageResult | None:
    """Train on every rank; rank 0 exports the drafts, finishes the manifest and returns the
    summary rows (None on the other ranks)."""
    stage_dir = cfg.workdir / STAGE
    t0 = time.time()
    info = read_target_info(cfg.target)
    mapping = load_file(str(cfg.workdir / STAGE_DIRS["03"] / MAPPING_FILE))
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
        return None
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
    return StageResult(rows)


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
