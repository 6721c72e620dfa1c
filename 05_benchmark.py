#!/usr/bin/env python3
"""Stage 05: measure the draft — acceptance length, and speed against no draft.

`--backend hf` runs greedy chain speculative decoding of the draft against a transformers target
on the held-out eval prompts (`01c_merged/eval.jsonl`), checks the output equals plain greedy
decoding, and writes `<workdir>/05_benchmark/results.json` and `report.md`.

Tiny target (demo):
    python 05_benchmark.py --workdir runs/demo --target runs/demo/target --backend hf \
        --steps 3 7 --max-new-tokens 32 --num-prompts 8
Real run against SGLang servers: see train_plan_v4.md.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.benchmark import PromptSet, report_markdown, run_offline
from eagle3.chat import ChatRenderer
from eagle3.cli import arg, config_dict, parse_config, setup_logging
from eagle3.export import describe_layers, load_draft
from eagle3.progress import format_summary, human_seconds, progress
from eagle3.records import read_jsonl
from eagle3.stage import atomic_write_bytes, atomic_write_json, open_stage, require_upstream
from eagle3.target import load_embedding, load_hf_model, load_tokenizer

STAGE = "05_benchmark"


@dataclass
class BenchmarkConfig:
    target: Path = arg(help="target model folder")
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    draft: Path | None = arg(None, "draft folder (default: <workdir>/04_train/final)")
    backend: str = arg("hf", "hf: offline speculative decoding in transformers", choices=["hf"])
    steps: list[int] = arg([3, 7], "chain lengths (draft tokens per verify pass) to measure")
    max_new_tokens: int = arg(256, "tokens generated per prompt")
    num_prompts: int = arg(64, "eval prompts used (first N of the eval split)")
    device: str = arg("cpu", "torch device")
    dtype: str = arg("float32", "target and draft dtype")
    allow_partial: bool = arg(False, "accept incomplete upstream folders")
    force: bool = arg(False, "redo the stage even if it is complete")
    log_level: str = arg("INFO", "logging level")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(BenchmarkConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    draft_dir = cfg.draft or cfg.workdir / "04_train" / "final"
    require_upstream(cfg.workdir / "01c_merged", cfg.allow_partial)
    if cfg.draft is None:
        require_upstream(cfg.workdir / "04_train", cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    import torch

    dtype = getattr(torch, cfg.dtype)
    model = load_hf_model(cfg.target, cfg.dtype, cfg.device)
    draft = load_draft(draft_dir, cfg.device, dtype)
    embed = load_embedding(cfg.target).to(cfg.device, dtype)
    eos = {ChatRenderer(load_tokenizer(cfg.target)).end_of_turn_id}
    src = cfg.workdir / "01c_merged" / "eval.jsonl"
    stage.add_input(src)
    prompts = [r["input_ids"][: r["n_prompt_tokens"]] for r in read_jsonl(src)][: cfg.num_prompts]
    bar = progress(total=len(prompts), desc="05 eval prompts", unit="prompt")
    result = run_offline(model, draft, embed, PromptSet("eval", prompts), cfg.steps,
                         cfg.max_new_tokens, eos, bar)
    bar.close()
    results = {"backend": "hf", "draft": str(draft_dir), "prompt_sets": {"eval": result},
               "layers": describe_layers([i - 1 for i in draft.cfg.capture_layers])}
    atomic_write_json(stage.dir / "results.json", results)
    atomic_write_bytes(stage.dir / "report.md", report_markdown(results).encode())
    stage.finish(outputs={s: m["acceptance_length"] for s, m in result["steps"].items()})
    rows = {f"steps {s}: acceptance length": f"{m['acceptance_length']:.3f} (ceiling {int(s) + 1}"
                                             f"), lossless: {m['lossless_mismatches'] == 0}"
            for s, m in result["steps"].items()}
    rows.update(prompts=len(prompts), time=human_seconds(time.time() - t0))
    print(format_summary("05 benchmark", rows))
    lossless = all(m["lossless_mismatches"] == 0 for m in result["steps"].values())
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
