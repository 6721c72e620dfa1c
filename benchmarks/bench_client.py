#!/usr/bin/env python3
"""Overhead of stage 01b's client: requests/s and CPU against an instant local server.

The fake SGLang server (eagle3.testing.fake_sglang, answering at once) runs in its own
process(es); the client is the real 01b path (GenerationRun + SGLangBackend + RecordSink writing
tokenized and raw JSONL) at the real concurrency. The client's requests per CPU-second is what
one core of client can sustain; a real server answering far fewer requests per second than that
is never held back by the client. A bare aiohttp loop (same requests, no retries, no records) is
measured too, for the ratio.

    python benchmarks/bench_client.py                      # 10000 requests at concurrency 200
    python benchmarks/bench_client.py --requests 2000 --prompt-tokens 4096 --servers 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.core.server import RetryPolicy, ServerPool, make_session, post_once
from eagle3.generate.backends import SGLangBackend
from eagle3.generate.jobs import GenerationJob, RecordSink
from eagle3.generate.runner import GenerationRun, Route, RunnerConfig

ROOT = Path(__file__).resolve().parent.parent


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, *a, **k) -> None:
        pass


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n: int, cpus: set[int] | None) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "eagle3.testing.fake_sglang", "--port", str(port)], cwd=ROOT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    for url in urls:
        host, port = url.rsplit(":", 1)
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake server {url} did not start") from None
                time.sleep(0.1)
    return procs, urls


def make_jobs(n: int, prompt_tokens: int, seed: int = 0) -> list[GenerationJob]:
    rng = random.Random(seed)
    return [GenerationJob(f"bench/{i:07d}", "bench",
                          [rng.randrange(10, 150000) for _ in range(prompt_tokens)], 64)
            for i in range(n)]


async def run_stage_client(jobs, urls, concurrency, out_dir: Path) -> dict:
    backend = SGLangBackend(ServerPool(urls), 7, RetryPolicy(base_delay_s=0.5, timeout_s=60))
    route = Route("bench", jobs, RecordSink(out_dir))
    cfg = RunnerConfig(concurrency=concurrency, long_concurrency=concurrency,
                       long_context_threshold=10**9, max_attempts=6,
                       server_down_timeout_s=1800.0, poll_s=5.0, probe_timeout_s=30.0)
    async with make_session(concurrency + 8) as session:
        await GenerationRun(backend, [route], cfg, backend.policy, _NoBar()).run(session)
    route.sink.close()
    return route.result()


async def run_bare_client(jobs, urls, concurrency) -> dict:
    it = iter(jobs)

    async def worker(session, url):
        while (job := next(it, None)) is not None:
            await post_once(session, url + "/generate",
                            {"input_ids": job.prompt_ids.tolist(), "rid": job.id,
                             "sampling_params": {"max_new_tokens": 64}}, 60, job.id)

    async with make_session(concurrency + 8) as session:
        await asyncio.gather(*(worker(session, urls[k % len(urls)])
                               for k in range(concurrency)))
    return {"generated": len(jobs), "failed": 0}


def measure(name: str, coro_fn, server_pids: list[int]) -> dict:
    cpu0, srv0, t0 = _cpu_s(), sum(map(_proc_cpu_s, server_pids)), time.perf_counter()
    counts = asyncio.run(coro_fn())
    wall = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0
    srv = sum(map(_proc_cpu_s, server_pids)) - srv0
    n = counts["generated"]
    return {"name": name, "requests": n, "failed": counts["failed"], "wall_s": wall,
            "req_s": n / wall, "client_cpu_s": cpu, "client_cores": cpu / wall,
            "req_per_client_cpu_s": n / max(cpu, 1e-9), "server_cores": srv / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=1024, help="ids per prompt")
    p.add_argument("--servers", type=int, default=1, help="fake server processes (a pool)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the client to core 0 and the servers to the others")
    args = p.parse_args(argv)
    ncpu = os.cpu_count() or 1
    pin = not args.no_pin and ncpu >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    procs, urls = start_servers(args.servers, set(range(1, ncpu)) if pin else None)
    try:
        jobs = make_jobs(args.requests, args.prompt_tokens)
        pids = [pr.pid for pr in procs]
        with tempfile.TemporaryDirectory() as tmp:
            results = [
                measure("bare aiohttp loop", lambda: run_bare_client(jobs, urls,
                                                                     args.concurrency), pids),
                measure("01b client (records)", lambda: run_stage_client(
                    jobs, urls, args.concurrency, Path(tmp)), pids),
            ]
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait(timeout=10)
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, "
          f"{args.prompt_tokens} prompt ids, <=40 output ids, {args.servers} server process(es), "
          f"client pinned to one core: {pin}")
    print(f"{'':24}{'req/s':>10}{'client cores':>14}{'req/client-cpu-s':>18}"
          f"{'server cores':>14}{'failed':>8}")
    for r in results:
        print(f"{r['name']:24}{r['req_s']:>10,.0f}{r['client_cores']:>14.2f}"
              f"{r['req_per_client_cpu_s']:>18,.0f}{r['server_cores']:>14.2f}{r['failed']:>8}")
    bare, full = results
    print(f"01b client / bare loop, requests per client CPU-second: "
          f"{full['req_per_client_cpu_s'] / bare['req_per_client_cpu_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
