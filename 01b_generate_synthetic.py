#!/usr/bin/env python3
"""Stage 01b: regenerate responses with the target -> tokenized records per dataset.

Reads `<workdir>/01_prepared/*/conversations.jsonl`; writes
`<workdir>/01b_generated/<dataset>/tokenized.jsonl` (input_ids + loss_mask per PIPELINE.md),
`raw.jsonl` (the generated ids as returned) and `quarantine.jsonl`. Datasets whose recipe entry
says `"regenerate": false` keep their replies, rendered with the target's chat template.
Killed and re-run with the same command, it resumes by record id.

Tiny target (demo):
    python 01b_generate_synthetic.py --workdir runs/demo --target runs/demo/target \
        --backend hf --max-new-tokens 48
Real run (see train_plan_v4.md for the SGLang server):
    python 01b_generate_synthetic.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5 \
        --backend sglang --server-url http://127.0.0.1:30000 --max-new-tokens 8192
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.chat import ChatRenderer, RenderError
from eagle3.cli import arg, config_dict, parse_config, setup_logging
from eagle3.generation import HFGenerator, build_job, existing_ids, run_generation, tokenize_kept
from eagle3.progress import format_summary, human_bytes, human_seconds, progress
from eagle3.records import JsonlAppender, read_jsonl
from eagle3.stage import Quarantine, atomic_write_json, open_stage, require_upstream
from eagle3.target import load_hf_model, load_tokenizer

STAGE = "01b_generated"
UPSTREAM = "01_prepared"


@dataclass
class GenerateConfig:
    target: Path = arg(help="target model folder (tokenizer + chat template; weights for hf)")
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    backend: str = arg("hf", "who generates: hf (in-process transformers)",
                       choices=["hf"])
    max_new_tokens: int = arg(2048, "generation budget per reply, tokens (also capped by the "
                                    "dataset's max_seq_len)")
    batch_size: int = arg(8, "hf backend: prompts generated together")
    thinking: bool = arg(True, "render prompts with thinking on (the served reasoning mode)")
    dtype: str = arg("float32", "hf backend: model dtype (float32, bfloat16)")
    device: str = arg("cpu", "hf backend: torch device")
    allow_partial: bool = arg(False, "accept an incomplete 01_prepared folder")
    force: bool = arg(False, "redo the stage even if it is complete")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be >= 1")


def process_dataset(name: str, opts: dict, cfg: GenerateConfig, stage_dir: Path,
                    renderer: ChatRenderer, generator) -> dict:
    """Tokenize or regenerate one dataset into `stage_dir/<name>/`; returns its counts."""
    src = cfg.workdir / UPSTREAM / name / "conversations.jsonl"
    out_dir = stage_dir / name
    done = existing_ids(out_dir / "tokenized.jsonl")
    (out_dir / "quarantine.jsonl").unlink(missing_ok=True)  # rebuilt whole on every run
    quarantine = Quarantine(out_dir / "quarantine.jsonl")
    counts = {"resumed": len(done), "regenerate": opts["regenerate"]}
    with JsonlAppender(out_dir / "tokenized.jsonl") as out:
        if not opts["regenerate"]:
            for conv in progress(read_jsonl(src), desc=f"01b {name} (keep)", unit="conv"):
                try:
                    records = list(tokenize_kept(conv, renderer, opts["max_seq_len"]))
                except RenderError as e:
                    quarantine.add(conv["id"], str(e))
                    continue
                for rec in records:
                    if rec["id"] not in done:
                        out.write(rec)
        else:
            jobs = []
            for conv in read_jsonl(src):
                try:
                    jobs.append(build_job(conv, renderer, opts["max_seq_len"], cfg.max_new_tokens))
                except RenderError as e:
                    quarantine.add(conv["id"], str(e))
            bar = progress(total=len(jobs), desc=f"01b {name} (generate)", unit="req")
            with JsonlAppender(out_dir / "raw.jsonl") as raw:
                counts.update(run_generation(jobs, generator, out, raw, done, cfg.batch_size, bar))
            bar.close()
    quarantine.close()
    counts["records"] = len(existing_ids(out_dir / "tokenized.jsonl"))
    counts["quarantined"] = quarantine.count
    atomic_write_json(out_dir / "done.json", counts)
    return counts


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(GenerateConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.target)
    renderer = ChatRenderer(tokenizer, template_kwargs={"thinking": cfg.thinking})
    datasets = upstream["outputs"]["datasets"] if upstream else {}
    generator = None
    if any(d["regenerate"] for d in datasets.values()):
        model = load_hf_model(cfg.target, cfg.dtype, cfg.device)
        generator = HFGenerator(model, [renderer.end_of_turn_id], tokenizer.pad_token_id)
    outputs = {}
    for name, opts in datasets.items():
        stage.add_input(cfg.workdir / UPSTREAM / name / "conversations.jsonl")
        outputs[name] = process_dataset(name, opts, cfg, stage.dir, renderer, generator)
    manifest = stage.finish(outputs={"datasets": outputs})
    rows = {f"{n} records (quarantined)": f"{c['records']} ({c['quarantined']})"
            for n, c in outputs.items()}
    rows.update(time=human_seconds(time.time() - t0), disk=human_bytes(manifest["disk_bytes"]))
    print(format_summary("01b generate", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
