#!/usr/bin/env python3
"""Stage 02b: hidden states of the target for every merged sample.

Reads `<workdir>/01c_merged/{train,eval}.jsonl`; writes
`<workdir>/02b_hidden_states/<split>/shard_NNNNN/data_<idx>.pt` (PIPELINE.md layout): the aux
states at the capture layers ([2, N//2, N-3]; [2, 30, 58] for Kimi-K2.5) and the final
post-norm state, bf16 or fp8 (`--dtype fp8`: e4m3 aux states with a per-token scale;
`fp8-all`: the final state in e4m3 too; `fp8-topk`: instead of the final state, the teacher's
`--teacher-topk` largest draft-vocabulary log-probs, which needs 03's vocab mapping first).

Backends: `sglang` (default) sends every sample to a patched SGLang server (see
`patches/README.md`; `eagle3/extract/sglang.py` for what is checked) and converts the dumps it
writes; `hf` runs the target in-process with transformers (small targets, the demo, tests).
Before the first request it checks the server's flags and that the disk holds the estimated
output. Re-running resumes by record id; records that failed every attempt are listed in
`<split>/failures.jsonl`, retried by a re-run, and keep the stage incomplete unless
`--accept-failures`.

Tiny target (demo):
    python 02b_extract_hidden_states_sglang.py --workdir runs/demo --target runs/demo/target \\
        --backend hf
Real run: patch SGLang (`python -m eagle3.extract.patching`), start the dump server, then the client.
The dump directory in RAM (/dev/shm) saves writing every state to disk twice; it holds only the
dumps in flight (checked at start).
    EAGLE3_DUMP_DIR=/dev/shm/eagle3-dump python -m sglang.launch_server \\
        --model-path /models/Kimi-K2.5 --tp 8 --trust-remote-code --disable-radix-cache \\
        --skip-server-warmup --cuda-graph-backend-prefill disabled
    (SGLang <= 0.5.13: --disable-piecewise-cuda-graph instead of --cuda-graph-backend-prefill)
    python 02b_extract_hidden_states_sglang.py --workdir runs/kimi-k25 \\
        --target /models/Kimi-K2.5 --server-url http://127.0.0.1:30000 \\
        --dump-dir /dev/shm/eagle3-dump
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.extract.writer import SplitWriter, check_output_disk, extract_hf, make_verifier, summary_rows
from eagle3.extract.sglang import Expected, SglangOptions, extract_sglang
from eagle3.core.hidden_states import DTYPES, bytes_per_token
from eagle3.core.progress import format_summary
from eagle3.core.records import read_jsonl
from eagle3.extract.sglang_dump import DEFAULT_RID_PREFIX
from eagle3.core.stage import STAGE_DIRS, open_stage, require_upstream
from eagle3.core.target import (TRUST_HELP, check_remote_code, default_capture_layers,
                                 load_hf_model, read_target_info)
from eagle3.extract.teacher import load_teacher_head

STAGE = STAGE_DIRS["02b"]
UPSTREAM = STAGE_DIRS["merge"]
VOCAB = STAGE_DIRS["03"]  # the draft vocabulary of --dtype fp8-topk


@dataclass
class ExtractConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (config.json; weights for --backend hf and "
                            "--verify-against-hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    backend: str = arg("sglang", "sglang: a patched SGLang dump server; hf: in-process "
                                 "transformers target", choices=["sglang", "hf"])
    capture_layers: list[int] = arg([], "capture indices (residual entering layer i); "
                                        "empty = SGLang's default [2, N//2, N-3]")
    dtype: str = arg("bf16", "file layout: bf16; fp8 (aux states e4m3 + per-token scale); "
                             "fp8-all (the final state too); fp8-topk (fp8 aux states and the "
                             "top-k teacher instead of the final state; needs 03 first)",
                     choices=list(DTYPES))
    teacher_topk: int = arg(64, "fp8-topk: draft-vocabulary log-probs stored per token (K)")
    teacher_device: str = arg("", "fp8-topk: torch device of the teacher's lm_head matmuls "
                                  "('' = --device; a GPU at Kimi size)")
    splits: list[str] = arg(["train", "eval"], "merged splits to extract")
    disk_margin: float = arg(0.1, "free disk required beyond the estimate (fraction)")
    accept_failures: bool = arg(False, "complete the stage even if records failed every attempt")
    server_url: str = arg("http://127.0.0.1:30000", "sglang: the dump server")
    dump_dir: Path | None = arg(None, "sglang: the server's EAGLE3_DUMP_DIR (same machine)")
    rid_prefix: str = arg(DEFAULT_RID_PREFIX, "sglang: the server's EAGLE3_DUMP_RID_PREFIX")
    concurrency: int = arg(0, "sglang: requests in flight (0 = auto, ~4 prefill batches)")
    workers: int = arg(4, "sglang: threads converting dumps into files")
    max_attempts: int = arg(3, "sglang: attempts per record before it counts as failed")
    max_failures: int = arg(100, "sglang: stop when more records failed (-1 = never)")
    dump_wait_s: float = arg(30.0, "sglang: seconds a dump file may lag behind its answer")
    server_wait_s: float = arg(1800.0, "sglang: seconds to wait for a server that went down")
    verify_against_hf: int = arg(0, "sglang: compare the first N samples with the target run "
                                    "in transformers (0 = off)")
    verify_tolerance: float = arg(0.05, "sglang: max relative L2 error in that comparison")
    max_batch_tokens: int = arg(16384, "hf: padded tokens per forward pass")
    max_batch_size: int = arg(64, "hf: records per forward pass (1 = each record alone)")
    model_dtype: str = arg("float32", "hf: dtype the target runs in")
    device: str = arg("cpu", "hf: torch device")

    def __post_init__(self):
        if self.backend == "hf" or self.verify_against_hf:  # transformers loads the target
            check_remote_code(self.target, self.trust_remote_code)
        if self.backend == "sglang" and self.dump_dir is None:
            raise ValueError("--backend sglang needs --dump-dir: the EAGLE3_DUMP_DIR the patched "
                             "server was started with")
        if not self.rid_prefix:
            raise ValueError("--rid-prefix must not be empty (it keeps other traffic out of "
                             "the dump); use the server's EAGLE3_DUMP_RID_PREFIX")
        if min(self.workers, self.max_attempts, self.max_batch_size) < 1:
            raise ValueError("--workers, --max-attempts and --max-batch-size must be >= 1")
        if self.concurrency < 0 or self.verify_against_hf < 0 or self.disk_margin < 0:
            raise ValueError("--concurrency, --verify-against-hf and --disk-margin must be >= 0")
        if self.teacher_topk < 1:
            raise ValueError("--teacher-topk must be >= 1 (64 keeps Kimi-K2.5 under 22 KB/token)")

    @property
    def topk(self) -> int:
        """K of the stored teacher; 0 when the layout stores the final state."""
        return self.teacher_topk if self.dtype == "fp8-topk" else 0


def maybe_teacher(cfg: ExtractConfig, model=None):
    """The TeacherHead of --dtype fp8-topk (from the loaded hf model's lm_head when given)."""
    if not cfg.topk:
        return None
    require_upstream(cfg.workdir / VOCAB, cfg.allow_partial)
    head = model.get_output_embeddings().weight if model is not None else None
    return load_teacher_head(cfg.target, cfg.workdir / VOCAB / "vocab_mapping.safetensors",
                             cfg.teacher_topk, cfg.teacher_device or cfg.device, head)


def sglang_options(cfg: ExtractConfig) -> SglangOptions:
    return SglangOptions(
        server_url=cfg.server_url, dump_dir=cfg.dump_dir, rid_prefix=cfg.rid_prefix,
        concurrency=cfg.concurrency, workers=cfg.workers, max_attempts=cfg.max_attempts,
        max_failures=cfg.max_failures, dump_wait_s=cfg.dump_wait_s,
        server_wait_s=cfg.server_wait_s)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ExtractConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    info = read_target_info(cfg.target)
    layers = cfg.capture_layers or default_capture_layers(info.num_hidden_layers)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0, writers = time.time(), {}
    for split in cfg.splits:
        src = cfg.workdir / UPSTREAM / f"{split}.jsonl"
        stage.add_input(src)
        writers[split] = SplitWriter(stage.dir / split, list(read_jsonl(src)))
    check_output_disk(stage.dir, list(writers.values()), info.hidden_size, cfg.dtype,
                      cfg.disk_margin, cfg.topk)
    extra = {"capture_layers": layers, "hidden_size": info.hidden_size, "backend": cfg.backend,
             "dtype": cfg.dtype, "teacher_topk": cfg.topk,
             "bytes_per_token": bytes_per_token(info.hidden_size, cfg.dtype, cfg.topk)}
    if cfg.backend == "hf":
        model = load_hf_model(cfg.target, cfg.model_dtype, cfg.device,
                              cfg.trust_remote_code)
        outputs = extract_hf(model, writers, layers, cfg.dtype, cfg.max_batch_tokens,
                             cfg.max_batch_size, maybe_teacher(cfg, model))
    else:
        verify, teacher = None, maybe_teacher(cfg)
        if cfg.verify_against_hf:
            model = load_hf_model(cfg.target, cfg.model_dtype, cfg.device,
                                  cfg.trust_remote_code)
            verify = make_verifier(model, layers, cfg.verify_tolerance, teacher)
        expected = Expected(info.hidden_size, tuple(layers), cfg.target)
        outputs, more = asyncio.run(extract_sglang(sglang_options(cfg), expected, cfg.dtype,
                                                   writers, cfg.verify_against_hf, verify,
                                                   teacher))
        extra.update(more)
    failed = sum(o["failed"] for o in outputs.values())
    rows = summary_rows(outputs, time.time() - t0)
    if failed and not cfg.accept_failures:
        rows["INCOMPLETE"] = (f"{failed} records failed (see <split>/failures.jsonl): re-run "
                              "this command to retry them, or add --accept-failures")
    else:
        manifest = stage.finish(outputs=outputs, extra=extra)
        rows["manifest"] = f"{stage.dir / 'manifest.json'} ({manifest['disk_bytes']:,} B)"
    print(format_summary("02b extract hidden states", rows))
    return 2 if failed and not cfg.accept_failures else 0


if __name__ == "__main__":
    sys.exit(main())
