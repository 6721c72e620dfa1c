#!/usr/bin/env python3
"""The whole training loop's rate at Kimi-K2.5 draft dimensions: loader, eval and checkpoints
included, beside the step rate.

Runs `eagle3.train.loop.train` — the loop `04_train.py` runs, with its defaults on the device
(compiled forward on CUDA, loader workers, eval at step 0 and at the end, a checkpoint at the
end) — on synthetic hidden-state files (learnable: the final state at t+1 is the high aux state
at t), a few unique files listed repeatedly (they stay in the page cache: disk reads are not
measured here; see BENCHMARKS.md for the bytes per token). Times every eval and every save, then
projects the rate at the trainer's default schedule (eval every 100 steps over 256 samples, a
checkpoint every 500 steps) from those measured parts: step time x 500 + 5 x the last (warm)
eval + one measured save; start-up and compile left out. The evals run over --eval-samples
samples, 256 by default, so the schedule's eval cost is the measured one; a smaller
--eval-samples scales the last eval linearly (it then also spreads the eval's fixed costs,
such as the loader's worker start-up, over fewer samples: an overestimate).

H200 (one GPU; 96 s with 4-sample evals on 2026-12-01, 256-sample evals add what they measure;
a Kimi-size checkpoint is ~14 GB on local disk):
    python benchmarks/bench_train_stage.py
CPU smoke test:
    python benchmarks/bench_train_stage.py --device cpu --tiny --steps 4 --eval-samples 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.presets import draft_fields
from eagle3.core.stage import atomic_torch_save
from eagle3.draft.model import DraftConfig
from eagle3.train import loop
from eagle3.train.distributed import DistInfo

KIMI = draft_fields("kimi-k2.5")  # the draft 04 --preset kimi-k2.5 trains
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
            intermediate_size=128, vocab_size=554, draft_vocab_size=256, target_hidden_size=64,
            capture_layers=[2, 4, 5])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (CPU smoke test)")
    p.add_argument("--row", type=int, default=4096, help="packed row width (tokens)")
    p.add_argument("--sample-tokens", type=int, default=2048, help="tokens per file")
    p.add_argument("--unique-files", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="optimizer steps (one row each)")
    p.add_argument("--eval-files", type=int, default=4, help="unique eval files")
    p.add_argument("--eval-samples", type=int, default=256,
                   help="eval samples per evaluation (the unique files listed repeatedly; "
                        "default: 04's --max-eval-samples, so the default schedule's eval cost "
                        "is measured, not scaled)")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--fp8-gemm", default=None, choices=["auto", "on", "off"],
                   help="04's --fp8-gemm (default: 04's default)")
    p.add_argument("--out", default=None, help="results folder (default: $OUT or ./bench_out)")
    return p.parse_args(argv)


def write_files(root: Path, dims: dict, n: int, tokens: int, seed: int) -> list[Path]:
    Ht = dims["target_hidden_size"]
    g = torch.Generator().manual_seed(seed)
    files = []
    for i in range(n):
        ids = torch.randint(0, dims["vocab_size"], (tokens,), generator=g)
        aux = torch.randn(tokens, 3, Ht, generator=g).to(torch.bfloat16)
        final = torch.roll(aux[:, 2], 1, dims=0).contiguous()
        data = hs.pack(ids, torch.ones(tokens, dtype=torch.long), [aux[:, j] for j in range(3)],
                       final, {"id": f"bench/{seed}/{i}", "capture_layers": dims["capture_layers"],
                               "final": "post_norm"})
        atomic_torch_save(data, hs.file_path(root, i))
        files.append(hs.file_path(root, i))
    return files


def timed(fn, log: list):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        log.append(time.perf_counter() - t)
        return out
    return wrapper


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out or os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    dims = TINY if args.tiny else KIMI
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="bench_stage_"))
    try:
        unique = write_files(tmp / "train", dims, args.unique_files, args.sample_tokens, 1)
        unique_eval = write_files(tmp / "eval", dims, args.eval_files, args.sample_tokens, 2)
        eval_files = (unique_eval * (args.eval_samples // len(unique_eval) + 1))[:args.eval_samples]
        per_row = args.row // args.sample_tokens
        train_files = (unique * (args.steps * per_row // len(unique) + 1))[:args.steps * per_row]
        data = loop.TrainData(train_files, [args.sample_tokens] * len(train_files), eval_files,
                              [args.sample_tokens] * len(eval_files))
        cfg = loop.TrainConfig(target=tmp, workdir=tmp, max_seq_len=args.row,
                               pack_tokens=args.row, device=args.device,
                               num_workers=args.num_workers, tensorboard=False, log_every=8,
                               max_eval_samples=args.eval_samples,
                               **({"fp8_gemm": args.fp8_gemm} if args.fp8_gemm else {}))
        dcfg = DraftConfig(**dims)
        draft = loop.build_draft(dcfg, 0, torch.zeros(dcfg.draft_vocab_size, dtype=torch.long),
                                 torch.zeros(dcfg.vocab_size, dtype=torch.bool))
        g = torch.Generator().manual_seed(3)
        embed = (torch.randn(dcfg.vocab_size, dcfg.hidden_size, generator=g) * 0.02)
        teacher = torch.randn(dcfg.draft_vocab_size, dcfg.hidden_size, generator=g) * 0.02
        # the whole lm_head (its draft rows: d2t is 0) for the eval's full-vocabulary argmax
        lm_head = torch.cat([teacher, torch.randn(dcfg.vocab_size - dcfg.draft_vocab_size,
                                                  dcfg.hidden_size, generator=g) * 0.02])
        rt = loop.build_runtime(cfg, device, DistInfo())
        evals, saves = [], []
        loop._run_eval, loop._save = timed(loop._run_eval, evals), timed(loop._save, saves)
        t = time.perf_counter()
        summary = loop.train(cfg, tmp / "04_train", data, draft, embed.to(torch.bfloat16),
                             teacher.to(torch.bfloat16), rt, lm_head.to(torch.bfloat16))
        wall = time.perf_counter() - t
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = summarize(args, cfg, summary, wall, evals, saves, rt.compile)
    (out_dir / "bench_train_stage.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "summary"}, indent=1))
    return 0


def summarize(args, cfg, summary: dict, wall: float, evals: list, saves: list,
              compiled: bool) -> dict:
    """Measured rates, and the default schedule's rate projected from the measured parts."""
    tokens = summary["tokens"]
    step_s = args.row / summary["tok_s"]  # steady-state windows (the first, compiling, is left out)
    eval_per_sample = evals[-1] / args.eval_samples if evals else 0.0  # the last eval is warm
    fixed = wall - args.steps * step_s - sum(evals) - sum(saves)  # compile and start-up
    schedule = {"steps": 500, "evals": 500 // cfg.eval_every, "eval_samples": 256, "saves": 1}
    period = (schedule["steps"] * step_s + schedule["evals"] * schedule["eval_samples"]
              * eval_per_sample + schedule["saves"] * (saves[-1] if saves else 0.0))
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "compiled": compiled, "fp8_gemm": summary.get("fp8_gemm"), "row": args.row,
            "steps": args.steps, "tokens": tokens, "eval_samples": args.eval_samples,
            "wall_s": wall, "stage_tok_s_this_run": tokens / wall,
            "step_tok_s": summary["tok_s"], "data_wait": summary["data_wait"],
            "eval_s": evals, "eval_s_per_sample": eval_per_sample, "save_s": saves,
            "startup_and_compile_s": fixed,
            "default_schedule": schedule,
            "default_schedule_tok_s": schedule["steps"] * args.row / period,
            "default_schedule_overhead": 1 - schedule["steps"] * step_s / period,
            "summary": summary}


if __name__ == "__main__":
    sys.exit(main())
