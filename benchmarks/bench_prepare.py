#!/usr/bin/env python3
"""Stage 01 speed: synthetic conversations of realistic length through the whole stage, next to
raw `tokenizer(text)` throughput on the texts of the same samples, in the same run.

The conversations mix the shapes of the Kimi-K2.5 recipe (chat, reasoning, code, tool calls,
agent traces; OpenAI schema, replies kept so that every sample is rendered with its loss mask)
over four datasets. The stage runs through `01_prepare_datasets.main` with 1 worker (in
process) and with each `--workers` count; the raw figure is one process calling
`tokenizer(text, add_special_tokens=False)` on every sample's rendered text. Figures printed:
records/s, tokens/s (wall), tokens per CPU-second, and the stage/raw ratio per process (tokens
per CPU-second of the stage over those of the raw tokenizer; the target is >= 0.5). CPU time
makes the per-process figure hold on a machine shared with other jobs.

    python benchmarks/bench_prepare.py --n 100000 --workers 2        # tiny target's tokenizer
    python benchmarks/bench_prepare.py --n 100000 --tokenizer bpe32k  # a 32K BPE trained here
    python benchmarks/bench_prepare.py --n 2000                       # quick check
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

import numpy as np

from eagle3.core.stage import STAGE_DIRS
from reference.stages import script_module

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {"chat": 0.35, "reasoning": 0.25, "code": 0.15, "tools": 0.15, "agent": 0.10}
DATASETS = {"bench_chat": ("chat", "code"), "bench_reasoning": ("reasoning",),
            "bench_tools": ("tools",), "bench_agent": ("agent",)}


class Words:
    """A Zipf-distributed stream of pseudo-words, numbers, punctuation and newlines."""

    def __init__(self, seed: int, n: int = 4_000_000):
        rng = np.random.default_rng(seed)
        syll = ["ka", "ri", "to", "men", "sa", "lo", "ve", "nu", "the", "and", "ing", "er",
                "pro", "con", "ta", "de", "si", "ex", "um", "or", "al", "ion", "be", "co"]
        vocab = ["".join(rng.choice(syll, size=rng.integers(1, 4))) for _ in range(6000)]
        vocab += [str(i) for i in range(200)] + [".", ",", ":", "(", ")", "=", "\n", "\n\n",
                                                  "def", "return", "{", "}", "\"x\"", "->"]
        p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
        self.words = list(np.asarray(vocab)[rng.choice(len(vocab), size=n, p=p / p.sum())])
        self.pos = 0
        self.rng = np.random.default_rng(seed + 1)

    def text(self, lo: int, hi: int) -> str:
        n = int(self.rng.integers(lo, hi))
        if self.pos + n > len(self.words):
            self.pos = 0
        out = " ".join(self.words[self.pos: self.pos + n])
        self.pos += n
        return out


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Run {name}.",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}


def conversation(shape: str, w: Words, k: int) -> dict:
    """One synthetic row in the OpenAI messages schema."""
    msgs = [{"role": "system", "content": w.text(10, 60)}] if k % 3 == 0 else []
    if shape in ("chat", "code"):
        for _ in range(1 + k % 3):
            msgs.append({"role": "user", "content": w.text(20, 200)})
            body = w.text(80, 500) if shape == "chat" else "```python\n" + w.text(80, 400) + "\n```"
            msgs.append({"role": "assistant", "content": body})
        return {"id": f"{shape}-{k}", "messages": msgs}
    if shape == "reasoning":
        msgs += [{"role": "user", "content": w.text(30, 150)},
                 {"role": "assistant", "content": w.text(50, 300),
                  "reasoning_content": w.text(300, 1500)}]
        return {"id": f"{shape}-{k}", "messages": msgs}
    tools = [_tool(f"tool_{j}") for j in range(2 + k % 3)]
    msgs.append({"role": "user", "content": w.text(20, 150)})
    for step in range(2 if shape == "tools" else 4 + k % 7):
        call = {"id": f"call_{step}", "type": "function", "function": {
            "name": f"tool_{step % len(tools)}", "arguments": json.dumps({"arg": w.text(2, 20)})}}
        msgs.append({"role": "assistant", "content": w.text(0, 40), "tool_calls": [call],
                     "reasoning_content": w.text(20, 120)})
        msgs.append({"role": "tool", "tool_call_id": f"call_{step}", "content": w.text(20, 300)})
    msgs.append({"role": "assistant", "content": w.text(30, 200)})
    return {"id": f"{shape}-{k}", "tools": tools, "messages": msgs}


def write_inputs(n: int, out: Path, seed: int) -> Path:
    """Four JSONL datasets of `n` rows in all and a recipe keeping their replies."""
    rng = np.random.default_rng(seed)
    w = Words(seed)
    shapes = rng.choice(list(SHAPES), size=n, p=list(SHAPES.values()))
    files = {name: (out / f"{name}.jsonl").open("w") for name in DATASETS}
    for k, shape in enumerate(shapes):
        name = next(d for d, s in DATASETS.items() if shape in s)
        files[name].write(json.dumps(conversation(shape, w, k)) + "\n")
    for f in files.values():
        f.close()
    recipe = {"name": "bench", "defaults": {"regenerate": False, "max_seq_len": 32768,
                                            "id_field": "id", "adapter": "openai"},
              "datasets": [{"name": d, "path": f"{d}.jsonl"} for d in DATASETS]}
    (out / "recipe.json").write_text(json.dumps(recipe))
    return out / "recipe.json"


def make_target(kind: str, out: Path, corpus: Path) -> Path:
    """A folder with only tokenizer files: the tiny target's, or a 32K BPE trained here."""
    from eagle3.tiny.target import TinyTargetConfig, build_tokenizer

    cfg = TinyTargetConfig()
    if kind == "bpe32k":
        cfg = TinyTargetConfig(bpe_vocab_size=32000)
        import eagle3.tiny.target as tt

        lines = corpus.read_text().splitlines()[:20000]
        tt._CORPUS = [json.dumps(json.loads(ln)["messages"]) for ln in lines]  # train text
    tok = build_tokenizer(cfg)
    tok.save_pretrained(out)
    return out


def run_stage(recipe: Path, target: Path, workdir: Path, workers: int) -> dict:
    """Run stage 01 from scratch; returns seconds, records and tokens."""
    shutil.rmtree(workdir, ignore_errors=True)
    main = script_module("01").main
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    rc = main(["--recipe", str(recipe), "--target", str(target), "--workdir", str(workdir),
               "--num-workers", str(workers), "--log-level", "WARNING"])
    seconds = time.perf_counter() - t0
    assert rc == 0, f"stage 01 failed ({rc})"
    out = json.loads((workdir / "01_prepared/manifest.json").read_text())["outputs"]["datasets"]
    return {"seconds": seconds, "cpu": _cpu_seconds() - cpu0,
            "records": sum(d["records"] for d in out.values()),
            "tokens": sum(d["tokens"] for d in out.values()),
            "samples": sum(d["samples"] for d in out.values())}


def raw_tokenizer(target: Path, workdir: Path) -> dict:
    """`tokenizer(text)` on every sample text the stage tokenized, timed alone."""
    from eagle3.core.chat import ChatRenderer
    from eagle3.core.records import read_jsonl
    from eagle3.core.target import load_tokenizer

    tok = load_tokenizer(target)
    renderer = ChatRenderer(tok, {"thinking": True})
    seconds, tokens, n = 0.0, 0, 0
    batch: list[str] = []
    for path in sorted((workdir / STAGE_DIRS["01"]).glob("*/conversations.jsonl")):
        for conv in read_jsonl(path):
            batch += [s.text for s in renderer.samples(conv["messages"], conv.get("tools"))]
            if len(batch) >= 2000:
                s, t = _time_tokenizer(tok, batch)
                seconds, tokens, n, batch = seconds + s, tokens + t, n + len(batch), []
    s, t = _time_tokenizer(tok, batch)
    return {"seconds": seconds + s, "tokens": tokens + t, "texts": n + len(batch)}


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                  resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _time_tokenizer(tok, texts: list[str]) -> tuple[float, int]:
    t0 = time.process_time()  # CPU time: the stage runs are compared by CPU time too
    n = sum(len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts)
    return time.process_time() - t0, n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000, help="conversations")
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="worker counts to run besides 1")
    parser.add_argument("--tokenizer", choices=["tiny", "bpe32k"], default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="keep inputs/outputs here")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as in the stage
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    recipe = write_inputs(args.n, root, args.seed)
    target = make_target(args.tokenizer, root / "target", root / "bench_chat.jsonl")
    print(f"inputs: {args.n:,} conversations in {time.perf_counter() - t0:.0f}s ({root})")
    results = {w: run_stage(recipe, target, root / f"run_w{w}", w)
               for w in [1] + [w for w in args.workers if w != 1]}
    raw = raw_tokenizer(target, root / "run_w1")
    assert raw["tokens"] == results[1]["tokens"], (raw["tokens"], results[1]["tokens"])
    raw_tps = raw["tokens"] / raw["seconds"]
    print(f"\nsamples {results[1]['samples']:,}  tokens {raw['tokens']:,}  "
          f"tokenizer {args.tokenizer}  cpus {os.cpu_count()}  load {os.getloadavg()[0]:.1f}")
    print("per process = tokens per CPU-second (stage: its main process and workers); "
          "wall = tokens per second elapsed")
    print(f"{'run':<24}{'wall s':>8}{'cpu s':>8}{'records/s':>11}{'tok/s wall':>12}"
          f"{'tok/cpu-s':>11}{'vs raw':>8}")
    print(f"{'raw tokenizer(text)':<24}{'':>8}{raw['seconds']:>8.1f}"
          f"{raw['texts'] / raw['seconds']:>11,.0f}{'':>12}{raw_tps:>11,.0f}{1.0:>8.2f}")
    for w, r in results.items():
        per_cpu = r["tokens"] / r["cpu"]
        print(f"{f'stage 01, {w} worker(s)':<24}{r['seconds']:>8.1f}{r['cpu']:>8.1f}"
              f"{r['records'] / r['seconds']:>11,.0f}{r['tokens'] / r['seconds']:>12,.0f}"
              f"{per_cpu:>11,.0f}{per_cpu / raw_tps:>8.2f}")
    w_max = max(results)
    print(f"\n{w_max} workers vs 1: wall {results[1]['seconds'] / results[w_max]['seconds']:.2f}x"
          f" faster, CPU per token {results[w_max]['cpu'] / results[1]['cpu']:.2f}x "
          "(1.00 = no parallel overhead: wall speed-up follows free cores)")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
