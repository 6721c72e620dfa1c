"""Stage 04's door: `check_inputs(cfg)` before the stage folder is opened, `run(cfg, stage, ...)`
after (the config, `TrainConfig`, is eagle3/train/config.py; the loop, eagle3/train/loop.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.core.faults import (
    SKIP_LIST,
    BadRecords,
    DiskError,
    InputFileError,
    StopSignals,
    disk_error,
    is_disk_error,
)
from eagle3.core.hidden_states import read_capture_layers
from eagle3.core.progress import human_seconds, progress
from eagle3.core.spool import Spool, wait_for_producer
from eagle3.core.stage import (
    STAGE_DIRS,
    Stage,
    StageError,
    StageResult,
    read_manifest,
    require_upstream,
    sweep_temp_files,
)
from eagle3.core.target import load_embedding, load_lm_head, read_target_info
from eagle3.draft.export import export_sglang
from eagle3.draft.layers import describe_layers, layer_ids_for
from eagle3.draft.speculators import export_speculators
from eagle3.train import distributed
from eagle3.train.config import TrainConfig, build_draft_config, spool_dir
from eagle3.train.data import check_teacher_vocab, records_of_step
from eagle3.train.distributed import DistInfo
from eagle3.train.files import check_split, load_checked_split, save_checked
from eagle3.train.log import plot_metrics
from eagle3.train.loop import TrainData, acceptance_note, build_draft, build_runtime, train
from eagle3.vocab.mapping import MAPPING_FILE, hot_ids_from_d2t, vocab_sha256

__all__ = ["STAGE", "TrainConfig", "check_inputs", "run"]

STAGE = STAGE_DIRS["04"]
RESUME_HINT = ("re-run the same command to resume from the last checkpoint in "
               "04_train/checkpoints (the steps after it are trained again)")


class TrainStopped(StageError):
    """Training stopped on a non-finite gradient norm; the message names the step's records."""


def check_inputs(cfg: TrainConfig) -> list[int]:
    """02b and 03 complete, their captures servable: the capture layers, before any folder is
    made."""
    if cfg.stream:
        return _check_stream_inputs(cfg)
    for name in ("02b", "03"):
        folder = cfg.workdir / STAGE_DIRS[name]
        try:
            require_upstream(folder, cfg.allow_partial)
        except json.JSONDecodeError as e:
            raise InputFileError(folder / "manifest.json", f"not valid JSON ({e}): edited or "
                                 f"damaged; re-run {name} to write it again") from e
    if (read_manifest(cfg.workdir / STAGE_DIRS["02b"]) or {}).get("stream"):
        raise StageError("02b ran with --stream: its train states went to a 04 --stream and "
                         "were deleted once read. Run 04 with --stream beside 02b --stream, or "
                         "re-run 02b without --stream (--force) to keep the files")
    capture_layers = read_capture_layers(cfg.workdir)
    if not capture_layers:
        raise StageError("02b_hidden_states/manifest.json names no capture_layers: re-run 02b")
    layer_ids_for(capture_layers, cfg.sglang_version)  # refuse an unservable layout up front
    return capture_layers


def _check_stream_inputs(cfg: TrainConfig) -> list[int]:
    """Stream mode: 03 complete (02b is running); the capture layers from 02b's producer.json
    (waits for 02b to start)."""
    require_upstream(cfg.workdir / STAGE_DIRS["03"], cfg.allow_partial)
    require_upstream(cfg.workdir / STAGE_DIRS["merge"], cfg.allow_partial)
    with StopSignals(RESUME_HINT) as stop:
        prod = wait_for_producer(Spool(spool_dir(cfg)), "capture_layers", stop.check,
                                 give_up_s=cfg.stream_wait_s)
    capture_layers = list(prod["capture_layers"])
    layer_ids_for(capture_layers, cfg.sglang_version)
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
    rt = build_runtime(cfg, device, dist_info)
    with StopSignals(RESUME_HINT) as stop:  # polled between files and between rows
        if cfg.stream:
            data = load_stream_data(cfg, stage_dir, dist_info, mapping["d2t"], info, stop)
        else:
            data = load_data(cfg, stage_dir, dist_info.is_main, mapping["d2t"],
                             info.hidden_size, capture_layers, stop)
        summary = _train(cfg, stage_dir, data, (draft, embed, teacher, lm_head), rt)
        producer = None
        if cfg.stream:  # 02b's state before it may end and clear the spool
            producer = Spool(spool_dir(cfg)).read_producer() or {}
            data.train_files.finish()
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
    if cfg.stream:
        stage.add_input(cfg.workdir / STAGE_DIRS["merge"] / "train.jsonl")
    skips = BadRecords(stage_dir, -1).summary()  # every rank's lines, each record once
    stage.finish(outputs={"final": str(stage_dir / "final"), **summary, **skips},
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
            **(_stream_rows(cfg, summary, producer) if cfg.stream else {}),
            "records skipped": (f"{skips['skipped']} {skips['skip_reasons']} "
                                f"({skips['skip_list']})" if skips["skipped"] else "0"),
            "time": human_seconds(time.time() - t0)}
    return StageResult(rows)


def _train(cfg: TrainConfig, stage_dir, data: TrainData, parts: tuple, rt) -> dict:
    """`train` with its faults made stage errors: a full or read-only disk names the folder, a
    non-finite gradient norm names the records of its step."""
    draft, embed, teacher, lm_head = parts
    try:
        return train(cfg, stage_dir, data, draft, embed, teacher, rt, lm_head)
    except (DiskError, OSError) as e:
        if not isinstance(e, DiskError) and not is_disk_error(e):
            raise
        # a checkpoint cut short leaves a `.tmp_step_*` folder (never resumed from): free its
        # space now, not at the next save, which needs that space
        sweep_temp_files(Path(stage_dir) / "checkpoints")
        if isinstance(e, DiskError):
            raise
        where = e.filename if isinstance(e.filename, str) else Path(stage_dir) / "metrics.jsonl"
        raise disk_error(e, where) from e
    except FloatingPointError as e:
        match = re.match(r"step (\d+):", str(e))
        if match is None:
            raise
        records = records_of_step(data, cfg, rt.dist.world, rt.dist.rank, int(match[1]))
        raise TrainStopped(f"{e}. The step trained on {len(records)} records: "
                           + "; ".join(f"{r} ({f})" for r, f in records[:8])
                           + (" ..." if len(records) > 8 else "")
                           + f". To leave one out, add a line {{\"id\": ..., \"reason\": "
                           f"\"excluded\"}} to {stage_dir / SKIP_LIST} and resume") from e


def _stream_rows(cfg: TrainConfig, summary: dict, prod: dict) -> dict:
    """Stream mode's summary rows: where the rows came from, the spool's peak so far."""
    return {"stream": (f"rows read from {spool_dir(cfg)}; waiting for 02b was "
                       f"{100 * summary['data_wait']:.1f}% of the loop"),
            "spool peak (so far; 02b's summary has the final)":
                f"{prod.get('peak_bytes', 0) / 1e9:.3f} GB of {prod.get('budget_bytes', 0) / 1e9:g}"}


def load_stream_data(cfg: TrainConfig, stage_dir, dist_info: DistInfo, d2t, info,
                     stop: StopSignals) -> TrainData:
    """Stream mode: the eval split as offline (02b writes it first), the train split as the
    spool's StreamFiles; rank 0 publishes the plan (eagle3/train/stream.py)."""
    from eagle3.train.stream import (
        StreamFiles,
        check_layout,
        merged_train,
        publish,
        stream_plan,
    )

    spool = Spool(spool_dir(cfg))
    prod = wait_for_producer(spool, "eval_ready", stop.check, give_up_s=cfg.stream_wait_s)
    layers = list(prod["capture_layers"])
    check_layout(prod, layers, info.hidden_size, vocab_sha256(d2t), spool)
    evaluated = load_data(cfg, stage_dir, dist_info.is_main, d2t, info.hidden_size, layers,
                          stop, splits=[s for s in ("eval",) if s in prod["offline_splits"]])
    good, ids, lengths = merged_train(cfg.workdir, info.vocab_size)
    if not good:
        raise StageError(f"{cfg.workdir / STAGE_DIRS['merge'] / 'train.jsonl'} holds no "
                         "valid record to train on")
    _, plan = stream_plan(cfg, lengths, evaluated.eval_lengths, good, dist_info.world)
    if dist_info.is_main:
        publish(spool, plan)
    files = StreamFiles(spool, plan, good, ids, dist_info.rank, info.hidden_size,
                        BadRecords(stage_dir, cfg.max_bad), stop, cfg.stream_wait_s)
    return TrainData(files, lengths, evaluated.eval_files, evaluated.eval_lengths,
                     teacher_topk=max(evaluated.teacher_topk, int(prod.get("topk") or 0)),
                     stream=True)


def load_data(cfg: TrainConfig, stage_dir, is_main: bool, d2t, hidden_size: int,
              capture_layers: list[int], stop: StopSignals | None = None,
              splits=("train", "eval")) -> TrainData:
    """Both splits' files as 02b's index lists them, each checked before the first step
    (eagle3/train/files.py): a bad one goes to the skip list, past --max-bad the stage stops.
    Rank 0 checks, the other ranks read its result; files of every layout mix, those with a
    top-k teacher must match the vocab."""
    root = cfg.workdir / STAGE_DIRS["02b"]
    bad = BadRecords(stage_dir, cfg.max_bad)
    out, topk = {s: ([], []) for s in ("train", "eval")}, 0
    if not is_main:
        distributed.barrier()  # rank 0 checks first; the others read its result
    for split in splits:
        checked = stage_dir / f"files_{split}.json"
        if is_main:
            bar = progress(total=_count_candidates(root / split), desc=f"04 check {split}",
                           unit="file")
            try:
                files, index = check_split(root / split, hidden_size, capture_layers, bad, bar,
                                           stop)
            finally:
                bar.close()
            save_checked(checked, root / split, files, index)
        else:
            files, index = load_checked_split(checked, root / split, hidden_size, bad, stop)
        check_teacher_vocab(files, index, vocab_sha256(d2t))
        out[split] = (files, index.lengths)
        topk = max([topk, *index.topk])
    if is_main:
        distributed.barrier()
    return TrainData(*out["train"], *out["eval"], teacher_topk=topk)


def _count_candidates(split_dir) -> int:
    return sum(1 for _ in split_dir.glob("shard_*/data_*.pt"))
