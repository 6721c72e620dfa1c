#!/usr/bin/env python3
"""The per-dataset tails of 01b and of 01's self-written datasets on a server, on a CPU: wall
time one dataset after another (how both stages ran before) against one pool (01b: every
dataset's jobs through one pool of requests, eagle3/generate/runner.py; 01: every dataset's
rounds together and a phase's batches at once, eagle3/prepare/selfwritten.py), and the ratio.

The server is the fake SGLang server (eagle3.testing.fake_sglang) in a process of its own with a
simulated decode: continuous batching in which each step advances every request in flight by one
token and lasts `step-ms + per-seq-us x in flight` (the defaults, 2.1 ms alone, 2.3 ms at 16
and 16 ms at 1,024 in flight or 64K tok/s, are SGLang 0.5.17 decoding Qwen2.5-Coder-1.5B on one
H100: its plain step at concurrency 1 and 16 measured with `--load-format dummy`, and the decode
rate benchmarks/results/sglang_gpu_h100_2026-12-07 logged at ~1,024 in flight); no prefill. The workload is that run's at
`--scale`, the server's per-request cost and the concurrency scaled alike (so the simulated
times are the full run's), and all times by `--time-scale`:
- 01b: four datasets (4,800, 1,600, 2,400 and 121 jobs, 512-token budget), reply lengths
  exponential, cut at the budget as often as there (16%, 3.5%, 10%, 5%);
- 01: three self-written datasets (counts, held-out prompts, turns and user-turn budgets of that
  run's recipe), user turns too long (cut at the budget) as often as there (20%, 30%, 12%),
  others 20-120 tokens, replies as qwen_code's.
Both ways write the same records (checked). Not a timed test: figures vary with the load.

    python benchmarks/bench_pool.py                        # a quarter of the H100 run
    python benchmarks/bench_pool.py --stage 01b --scale 0.1 --time-scale 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import socket
import sys
import tempfile
import time
import zlib
from pathlib import Path

from eagle3.core.chat import ChatRenderer
from eagle3.core.server import RetryPolicy, ServerPool, gather_or_cancel
from eagle3.core.target import load_tokenizer
from eagle3.generate.backends import SGLangBackend
from eagle3.generate.jobs import GenerationJob, RecordSink
from eagle3.generate.runner import Route, RunnerConfig, run_pooled
from eagle3.prepare.opening import derive_opening
from eagle3.prepare.selfwritten import SelfWriter, SelfWrittenSpec
from eagle3.prepare.server_generator import ServerGenerator
from eagle3.testing.fake_sglang import FakeSGLang
from eagle3.tiny.target import TinyTargetConfig, build_tokenizer

BUDGET = 512  # 01b's --max-new-tokens and 01's reply_max_new_tokens in the H100 run
FULL_CONCURRENCY = 1024  # 01b's --concurrency and 01's --gen-batch-size there
# 01b: dataset -> (jobs, share of replies cut at the budget)
GENERATE = {"qwen_code": (4800, 0.16), "qwen_code_complete": (1600, 0.035),
            "qwen_chat": (2400, 0.10), "human_train": (121, 0.05)}
# 01: dataset -> (count, heldout, turns, max_user_tokens, share of user turns too long)
SELF_WRITTEN = {"qwen_code": (4800, 160, [[1, 0.85], [2, 0.15]], 320, 0.20),
                "qwen_code_complete": (1600, 40, [[1, 1.0]], 384, 0.30),
                "qwen_chat": (2400, 80, [[1, 0.8], [2, 0.2]], 256, 0.12)}
WORDS = ("please write a function that sorts list of numbers and explain why the loop ends "
         "when index reaches end compare two ways to parse files in python with tests give an "
         "example for each case").split()


# ---------------------------------------------------------------- the simulated server


class DecodeEngine:
    """Continuous batching in time: a step advances every request in flight by one token and
    lasts `step_s + per_seq_s x in flight`."""

    def __init__(self, step_s: float, per_seq_s: float):
        self.step_s, self.per_seq_s = step_s, per_seq_s
        self.active: list[list] = []  # [tokens left, future]
        self._steps: asyncio.Task | None = None

    async def decode(self, n: int) -> None:
        future = asyncio.get_running_loop().create_future()
        self.active.append([n, future])
        if self._steps is None or self._steps.done():
            self._steps = asyncio.create_task(self._run())
        await future

    async def _run(self) -> None:
        while self.active:
            await asyncio.sleep(self.step_s + self.per_seq_s * len(self.active))
            for item in self.active:
                item[0] -= 1
                if item[0] <= 0:
                    item[1].set_result(None)
            self.active = [item for item in self.active if item[0] > 0]


def reply_length(rng: random.Random, budget: int, cut_share: float) -> int:
    """Exponential, cut at `budget` with probability `cut_share`."""
    mean = budget / math.log(1 / cut_share)
    return min(budget, 1 + int(rng.expovariate(1 / mean)))


def make_answer(word_ids: list[list[int]], eos: int):
    """The server's `/generate` answer to a request body: 01b's by its record id's dataset,
    01's (rid `sw-...`) by whether it samples (a user turn) and its budget."""
    too_long = {budget: share for _, _, _, budget, share in SELF_WRITTEN.values()}

    def answer(body: dict) -> tuple[list[int], str]:
        rid, params = body["rid"], body["sampling_params"]
        budget = params["max_new_tokens"]
        rng = random.Random(f"{rid}/{zlib.crc32(json.dumps(body['input_ids']).encode())}")
        if not rid.startswith("sw-"):
            n = reply_length(rng, budget, GENERATE[rid.split("/")[0]][1])
            ids = [rng.randrange(10, 500) for _ in range(n)]
        elif params.get("temperature", 0.0) > 0:  # a user turn
            n = budget if rng.random() < too_long[budget] else rng.randint(20, 120)
            ids = []
        else:  # a reply
            n = reply_length(rng, budget, GENERATE["qwen_code"][1])
            ids = []
        while len(ids) < n:
            ids += word_ids[rng.randrange(len(word_ids))]
        return (ids[:budget], "length") if n >= budget else (ids[:n - 1] + [eos], "stop")

    return answer


def serve(port: int, tokenizer_dir: str, step_s: float, per_seq_s: float) -> None:
    """The simulated server (a process of its own) until terminated."""
    from aiohttp import web

    tok = load_tokenizer(Path(tokenizer_dir))
    eos = ChatRenderer(tok, {"thinking": True}).end_of_turn_id
    word_ids = [tok.encode(" " + w, add_special_tokens=False) for w in WORDS]
    engine = DecodeEngine(step_s, per_seq_s)
    server = FakeSGLang(eos_id=eos, answer=make_answer(word_ids, eos), pace=engine.decode)
    server.requests = _Discard()
    web.run_app(server.app(), host="127.0.0.1", port=port, access_log=None, print=None)


class _Discard(list):
    def append(self, item) -> None:  # noqa: D102 - a long run keeps no per-request log
        pass


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, *a, **k) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- the two stages' clients


def bench_01b(url: str, eos: int, scale: float, concurrency: int, out: Path) -> dict:
    """Seconds, output tokens and the records (sorted) of 01b's runner, both ways."""
    results = {}
    for way in ("one after another", "one pool"):
        rng = random.Random(0)
        routes = [Route(name, [GenerationJob(f"{name}/{i:05d}", name,
                                             [rng.randrange(10, 500) for _ in range(64)], BUDGET)
                               for i in range(max(1, round(n * scale)))],
                        RecordSink(out / way / name))
                  for name, (n, _) in GENERATE.items()]
        backend = SGLangBackend(ServerPool([url]), eos, RetryPolicy(0.5, 600.0))
        cfg = RunnerConfig(concurrency, concurrency, 10 ** 9, 6, 600.0, 1.0, 30.0)
        t0 = time.perf_counter()
        for part in ([[r] for r in routes] if way == "one after another" else [routes]):
            run_pooled(part, backend, cfg, backend.policy, _NoBar())
        seconds = time.perf_counter() - t0
        for r in routes:
            r.sink.close()
        records = sorted(line for r in routes
                         for line in (out / way / r.name / "tokenized.jsonl").read_text()
                         .splitlines())
        results[way] = {"seconds": seconds, "records": records,
                        "tokens": sum(r.sink.counts["output_tokens"] for r in routes)}
    return results


def bench_01(url: str, renderer: ChatRenderer, scale: float, batch: int, out: Path) -> dict:
    """Seconds, generated tokens and the conversations of 01's self-written writers, both
    ways."""
    stops = list(dict.fromkeys([*derive_opening(renderer, None).stop_ids,
                                renderer.end_of_turn_id]))
    results = {}
    for way in ("one after another", "together"):
        gen = ServerGenerator([url], stops, batch)
        writers = [SelfWriter(name, SelfWrittenSpec(heldout=max(1, round(held * scale)),
                                                    max_user_tokens=user_budget,
                                                    reply_max_new_tokens=BUDGET, turns=turns),
                              renderer, out / way / name, count=max(1, round(n * scale)),
                              seed=k, max_seq_len=8192, batch_size=batch,
                              load_generator=lambda g=gen: g)
                   for k, (name, (n, held, turns, user_budget, _)) in
                   enumerate(SELF_WRITTEN.items())]
        t0 = time.perf_counter()
        if way == "one after another":  # no event loop: a batch, then the next, as 01 did
            for w in writers:
                w.run()
        else:
            asyncio.run(_together(writers, gen))
        results[way] = {"seconds": time.perf_counter() - t0,
                        "records": [(w.state.conversations, w.state.heldout) for w in writers],
                        "tokens": sum(w.state.generated_tokens for w in writers)}
    return results


async def _together(writers: list[SelfWriter], gen: ServerGenerator) -> None:
    try:
        await gather_or_cancel(w.run_async() for w in writers)
    finally:
        await gen.aclose()


# ---------------------------------------------------------------- main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(port: int, proc: multiprocessing.Process) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.is_alive():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the simulated server did not start")


def _print(stage: str, results: dict) -> None:
    (slow, a), (fast, b) = results.items()
    if a["records"] != b["records"]:
        raise AssertionError(f"{stage}: the two ways wrote different records")
    for way, r in results.items():
        print(f"  {stage} {way:<18} {r['seconds']:>7.1f} s {r['tokens'] / r['seconds']:>9,.0f} "
              "tok/s")
    print(f"  {stage} {slow} / {fast}: {a['seconds'] / b['seconds']:.2f}x the time "
          "(the same records written)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["01b", "01", "both"], default="both")
    p.add_argument("--scale", type=float, default=0.25,
                   help="share of the H100 run's workload, server and concurrency (0, 1]")
    p.add_argument("--time-scale", type=float, default=0.5, help="every simulated time x this")
    p.add_argument("--step-ms", type=float, default=2.1, help="a decode step alone, ms")
    p.add_argument("--per-seq-us", type=float, default=13.6,
                   help="a step's cost per request in flight at full scale, microseconds")
    args = p.parse_args(argv)
    concurrency = max(1, round(FULL_CONCURRENCY * args.scale))
    step_s = args.step_ms / 1e3 * args.time_scale
    per_seq_s = args.per_seq_us / 1e6 / args.scale * args.time_scale
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        build_tokenizer(TinyTargetConfig()).save_pretrained(tok_dir)
        renderer = ChatRenderer(load_tokenizer(tok_dir), {"thinking": True})
        port = _free_port()
        proc = multiprocessing.get_context("spawn").Process(
            target=serve, args=(port, str(tok_dir), step_s, per_seq_s), daemon=True)
        proc.start()
        try:
            _wait_up(port, proc)
            url = f"http://127.0.0.1:{port}"
            print(f"simulated server: step {step_s * 1e3:.1f} ms + {per_seq_s * 1e6:.0f} us a "
                  f"request in flight ({concurrency / (step_s + per_seq_s * concurrency):,.0f} "
                  f"tok/s at {concurrency}); workload x{args.scale}, time x{args.time_scale}")
            if args.stage in ("01b", "both"):
                _print("01b", bench_01b(url, renderer.end_of_turn_id, args.scale, concurrency,
                                        Path(tmp) / "01b"))
            if args.stage in ("01", "both"):
                _print("01", bench_01(url, renderer, args.scale, concurrency, Path(tmp) / "01"))
        finally:
            proc.terminate()
            proc.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
