#!/usr/bin/env python3
"""Generation speed of 01b's hf backend: transformers' generate (`--hf-engine generate`, today's
path) beside the fast engine (eagle3/generate/fast.py) on the same prompts, in one run.

Prompts: the repo's chat prompts (`datasets/samples/chat_prompts.jsonl` and the `chat`, `code`,
`math` sets of prompts/) rendered with the target's chat template, or `--prompts` (sets or JSONL
files, as 05's `--prompt-sets`), cycled to `--num-prompts` and sorted longest first into fixed
batches as 01b does. Rows, greedy unless named, in `--dtype` (bf16) unless named:

- `generate b256`: `HFGenerator` on the first `--generate-batches` batches only (1.5K tok/s
  for SmolLM2 in bf16 on an H100);
  `generate b128`: the same prompts in half-size batches, whose share of outputs identical to
  `generate b256`'s is the floor for bf16 (near-ties flip with the batch shape);
- `fast b256` (grouped decode attention, the default), `fast b256 expanded` (transformers' own
  sdpa call on a cache of every query head): all prompts, the first batches compared with
  `generate b256` token for token (identical share; where not, the first position that differs);
- `fast bN` for the other `--batch-sizes`, and `fast b256 T=1` (sampled, `--temperature`);
- `generate/fast b256 float32`: the first `--float32-prompts` distinct prompts (01b's order,
  repeats left out) with the target in float32, where rounding cannot flip a token: the fast
  engine's outputs must be generate's.

Each row: prompts, generated tokens (through eos), seconds, generated tok/s (with and without
graph capture), the ratio to generate's, identical share, peak GPU memory, cache size, graphs
captured and the capture time, decode steps replayed from graphs, and why steps ran eagerly.
Results go to `<out>/bench_generate.json` (`--out`, default $OUT or runs/bench_generate).

    python -m eagle3.smollm2.target --out runs/smollm2/target      # SmolLM2-135M-Instruct
    python benchmarks/bench_generate.py --target runs/smollm2/target   # one GPU, ~2-3 min
    python benchmarks/bench_generate.py --target DIR --device cpu --dtype float32 \\
        --num-prompts 6 --batch-sizes 4 8 --max-new-tokens 6 --float32-prompts 4  # CPU smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.bench.prompts import load_prompt_set  # noqa: E402
from eagle3.core.chat import ChatRenderer  # noqa: E402
from eagle3.core.target import load_hf_model, load_tokenizer  # noqa: E402
from eagle3.generate.fast import FastGenerator  # noqa: E402
from eagle3.generate.jobs import GenerationJob, HFGenerator, padding_id  # noqa: E402

DEFAULT_PROMPTS = [str(ROOT / "datasets/samples/chat_prompts.jsonl"), "chat", "code", "math"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target model folder")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS,
                   help="prompt sets or JSONL files (default: the repo's chat prompts)")
    p.add_argument("--num-prompts", type=int, default=1024, help="prompts, cycled (1024)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="budget per prompt (256)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 512, 1024],
                   help="fast engine batches (256 512 1024); the first is compared")
    p.add_argument("--generate-batches", type=int, default=1,
                   help="batches of the first batch size transformers' generate runs (1)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the sampled row's temperature (0 = no sampled row)")
    p.add_argument("--float32-prompts", type=int, default=256,
                   help="distinct prompts of the float32 rows (0 = none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None,
                   help="folder of bench_generate.json (default $OUT or runs/bench_generate)")
    return p.parse_args(argv)


def load_prompts(args, tokenizer) -> list[list[int]]:
    """`--num-prompts` prompts cycled from the sets, sorted longest first (01b's order)."""
    renderer = ChatRenderer(tokenizer)
    pool = [ids for spec in args.prompts
            for ids in load_prompt_set(spec, ROOT, renderer).prompts]
    prompts = list(itertools.islice(itertools.cycle(pool), args.num_prompts))
    return sorted(prompts, key=len, reverse=True)


def sync(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(name: str, args, fn, prompts) -> tuple[dict, list]:
    """Run `fn(prompts)` timed (synchronised) with the GPU's peak memory; its row and outputs."""
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = sync(args.device)
    outputs = fn(prompts)
    seconds = sync(args.device) - t0
    tokens = sum(len(ids) for ids, _ in outputs)
    peak = torch.cuda.max_memory_allocated() / 1e9 if args.device.startswith("cuda") else 0.0
    row = {"row": name, "prompts": len(prompts), "tokens": tokens,
           "stopped": sum(r == "stop" for _, r in outputs), "seconds": round(seconds, 3),
           "tok_s": round(tokens / seconds, 1), "peak_gb": round(peak, 2)}
    print(f"  {name}: {tokens:,} tokens in {seconds:.1f}s = {tokens / seconds:,.0f} tok/s",
          flush=True)
    return row, outputs


def compare(outputs, reference, prompts) -> dict:
    """Share of outputs identical to the reference's, and the first differing positions;
    `prompts` (theirs) counts the distinct ones (cycled prompts repeat, sorted side by side)."""
    firsts = []
    for (got, _), (want, _) in zip(outputs, reference):
        if got != want:
            firsts.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                               min(len(got), len(want))))
    n = len(reference)
    return {"identical": round(1 - len(firsts) / n, 4), "compared": n,
            "compared_distinct": len({tuple(p) for p in prompts[:n]}),
            "first_divergence": sorted(firsts)[:32],
            "first_divergence_median": statistics.median(firsts) if firsts else None}


def generate_row(name: str, args, model, tokens: tuple, prompts, batch: int):
    """transformers' generate (HFGenerator) over `prompts` in batches of `batch`."""
    hf = HFGenerator(model, *tokens)

    def run_batches(ps):
        out = []
        for i in range(0, len(ps), batch):
            out += hf.generate([GenerationJob(str(i + k), "bench", p, args.max_new_tokens)
                                for k, p in enumerate(ps[i:i + batch])])
        return out

    return measure(name, args, run_batches, prompts)


def fast_row(name: str, args, model, tokens: tuple, prompts, options: dict,
             reference=None) -> tuple[dict, list]:
    """One fast-engine row (`options`: batch, temperature, decode_attention); its first
    outputs are compared with `reference`."""
    gen = FastGenerator(model, *tokens, max_batch=options["batch"],
                        decode_attention=options.get("decode_attention", "grouped"))
    row, outputs = measure(name, args, lambda ps: gen.generate_ids(
        ps, args.max_new_tokens, options.get("temperature", 0.0), seed=0), prompts)
    s = gen.stats
    row.update(tok_s_without_capture=round(row["tokens"] / max(row["seconds"] - s.capture_s,
                                                                1e-9), 1),
               decode_attention=gen.decode_attention, kv_gb=round(s.kv_bytes / 1e9, 2),
               **{k: v for k, v in asdict(s).items() if k not in ("tokens", "kv_bytes")})
    if reference is not None:
        row.update(compare(outputs[: len(reference)], reference, prompts))
    return row, outputs


def load(args, dtype: str):
    t0 = time.perf_counter()
    model = load_hf_model(args.target, dtype, args.device, args.trust_remote_code)
    print(f"target {args.target} ({model.config.model_type}, {dtype}, {args.device}) loaded in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    return model


def run(args) -> dict:
    tokenizer = load_tokenizer(args.target, args.trust_remote_code)
    eos = ChatRenderer(tokenizer).end_of_turn_id
    tokens = ([eos], padding_id(tokenizer, eos))
    prompts = load_prompts(args, tokenizer)
    print(f"{len(prompts)} prompts of {len(prompts[-1])}-{len(prompts[0])} tokens, budget "
          f"{args.max_new_tokens}", flush=True)
    model = load(args, args.dtype)
    b0 = args.batch_sizes[0]
    head = prompts[: b0 * args.generate_batches]
    generate_row("warm-up", args, model, tokens, head[:2], b0)  # kernels, handles: not timed
    row, reference = generate_row(f"generate b{b0}", args, model, tokens, head, b0)
    rows = [row]
    row, floor = generate_row(f"generate b{b0 // 2}", args, model, tokens, head, b0 // 2)
    rows.append({**row, **compare(floor, reference, head)})
    plan = [(f"fast b{b0}", {"batch": b0}),
            (f"fast b{b0} expanded", {"batch": b0, "decode_attention": "expanded"})]
    plan += [(f"fast b{b}", {"batch": b}) for b in args.batch_sizes[1:]]
    if args.temperature > 0:
        plan.append((f"fast b{b0} T={args.temperature:g}",
                     {"batch": b0, "temperature": args.temperature}))
    for name, options in plan:
        ref = None if options.get("temperature") else reference
        rows.append(fast_row(name, args, model, tokens, prompts, options, ref)[0])
    if args.float32_prompts:
        del model
        model = load(args, "float32")
        # the identity claim on distinct prompts (cycling puts copies side by side), in order
        fp = [list(ids) for ids in dict.fromkeys(map(tuple, prompts))][: args.float32_prompts]
        row, ref32 = generate_row(f"generate b{b0} float32", args, model, tokens, fp, b0)
        rows += [row, fast_row(f"fast b{b0} float32", args, model, tokens, fp, {"batch": b0},
                               ref32)[0]]
    for row in rows:
        base = rows[-2] if row["row"].endswith("float32") else rows[0]
        row["x_generate"] = round(row["tok_s"] / base["tok_s"], 2)
    return {"target": str(args.target), "model_type": model.config.model_type,
            "dtype": args.dtype, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
            else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "prompts": len(prompts), "prompt_tokens": [len(prompts[-1]), len(prompts[0])],
            "max_new_tokens": args.max_new_tokens, "rows": rows}


def print_table(result: dict) -> None:
    cols = [("row", "row", "{}"), ("prompts", "prompts", "{:,}"), ("tokens", "tokens", "{:,}"),
            ("s", "seconds", "{:.1f}"), ("tok/s", "tok_s", "{:,.0f}"),
            ("tok/s -capt", "tok_s_without_capture", "{:,.0f}"),
            ("x gen", "x_generate", "{:.2f}"), ("identical", "identical", "{:.1%}"),
            ("peak GB", "peak_gb", "{:.1f}"), ("cache GB", "kv_gb", "{:.1f}"),
            ("graphs", "graphs", "{}"), ("capture s", "capture_s", "{:.1f}"),
            ("graph steps", "graph_steps", "{:,}"), ("steps", "decode_steps", "{:,}")]
    table = [[h for h, _, _ in cols]] + [
        [fmt.format(r[k]) if r.get(k) is not None else "-" for _, k, fmt in cols]
        for r in result["rows"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    print(f"\n{result['device_name']}, {result['model_type']} {result['dtype']}, torch "
          f"{result['torch']}, transformers {result['transformers']}; {result['prompts']} "
          f"prompts of {result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} tokens, "
          f"budget {result['max_new_tokens']}")
    for line in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths))))
    for r in result["rows"]:
        if r.get("eager_reason"):
            print(f"{r['row']}: decoded eagerly: {r['eager_reason']}")
        if r.get("first_divergence"):
            print(f"{r['row']}: first differing positions {r['first_divergence']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = args.out or Path(os.environ.get("OUT") or ROOT / "runs/bench_generate")
    result = run(args)
    print_table(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generate.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out / 'bench_generate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
