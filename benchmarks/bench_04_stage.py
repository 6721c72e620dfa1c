#!/usr/bin/env python3
"""Stage 04 as a user runs it: `04_train.py` itself, timed from process start to exit, against
its own step rate.

Builds a work directory in the formats the stages hand on (docs/PIPELINE.md): a target folder
holding config.json and only the embedding and lm_head (what 04 reads of a target), 03's
`vocab_mapping.safetensors`, and 02b's folder (files written by `hidden_states.pack` / `save`,
the functions 02b writes with, `index.jsonl` with each file's sha256, complete manifests). The
hidden states are synthetic (a learnable rule: the final state at t+1 is the last aux state at
t). Sample lengths follow the plan's data: log-normal with a mean of --mean-tokens (2,380, the
seed run's merged samples: train_plan_v4.md step 1), cut to [--min-tokens, --max-tokens], one
sample at --max-tokens so that rows are as wide as the plan's (04 packs to the longest sample;
8192 = the plan's --max-seq-len). Then it runs

    04_train.py --preset kimi-k2.5 --device cuda --lr 1e-4 --grad-accum 2 --num-workers 4
                [--epochs E] --max-eval-samples 32

which is the plan's command (train_plan_v4.md, step 7) for one GPU: the plan's eval (256
samples every 100 steps) is split over its 8 ranks, 32 samples each, so a one-GPU run evaluates
32 samples to spend per step what each of the plan's ranks spends; saves every 500 steps and
compiles, 04's defaults, as in the plan.

Figures (`$OUT/bench_04_stage.json`; `bench_04_stage.partial.json` every few seconds while it
runs, in case the machine is taken back):
- `stage_tokens_per_s`: tokens trained / the process's wall time, start-up, compile, evals,
  checkpoints and export included; `step_tokens_per_s`: the rate of its training windows after
  the first (evals and checkpoint copies left out: the step rate as the stage ran it); their
  ratio `stage_over_step`.
- Where the rest went: `startup_s` (process start to the first log window, less that window's
  tokens at the steady rate), `steady_tokens_per_s` (first to last log window, evals and
  checkpoints included), `end_s` (last window to exit: the last eval, the last checkpoint's
  write, the export), 04's manifest `timings`. Each log window's arrival is timed by polling
  metrics.jsonl (every 0.25 s).
- `projection`: the stage rate over the plan's run per GPU (--plan-tokens, 3 epochs of 240M
  tokens over 8 GPUs), wall = startup_s + tokens / steady + end_s; validated on this run by
  fitting start-up and steady rate on its first half and predicting when its last window
  arrived (`projection.validation`).

One H200 (BENCHMARKS.md, "Training stage (04), start to exit"; started detached, since a device
command lasts 10 minutes at most, then followed through status.json):
    setsid nohup python3 benchmarks/bench_04_stage.py --out /tmp/b04 --files 120 --epochs 40 \
        > /tmp/b04.log 2>&1 &
CPU smoke test (tiny target dimensions):
    python3 benchmarks/bench_04_stage.py --tiny --files 24 --epochs 6 --mean-tokens 200 \
        --min-tokens 32 --max-tokens 512
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
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
    p.add_argument("--files", type=int, default=120, help="train files (samples)")
    p.add_argument("--eval-files", type=int, default=32)
    p.add_argument("--mean-tokens", type=int, default=2380,
                   help="mean sample length (log-normal, sigma --length-sigma)")
    p.add_argument("--length-sigma", type=float, default=1.0)
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--plan-tokens", type=float, default=3 * 240e6 / 8,
                   help="tokens one GPU trains in the plan's run (projection)")
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
    mu = math.log(args.mean_tokens) - args.length_sigma ** 2 / 2  # log-normal of that mean
    lines, tokens = [], 0
    for idx in range(n):
        T = args.max_tokens if idx == 0 else min(args.max_tokens, max(
            args.min_tokens, round(rng.lognormvariate(mu, args.length_sigma))))
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


def _fit(windows: list[dict]) -> tuple[float, float]:
    """(start-up s, steady tokens/s) from timed log windows: the steady rate from the first
    window's arrival to the last's, the start-up what is left before the first at that rate."""
    later = windows[1:]
    steady = sum(w["tokens"] for w in later) / (later[-1]["t"] - windows[0]["t"])
    return windows[0]["t"] - windows[0]["tokens"] / steady, steady


def summarize(work: Path, built: dict, arrivals: dict, wall_s: float | None, rc, cmd,
              plan_tokens: float) -> dict:
    """The figures of the module doc; `arrivals` maps a metrics.jsonl line number to the
    second (since process start) it was seen; `wall_s` None while the run goes on."""
    stage_dir = work / STAGE_DIRS["04"]
    manifest = json.loads((stage_dir / "manifest.json").read_text()) \
        if wall_s is not None and (stage_dir / "manifest.json").exists() else {}
    out = manifest.get("outputs", {})
    rows = []
    if (stage_dir / "metrics.jsonl").exists():
        for i, line in enumerate((stage_dir / "metrics.jsonl").read_text().splitlines()):
            if i in arrivals and line.strip():
                rows.append({**json.loads(line), "t": arrivals[i]})
    windows = [r for r in rows if "tok_s" in r]
    timed = windows[1:]  # the first window compiles
    step_tok_s = (sum(r["tokens"] for r in timed) / sum(r["elapsed_s"] for r in timed)
                  if timed else None)
    tokens = out.get("tokens") or sum(r["tokens"] for r in windows)
    result = {"command": " ".join(cmd), "rc": rc, "wall_s": wall_s, "tokens": tokens,
              "stage_tokens_per_s": tokens / wall_s if wall_s else None,
              "step_tokens_per_s": step_tok_s, "steps_logged": windows[-1]["step"] if windows
              else 0, "steps": out.get("num_steps"), "timings": out.get("timings"),
              "data_wait": out.get("data_wait"), "padding": out.get("padding"),
              "eval_sim_accept": out.get("eval_sim_accept"), "workdir": built,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if result["stage_tokens_per_s"] and step_tok_s:
        result["stage_over_step"] = result["stage_tokens_per_s"] / step_tok_s
    if len(windows) >= 4:
        startup, steady = _fit(windows)
        result.update(startup_s=startup, steady_tokens_per_s=steady,
                      steady_over_step=steady / step_tok_s,
                      end_s=wall_s - windows[-1]["t"] if wall_s else None)
        half = [w for w in windows if w["t"] <= windows[0]["t"] + (windows[-1]["t"] -
                                                                  windows[0]["t"]) / 2]
        if len(half) >= 3 and result["end_s"] is not None:
            s_half, r_half = _fit(half)
            predicted = s_half + sum(w["tokens"] for w in windows) / r_half
            plan_wall = startup + plan_tokens / steady + result["end_s"]
            result["projection"] = {
                "plan_tokens": plan_tokens, "plan_wall_s": plan_wall,
                "plan_stage_tokens_per_s": plan_tokens / plan_wall,
                "plan_stage_over_step": plan_tokens / plan_wall / step_tok_s,
                "validation": {"fitted_on_windows": len(half), "of": len(windows),
                               "last_window_predicted_s": predicted,
                               "last_window_measured_s": windows[-1]["t"],
                               "relative_error": predicted / windows[-1]["t"] - 1}}
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or out / "bench_04_work"
    status = out / "status.json"
    built = build_workdir(work, args)
    shutil.rmtree(work / STAGE_DIRS["04"], ignore_errors=True)  # a fresh run, never a resume
    cmd = train_command(work, args)
    print(json.dumps(built), flush=True)
    metrics = work / STAGE_DIRS["04"] / "metrics.jsonl"
    arrivals: dict[int, float] = {}  # metrics.jsonl line -> seconds since process start
    t0 = time.time()
    last_partial = 0.0
    with (out / "04.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        status.write_text(json.dumps({"pid": proc.pid, "started": t0, "state": "running"}))
        while proc.poll() is None:
            time.sleep(0.25)
            now = time.time() - t0
            if metrics.exists():
                text = metrics.read_text()
                complete = text[:text.rfind("\n") + 1].splitlines()
                for i in range(len(arrivals), len(complete)):
                    arrivals[i] = now
            if now - last_partial > 10:
                last_partial = now
                partial = summarize(work, built, arrivals, None, None, cmd, args.plan_tokens)
                atomic_write_json(out / "bench_04_stage.partial.json", partial)
        rc = proc.returncode
    wall = time.time() - t0
    result = summarize(work, built, arrivals, wall, rc, cmd, args.plan_tokens)
    atomic_write_json(out / "bench_04_stage.json", result)
    status.write_text(json.dumps({"pid": proc.pid, "started": t0, "state": "done", "rc": rc}))
    print(json.dumps({k: v for k, v in result.items() if k != "timings"}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
