#!/usr/bin/env python3
"""Stage 01: public datasets -> conversation records and token-exact samples, per dataset.

Reads a recipe from datasets/ and writes, for each of its datasets,
`<workdir>/01_prepared/<dataset>/conversations.jsonl` (OpenAI-shaped messages, stable ids),
`tokenized.jsonl` (datasets whose replies are kept: input_ids + loss_mask rendered with the
target's chat template, docs/PIPELINE.md "Records") and `quarantine.jsonl` (every rejected row and
why). Datasets run in parallel worker processes, in chunks; killed and re-run with the same
command, the stage continues from the finished chunks and ends with the same bytes.

Tiny target (demo):
    python 01_prepare_datasets.py --recipe datasets/demo.json --workdir runs/demo \
        --target runs/demo/target
Real run:
    python 01_prepare_datasets.py --recipe datasets/kimi_k25_mix.json --workdir runs/kimi-k25 \
        --target /models/Kimi-K2.5 --num-workers 32
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import StageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.core.progress import format_summary, human_bytes, human_seconds
from eagle3.core.stage import STAGE_DIRS, open_stage
from eagle3.core.target import TRUST_HELP, check_remote_code
from eagle3.prepare.recipes import RecipeError, load_recipe
from eagle3.prepare.rows import RenderMismatch
from eagle3.prepare.runner import RenderSettings, open_run, run_prepare, source_warnings
from eagle3.prepare.sources import SourceError, describe, open_source

STAGE = STAGE_DIRS["01"]
log = logging.getLogger("01_prepare_datasets")


@dataclass
class PrepareConfig(StageFlags):
    recipe: Path = arg(help="dataset recipe JSON (see datasets/)")
    target: Path = arg(help="target model folder: its tokenizer and chat template render "
                            "every sample (only the tokenizer files are read)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    thinking: bool = arg(True, "render with thinking on, the served reasoning mode (must "
                               "match 01b's --thinking)")
    num_workers: int = arg(0, "worker processes (0 = one per CPU core, at most 64)")
    chunk_size: int = arg(1000, "rows per chunk, the unit of parallel work and of resume")
    verify_every: int = arg(100, "re-check 1 in N kept records with the exact, slow "
                                 "tokenization; a difference stops the stage (0 = never)")
    exact_render: bool = arg(False, "tokenize every record the exact, slow way")
    max_loss: float = arg(0.5, "warn (summary and manifest) when a dataset quarantines more "
                               "than this share of the rows read, 0..1; one with no record "
                               "always warns")

    def __post_init__(self) -> None:
        check_remote_code(self.target, self.trust_remote_code)
        if self.num_workers < 0:
            raise ValueError("--num-workers must be >= 0 (0 = one per CPU core)")
        if self.chunk_size < 1:
            raise ValueError("--chunk-size must be >= 1")
        if not 0 <= self.max_loss <= 1:
            raise ValueError("--max-loss must be within 0..1 (a share of the rows read)")
        if self.verify_every < 0:
            raise ValueError("--verify-every must be >= 0 (0 = never)")
        if not (Path(self.target) / "tokenizer_config.json").is_file():
            raise ValueError(f"--target {self.target}: no tokenizer_config.json there; point "
                             "it at the target model folder")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PrepareConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    # One tokenizer thread per worker process: the pool provides the parallelism.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        recipe = load_recipe(cfg.recipe)
        sources = {s.name: open_source(s.path, s.hf, s.seed if s.sample == "random" else None)
                   for s in recipe.datasets}
    except (RecipeError, SourceError) as e:
        print(f"01_prepare_datasets: {e}", file=sys.stderr)
        return 2
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    workers = cfg.num_workers or min(64, os.cpu_count() or 1)
    settings = RenderSettings(cfg.target, {"thinking": cfg.thinking}, None, cfg.verify_every,
                              cfg.exact_render, cfg.trust_remote_code)
    stage.add_input(cfg.recipe)
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
        print(f"01_prepare_datasets: {e}", file=sys.stderr)
        return 1
    datasets = {s.name: {**outputs[s.name], **_contract(s)} for s in recipe.datasets}
    warnings = source_warnings(datasets, cfg.max_loss)
    for w in warnings:
        log.warning("%s", w)
    manifest = stage.finish(outputs={"datasets": datasets}, extra={
        "warnings": warnings,
        "recipe": recipe.raw, "recipe_name": recipe.name,
        "render": {"target": str(cfg.target), "template_kwargs": settings.template_kwargs,
                   "fingerprint": settings.fingerprint()}})
    print(format_summary("01 prepare datasets", _summary_rows(
        datasets, time.time() - t0, manifest["disk_bytes"], stage.dir, warnings)))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
