"""Stage 01's door: `check_inputs(cfg)` (the recipe and its sources) before the stage folder is
opened, `run(cfg, stage, recipe, sources)` after: the self-written datasets written by the target
(eagle3/prepare/selfwritten_run.py), then every dataset of the recipe read, adapted to
conversations and rendered with the target's template (eagle3/prepare/runner.py)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from eagle3.core.chat import ChatRenderer
from eagle3.core.progress import human_bytes, human_seconds
from eagle3.core.stage import STAGE_DIRS, Stage, StageResult
from eagle3.core.target import load_tokenizer
from eagle3.prepare import selfwritten_run
from eagle3.prepare.config import PrepareConfig
from eagle3.prepare.recipes import load_recipe
from eagle3.prepare.rows import RenderMismatch
from eagle3.prepare.runner import RenderSettings, open_run, run_prepare, source_warnings
from eagle3.prepare.sources import LocalSource, describe, open_source

__all__ = ["STAGE", "PrepareConfig", "check_inputs", "run"]

STAGE = STAGE_DIRS["01"]
log = logging.getLogger(__name__)


def check_inputs(cfg: PrepareConfig) -> tuple:
    """(recipe, {dataset: source}); RecipeError or SourceError before any folder is made."""
    recipe = load_recipe(cfg.recipe)
    sources = {s.name: open_source(s.path, s.hf, s.seed if s.sample == "random" else None)
               for s in recipe.datasets if s.self_written is None}
    if any(s.self_written is not None for s in recipe.datasets):
        selfwritten_run.check_self_written(recipe, _renderer(cfg))
    return recipe, sources


def _renderer(cfg: PrepareConfig) -> ChatRenderer:
    return ChatRenderer(load_tokenizer(cfg.target, cfg.trust_remote_code),
                        {"thinking": cfg.thinking})


def run(cfg: PrepareConfig, stage: Stage, recipe, sources: dict) -> StageResult:
    """Every dataset of the recipe (resumed by chunk); the manifest with 01's contract fields."""
    t0 = time.time()
    workers = cfg.num_workers or min(64, os.cpu_count() or 1)
    settings = RenderSettings(cfg.target, {"thinking": cfg.thinking}, None, cfg.verify_every,
                              cfg.exact_render, cfg.trust_remote_code)
    stage.add_input(cfg.recipe)
    written = {}
    if specs := [s for s in recipe.datasets if s.self_written is not None]:
        written = selfwritten_run.write_self_written(cfg, stage.dir, specs, _renderer(cfg),
                                                     settings.fingerprint())
        sources.update({name: LocalSource(w.conversations) for name, w in written.items()})
    runs, outputs = [], {}
    for spec in recipe.datasets:
        stage.inputs.append({"dataset": spec.name, **describe(sources[spec.name])})
        run = open_run(spec, stage.dir / spec.name, sources[spec.name], cfg.chunk_size,
                       settings.fingerprint())
        if isinstance(run, dict):
            outputs[spec.name] = run
        else:
            runs.append(run)
    try:
        outputs.update(run_prepare(runs, settings, workers))
    except RenderMismatch as e:
        return StageResult(None, 1, f"01_prepare_datasets: {e}")
    datasets = {s.name: {**outputs[s.name], **_contract(s)} for s in recipe.datasets}
    for name, w in written.items():
        selfwritten_run.place_heldout(w, stage.dir / name)
        datasets[name]["self_written"] = w.info
    warnings = source_warnings(datasets, cfg.max_loss)
    for w in warnings:
        log.warning("%s", w)
    manifest = stage.finish(outputs={"datasets": datasets}, extra={
        "warnings": warnings,
        "recipe": recipe.raw, "recipe_name": recipe.name,
        "render": {"target": str(cfg.target), "template_kwargs": settings.template_kwargs,
                   "fingerprint": settings.fingerprint()}})
    return StageResult(_summary_rows(datasets, time.time() - t0, manifest["disk_bytes"],
                                     stage.dir, warnings))


def _contract(spec) -> dict:
    """Fields 01b and the merge read from the manifest for each dataset."""
    return {"regenerate": spec.regenerate, "max_seq_len": spec.max_seq_len, "mode": spec.mode,
            "prompt_only": spec.prompt_only, "merge_cap": spec.merge_cap,
            "merge_weight": spec.merge_weight, "overlength": spec.overlength,
            "tokenized": "tokenized.jsonl" if spec.mode == "keep" else None}


def _summary_rows(datasets: dict, seconds: float, disk: int, out: Path,
                  warnings: list[str]) -> dict:
    rows = {}
    for name, c in datasets.items():
        rows[name] = (f"{c['records']:,} rec ({c['mode']}), {c['samples']:,} samples, "
                      f"{c['tokens']:,} tok, {c['truncated']:,} cut to fit, "
                      f"quarantined {c['quarantined']:,}")
        if "self_written" in c:
            rows.update(selfwritten_run.summary_rows(name, c["self_written"]))
        reasons = sorted(c["quarantine_reasons"].items(), key=lambda kv: (-kv[1], kv[0]))
        for k in range(0, len(reasons), 4):  # every reason, four a line, keyed by dataset
            rows[f"  {name} quarantine" + (f" ({k // 4 + 1})" if k else "")] = ", ".join(
                f"{kind} {n}" for kind, n in reasons[k: k + 4])
    for k, w in enumerate(warnings):
        rows[f"WARNING {k + 1}"] = w
    total_rows = sum(c["rows_read"] for c in datasets.values())
    total_tokens = sum(c["tokens"] for c in datasets.values())
    rows.update(records=sum(c["records"] for c in datasets.values()),
                quarantined=sum(c["quarantined"] for c in datasets.values()),
                rate=f"{total_rows / max(seconds, 1e-9):,.0f} rows/s, "
                     f"{total_tokens / max(seconds, 1e-9):,.0f} tok/s",
                time=human_seconds(seconds), disk=human_bytes(disk), output=str(out))
    return rows
