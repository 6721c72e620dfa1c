#!/usr/bin/env python3
"""Hidden-state storage layouts on the tiny target (CPU): bytes/token and acceptance of drafts
trained from each, same data, same seed, same flags, the offline evaluator of 05.

Takes a demo work folder with the tiny target and merged data (`bash demo.sh runs/demo`, or its
`target/` and `01c_merged/`); runs 03 there (`--draft-vocab 256`, as the demo) when missing.
For each layout a folder under `--out` links the merged data and vocabulary, runs 02b
`--backend hf --dtype <layout>` and 04 with demo.sh's flags (seed 0); the top-k files are
trained twice, `--topk-teacher renorm` and `tail`. Every draft is then measured by 05
`--backend hf --steps 3 7` on the same prompts (the eval split, as demo.sh). Also printed: the teacher mass outside the top K (from the bf16 files' final
states), the quantity the two truncations treat differently.

    bash demo.sh runs/demo
    OMP_NUM_THREADS=1 python benchmarks/bench_layouts.py --demo runs/demo --out runs/layouts

Tiny-target figures are weak evidence (hidden 64, a 256-id draft vocabulary); the GPU
reference run (reference/run_reference.py, phase 3) measures the same layouts on a real target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.core import hidden_states as hs
from eagle3.core.loops import loop_stats, loop_summary
from eagle3.core.target import load_lm_head
from eagle3.train.data import list_files
from eagle3.vocab.mapping import hot_ids_from_d2t
from reference.stages import linked_workdir, script_module

# run name -> (02b --dtype, 04 --topk-teacher, run whose 02b files it trains from)
RUNS = {"bf16": ("bf16", None, None), "fp8": ("fp8", None, None),
        "fp8_all": ("fp8-all", None, None), "topk": ("fp8-topk", "renorm", None),
        "topk_tail": ("fp8-topk", "tail", "topk")}
TRAIN = ["--lr", "1e-3", "--max-seq-len", "512", "--num-workers", "1", "--eval-every", "100",
         "--log-every", "50", "--seed", "0"]  # demo.sh's 04 flags, --epochs apart
BENCH = ["--backend", "hf", "--steps", "3", "7"]  # + --max-new-tokens, --num-prompts
TAIL_K = (4, 8, 16, 32, 64)


def run(stage: str, argv: list) -> None:
    rc = script_module(stage).main([str(a) for a in argv]) or 0
    if rc:
        raise SystemExit(f"{stage} {' '.join(map(str, argv))} exited with {rc}")


def workdir_of(name: str, demo: Path, out: Path) -> Path:
    links = {"01c_merged": demo / "01c_merged", "03_vocab": demo / "03_vocab"}
    shared = RUNS[name][2]
    if shared:
        links["02b_hidden_states"] = out / shared / "02b_hidden_states"
    return linked_workdir(out / name, links)


def tail_mass(bf16_workdir: Path, target: Path) -> dict:
    """Mean teacher mass outside the top K over supervised tokens, from the bf16 files."""
    d2t = load_file(str(bf16_workdir / "03_vocab" / "vocab_mapping.safetensors"))["d2t"]
    hot = load_lm_head(target, hot_ids_from_d2t(d2t)).float()
    sums, n = torch.zeros(len(TAIL_K), dtype=torch.float64), 0
    files = list_files(bf16_workdir / "02b_hidden_states" / "train")
    if not files:
        raise SystemExit(f"no bf16 files under {bf16_workdir}/02b_hidden_states/train")
    for path in files:
        data = hs.load(path)
        _, final = hs.unpack(data, torch.float32)
        p = torch.softmax(final[data["loss_mask"].bool()] @ hot.T, -1)
        top = p.sort(-1, descending=True).values.cumsum(-1)
        for j, k in enumerate(TAIL_K):
            sums[j] += (1 - top[:, min(k, top.shape[1]) - 1]).clamp(min=0).sum().double()
        n += p.shape[0]
    return {str(k): float(sums[j] / max(n, 1)) for j, k in enumerate(TAIL_K)}


def loop_free_acceptance(step: dict) -> float | None:
    """Acceptance over the rounds before each output's first loop: the library's one definition
    (eagle3/core/loops.py), as 05 reports it; None when no such round exists."""
    return loop_summary(step["outputs"], step["accept_lengths"])["loop_free_acceptance"]


def measure(name: str, demo: Path, target: Path, out: Path, args) -> dict:
    """02b (unless shared), 04 and 05 of one layout run; its figures (`args`: the CLI's)."""
    dtype, mode, shared = RUNS[name]
    topk = args.topk
    w = workdir_of(name, demo, out)
    if not shared:
        extra = ["--teacher-topk", topk] if dtype == "fp8-topk" else []
        run("02b", ["--workdir", w, "--target", target, "--backend", "hf", "--dtype", dtype,
                    *extra])
    run("04", ["--workdir", w, "--target", target, *TRAIN, "--epochs", args.epochs,
               *(["--topk-teacher", mode] if mode else [])])
    run("05", ["--workdir", w, "--target", target, *BENCH, "--max-new-tokens",
               args.max_new_tokens, "--num-prompts", args.num_prompts])
    m = json.loads((w / "02b_hidden_states" / "manifest.json").read_text())
    tokens = sum(o["tokens"] for o in m["outputs"].values())
    res = json.loads((w / "05_benchmark" / "results.json").read_text())
    (sset,) = res["prompt_sets"].values()
    return {"dtype": dtype, "topk_teacher": mode, "bytes_per_token": m["disk_bytes"] / tokens,
            "payload_bytes_per_token": hs.bytes_per_token(m["hidden_size"], dtype, topk),
            "kimi_bytes_per_token": hs.bytes_per_token(7168, dtype, 64),
            "acceptance": {s: r["acceptance_length"] for s, r in sset["steps"].items()},
            "loop_share": {s: loop_stats(r["outputs"]).to_dict()["share"]
                           for s, r in sset["steps"].items()},
            "loop_free_acceptance": {s: loop_free_acceptance(r) for s, r in sset["steps"].items()},
            "prompts": sset.get("prompts")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", type=Path, required=True, help="a finished demo.sh work folder")
    ap.add_argument("--out", type=Path, required=True, help="folder of the layout runs")
    ap.add_argument("--topk", type=int, default=16, help="02b --teacher-topk (draft vocab 256)")
    ap.add_argument("--epochs", type=int, default=6, help="04 --epochs (demo.sh: 6)")
    ap.add_argument("--num-prompts", type=int, default=8, help="05 prompts of the eval split")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="05 tokens per prompt")
    ap.add_argument("--draft-vocab", type=int, default=256, help="03 --draft-vocab when 03 runs")
    args = ap.parse_args(argv)
    target = args.demo / "target"
    if not (args.demo / "03_vocab" / "manifest.json").exists():
        run("03", ["--workdir", args.demo, "--target", target, "--draft-vocab",
                   args.draft_vocab])
    rows = {name: measure(name, args.demo, target, args.out, args) for name in RUNS}
    result = {"topk": args.topk, "epochs": args.epochs, "runs": rows,
              "tail_mass": tail_mass(args.out / "bf16", target)}
    (args.out / "layouts.json").write_text(json.dumps(result, indent=1))
    print("| layout | bytes/token (files) | payload | Kimi-K2.5 | acceptance @3 | @7 | "
          "loop share @3 / @7 | loop-free acceptance @3 / @7 |")
    for name, r in rows.items():
        a, loop, free = r["acceptance"], r["loop_share"], r["loop_free_acceptance"]
        print(f"| {name} | {r['bytes_per_token']:,.0f} | {r['payload_bytes_per_token']:,} | "
              f"{r['kimi_bytes_per_token']:,} | {a['3']:.3f} | {a['7']:.3f} | "
              f"{loop['3']:.3f} / {loop['7']:.3f} | "
              + " / ".join("–" if free[k] is None else f"{free[k]:.3f}" for k in ("3", "7"))
              + " |")
    print("teacher mass outside the top K:", result["tail_mass"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
