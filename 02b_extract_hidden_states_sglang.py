#!/usr/bin/env python3
"""Stage 02b: hidden states of the target for every merged sample.

Reads `<workdir>/01c_merged/{train,eval}.jsonl`; writes
`<workdir>/02b_hidden_states/<split>/shard_NNNNN/data_<idx>.pt` (PIPELINE.md layout): the aux
states at the capture layers ([2, N//2, N-3] by default; [2, 30, 58] for Kimi-K2.5) and the final
post-norm state. Resumes by file; each file is written atomically.

Tiny target (demo):
    python 02b_extract_hidden_states_sglang.py --workdir runs/demo --target runs/demo/target \
        --backend hf
Real run: see train_plan_v4.md (patched SGLang server, --backend sglang).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.cli import arg, config_dict, parse_config, setup_logging
from eagle3.extract import extract_split
from eagle3.hidden_states import DTYPES
from eagle3.progress import format_summary, human_bytes, human_seconds, progress
from eagle3.records import read_jsonl
from eagle3.stage import open_stage, require_upstream
from eagle3.target import default_capture_layers, load_hf_model, read_target_info

STAGE = "02b_hidden_states"
UPSTREAM = "01c_merged"


@dataclass
class ExtractConfig:
    target: Path = arg(help="target model folder (config.json; weights for --backend hf)")
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    backend: str = arg("hf", "hf: in-process transformers target", choices=["hf"])
    capture_layers: list[int] = arg([], "capture indices (residual entering layer i); "
                                        "empty = SGLang's default [2, N//2, N-3]")
    dtype: str = arg("bf16", "storage of the aux states: bf16 or fp8 (e4m3 + per-token scale)",
                     choices=list(DTYPES))
    splits: list[str] = arg(["train", "eval"], "merged splits to extract")
    max_batch_tokens: int = arg(16384, "hf backend: padded tokens per forward pass")
    model_dtype: str = arg("float32", "hf backend: dtype the target runs in")
    device: str = arg("cpu", "hf backend: torch device")
    allow_partial: bool = arg(False, "accept an incomplete 01c_merged folder")
    force: bool = arg(False, "redo the stage even if it is complete")
    log_level: str = arg("INFO", "logging level")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ExtractConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    info = read_target_info(cfg.target)
    layers = cfg.capture_layers or default_capture_layers(info.num_hidden_layers)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    model = load_hf_model(cfg.target, cfg.model_dtype, cfg.device)
    outputs = {}
    for split in cfg.splits:
        src = cfg.workdir / UPSTREAM / f"{split}.jsonl"
        stage.add_input(src)
        records = list(read_jsonl(src))
        bar = progress(total=len(records), desc=f"02b {split}", unit="sample")
        counts = extract_split(model, records, stage.dir / split, layers, cfg.dtype,
                               cfg.max_batch_tokens, bar)
        bar.close()
        outputs[split] = {"samples": len(records), **counts.__dict__}
    manifest = stage.finish(outputs=outputs, extra={"capture_layers": layers,
                                                    "hidden_size": info.hidden_size})
    tokens = sum(o["tokens"] for o in outputs.values())
    written = sum(o["bytes"] for o in outputs.values())
    rows = {f"{s} samples (written / resumed)": f"{o['samples']} ({o['written']} / "
                                                f"{o['skipped_existing']})"
            for s, o in outputs.items()}
    rows.update(capture_layers=str(layers), dtype=cfg.dtype,
                bytes_per_token=f"{written / max(tokens, 1):,.0f}",
                time=human_seconds(time.time() - t0), disk=human_bytes(manifest["disk_bytes"]))
    print(format_summary("02b extract hidden states", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
