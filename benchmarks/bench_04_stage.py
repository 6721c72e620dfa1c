#!/usr/bin/env python3
"""Stage 04 as a user runs it: `04_train.py` itself, timed from process start to exit, against
its own step rate.

Builds a work directory in the formats the stages hand on (docs/PIPELINE.md): a target folder
holding config.json and only the embedding and lm_head (what 04 reads of a target), 03's
`vocab_mapping.safetensors`, and 02b's folder (files written by `hidden_states.pack` / `save`,
the functions 02b writes with, `index.jsonl` with each file's sha256, complete manifests). The
hidden states are synthetic (a learnable rule: the final state at t+1 is the last aux state at
t) and the sample lengths are drawn between --min-tokens and --max-tokens. Then it runs

    04_train.py --preset kimi-k2.5 --device cuda --lr 1e-4 --grad-accum 2 --num-workers 4
                [--epochs E] --max-eval-samples 32

which is the plan's command (train_plan_v4.md, step 7) for one GPU: the plan's eval (256
samples every 100 steps) is split over its 8 ranks, 32 samples each, so a one-GPU run evaluates
32 samples to spend per step what each of the plan's ranks spends; saves every 500 steps and
compiles, 04's defaults, as in the plan. Rows are as wide as the longest sample (--max-tokens,
8192 by default: the plan's --max-seq-len).

Figures (`$OUT/bench_04_stage.json`): `stage_tokens_per_s` = tokens trained / the process's wall
time (start-up, compile, evals, checkpoints, export included); `step_tokens_per_s` = the rate of
its training windows after the first (evals and checkpoint copies left out: the step rate as
the stage ran it); their ratio; and where the rest went (04's manifest `timings`).

One H200 (BENCHMARKS.md, "The whole stage, end to end", ran it with 5,120-token samples;
started detached, since a device command lasts 10 minutes at most, then followed through
status.json):
    setsid nohup python3 benchmarks/bench_04_stage.py --out /tmp/b04 --files 60 --epochs 48 \
        --max-tokens 5120 > /tmp/b04.log 2>&1 &
CPU smoke test (tiny target dimensions):
    python3 benchmarks/bench_04_stage.py --tiny --files 24 --epochs 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core import hidden_states as hs  # noqa: E402
from eagle3.core.presets import get_preset  # noqa: E402
from eagle3.core.stage import STAGE_DIRS, atomic_write_json  # noqa: E402
from eagle3.core.target import default_capture_layers  # noqa: E402
from eagle3.vocab.mapping import build_mapping  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny-deepseek-v3 dimensions, CPU")
    p.add_argument("--files", type=int, default=110, help="train files (samples)")
    p.add_argument("--eval-files", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workdir", type=Path, default=None, help="default: a folder under $OUT")
    p.add_argument("--out", type=Path, default=None, help="results (default: $OUT or bench_out)")
    p.add_argument("--train-args", default="", help="extra 04 flags, one string")
    return p.parse_args(argv)


def write_target(folder: Path, preset, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """config.json plus the two tensors 04 reads (embedding, lm_head), bf16."""
    folder.mkdir(parents=True, exist_ok=True)
    H, V = preset.hidden_size, preset.vocab_size
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "hidden_size": H, "num_hidden_layers": preset.num_hidden_layers, "vocab_size": V,
              "num_attention_heads": preset.num_attention_heads,
              "intermediate_size": preset.intermediate_size, "rms_norm_eps": 1e-6,
              "rope_theta": 50000.0, "max_position_embeddings": 262144,
              "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    embed = (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)
    lm_head = (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head},
              str(folder / "model.safetensors"))
    return embed, lm_head


def write_split(root: Path, n: int, args, H: int, V: int, layers: list[int], seed: int) -> int:
    """`n` hidden-state files of random lengths in 02b's layout (bf16), with index.jsonl."""
    rng = random.Random(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # random states drawn on the GPU: fast
    g = torch.Generator(dev).manual_seed(seed)
    lines, tokens = [], 0
    for idx in range(n):
        T = rng.randint(args.min_tokens, args.max_tokens)
        ids = torch.randint(0, V, (T,), generator=g, device=dev).cpu()
        aux = [torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16).cpu()
               for _ in range(3)]
        final = torch.roll(aux[2], 1, dims=0)
        rid = f"bench/{seed}/{idx}"
        data = hs.pack(ids, torch.ones(T, dtype=torch.long), aux, final,
                       {"id": rid, "capture_layers": layers, "final": "post_norm",
                        "source": "bench"})
        path = hs.file_path(root, idx)
        size = hs.save(data, path)
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append({"idx": idx, "id": rid, "tokens": T, "bytes": size, "sha256": sha})
        tokens += T
    (root / "index.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return tokens


def build_workdir(work: Path, args) -> dict:
    preset = get_preset("tiny-deepseek-v3" if args.tiny else "kimi-k2.5")
    H, V = preset.hidden_size, preset.vocab_size
    layers = default_capture_layers(preset.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    write_target(work / "target", preset, g)
    hot = torch.randperm(V, generator=g)[:preset.draft_vocab_size].sort().values.numpy()
    vocab = work / STAGE_DIRS["03"]
    vocab.mkdir(parents=True, exist_ok=True)
    save_file(build_mapping(hot, V), str(vocab / "vocab_mapping.safetensors"))
    atomic_write_json(vocab / "manifest.json", {"stage": STAGE_DIRS["03"], "complete": True})
    states = work / STAGE_DIRS["02b"]
    tokens = {"train": write_split(states / "train", args.files, args, H, V, layers, 1),
              "eval": write_split(states / "eval", args.eval_files, args, H, V, layers, 2)}
    atomic_write_json(states / "manifest.json", {"stage": STAGE_DIRS["02b"], "complete": True,
                                                 "capture_layers": layers, "dtype": "bf16"})
    return {"preset": "tiny-deepseek-v3" if args.tiny else "kimi-k2.5", "tokens": tokens,
            "files_gb": sum(p.stat().st_size for p in states.rglob("*.pt")) / 1e9,
            "build_s": time.perf_counter() - t0}


def train_command(work: Path, args) -> list[str]:
    cmd = [sys.executable, str(ROOT / "04_train.py"), "--workdir", str(work),
           "--target", str(work / "target"), "--epochs", str(args.epochs), "--lr", "1e-4",
           "--log-every", "10"]
    if args.tiny:
        cmd += ["--preset", "tiny-deepseek-v3", "--device", "cpu", "--max-seq-len", "512",
                "--eval-every", "4", "--save-every", "6", "--max-eval-samples", "8",
                "--num-workers", "1"]
    else:
        cmd += ["--preset", "kimi-k2.5", "--device", "cuda", "--grad-accum", "2",
                "--num-workers", "4", "--max-eval-samples", "32"]
    return cmd + args.train_args.split()


def summarize(work: Path, built: dict, wall_s: float, rc: int, cmd: list[str]) -> dict:
    manifest = json.loads((work / STAGE_DIRS["04"] / "manifest.json").read_text()) \
        if (work / STAGE_DIRS["04"] / "manifest.json").exists() else {}
    out = manifest.get("outputs", {})
    rows = [json.loads(line) for line in
            (work / STAGE_DIRS["04"] / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "tok_s" in r][1:]  # the first window compiles
    step_tok_s = (sum(r["tokens"] for r in windows) / sum(r["elapsed_s"] for r in windows)
                  if windows else None)
    tokens = out.get("tokens", 0)
    stage = tokens / wall_s if wall_s else None
    return {"command": " ".join(cmd), "rc": rc, "wall_s": wall_s, "tokens": tokens,
            "stage_tokens_per_s": stage, "step_tokens_per_s": step_tok_s,
            "stage_over_step": stage / step_tok_s if stage and step_tok_s else None,
            "steps": out.get("num_steps"), "timings": out.get("timings"),
            "data_wait": out.get("data_wait"), "padding": out.get("padding"),
            "eval_sim_accept": out.get("eval_sim_accept"), "workdir": built,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or out / "bench_04_work"
    status = out / "status.json"
    built = build_workdir(work, args)
    cmd = train_command(work, args)
    print(json.dumps(built), flush=True)
    t0 = time.time()
    with (out / "04.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        status.write_text(json.dumps({"pid": proc.pid, "started": t0, "state": "running"}))
        rc = proc.wait()
    wall = time.time() - t0
    result = summarize(work, built, wall, rc, cmd)
    (out / "bench_04_stage.json").write_text(json.dumps(result, indent=2))
    status.write_text(json.dumps({"pid": proc.pid, "started": t0, "state": "done", "rc": rc}))
    print(json.dumps({k: v for k, v in result.items() if k != "timings"}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
