#!/usr/bin/env python3
"""What the dump writer thread costs the thread beside it (CPU): SGLang's scheduler runs in the
process that holds the dump hook's writer thread (`eagle3/extract/dump_writer.py`), so whatever
the writer does under the GIL the scheduler cannot do.

A main loop stands in for the scheduler: steps of pure-Python work (sorting and indexing a few
dozen request records, building dicts) plus a few small torch ops, with `--wait-us` of GIL-free
sleep a step (the scheduler waiting on the GPU; 0 = never). It is timed, step by step, in
these conditions, each `--seconds` long, interleaved `--repeats` times:

  idle     the hook's writer (`sglang_dump.writer_for`) started, nothing queued
  thread   the same writer draining dumps: whenever fewer than a pass's requests are queued the
           main loop hands it the next pass through the real hook (`sglang_dump.dump_forward_pass`,
           `HostStaging`: the rows copied on the main thread, as the CPU device does; that time
           is left out of the step figures), so the writer never waits and the main thread
           never waits for room
  process  the same passes written by another process (the hook with its inline writer): the
           same bytes, the same CPU and memory traffic, no GIL shared with the main loop
  thread@S the thread condition under `sys.setswitchinterval(S ms)` (`--switch-ms`): a stall
           that scales with the interval is a GIL convoy (the writer running Python while the
           main thread waits for the interval to end)

A pass is `--tokens-per-pass` tokens over `--requests` requests at Kimi-K2.5's width (hidden
7168, 3 aux captures side by side and the final state, int64 ids: 57,352 B/token in bf16),
written as dump files of each `--layouts` (bf16; fp8, quantized by the writer thread) into each
`--dirs` (default: a temp dir under /tmp, and /dev/shm if present). Rids cycle over
`--files` names, so the files are overwritten and the disk use stays bounded.

Printed and written to `--json` (default bench_dump_gil.json): per layout and dir, per condition,
main-loop steps/s (median of the repeats, over the time in steps only) and its ratio to idle;
the same with the main thread's run-queue wait taken out ("free-core": what a host with a core
to spare for it would see; Linux's /proc/<tid>/schedstat splits the thread's time into running,
runnable-but-waiting, and blocked); the GIL wait: the time blocked beyond the steps' own sleeps,
as a share and in µs a step (with `--wait-us` the sleeps overshoot, so read it against idle:
`gil_wait_us_per_step_over_idle`); the step latency p50/p99/max, the share of step time in steps
over `--stall-ms` ("stalled"), the writer's bytes/s, the time the main thread spent handing it
passes (`feed_s`, left out of the rest) and the staging ring's misses; plus the machine.

    python benchmarks/bench_dump_gil.py                       # ~3 minutes on 2 cores
    python benchmarks/bench_dump_gil.py --tokens-per-pass 64 --hidden 256 --seconds 0.3 \\
        --repeats 1 --layouts bf16 --dirs tmp --json /tmp/gil.json   # smoke, seconds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eagle3.extract import dump_writer, sglang_dump  # noqa: E402
from eagle3.extract.sglang_dump import DumpConfig  # noqa: E402

CAPTURE = [2, 30, 58]  # the three aux captures of a 61-layer target


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--tokens-per-pass", type=int, default=4096, help="tokens a pass (4096)")
    p.add_argument("--requests", type=int, default=4, help="requests a pass (4)")
    p.add_argument("--layouts", nargs="+", default=["bf16", "fp8"], choices=sglang_dump.LAYOUTS)
    p.add_argument("--dirs", nargs="+", default=None,
                   help="where to write: 'tmp', 'shm' or a path (default: tmp, and shm if any)")
    p.add_argument("--seconds", type=float, default=3.0, help="per condition and repeat (3)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (3)")
    p.add_argument("--switch-ms", type=float, nargs="*", default=[0.5],
                   help="extra thread runs under these switch intervals, ms (0.5; none: -)")
    p.add_argument("--wait-us", type=int, default=0,
                   help="GIL-free sleep per step, µs, the GPU wait (0 = none)")
    p.add_argument("--stall-ms", type=float, default=2.0,
                   help="a step longer than this is a stall (2 ms)")
    p.add_argument("--files", type=int, default=8, help="rids cycled over (8)")
    p.add_argument("--max-pending-mb", type=int, default=1024, help="the writer's bound (1024)")
    p.add_argument("--json", type=Path, default=Path("bench_dump_gil.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The main loop


def make_requests(n: int = 48) -> list[dict]:
    return [{"rid": f"r{i}", "prio": (7 * i) % 5, "left": 1 + (13 * i) % 97, "out": []}
            for i in range(n)]


def scheduler_step(reqs: list[dict], x: torch.Tensor, wait_s: float) -> int:
    """One step of scheduler-like work: Python over the requests, then a few small torch ops
    (each releases the GIL inside), then the GPU wait; returns a checksum."""
    batch = sorted((r for r in reqs if r["left"] > 0), key=lambda r: (r["prio"], r["rid"]))
    index = {r["rid"]: i for i, r in enumerate(batch)}
    lens = [r["left"] for r in batch]
    for r in batch:
        r["left"] -= 1
        r["out"].append(index[r["rid"]])
        if len(r["out"]) > 32:
            del r["out"][:16]
        if r["left"] <= 0:
            r["left"] = 1 + (len(r["out"]) * 13) % 97
    ids = torch.tensor(lens)
    x.add_(1).mul_(0.5)
    y = x[ids % x.shape[0]]
    total = int(y.sum().item()) + sum(lens)
    if wait_s:
        time.sleep(wait_s)
    return total


def thread_clock(native_id: int | None = None) -> tuple[float, float, float]:
    """(wall, seconds on a CPU, seconds runnable but waiting for a CPU) of a thread, from
    Linux's /proc/<tid>/schedstat (this thread when `native_id` is None); without it, the
    thread's CPU time and 0 for the wait (the GIL figure then includes the machine's load)."""
    path = ("/proc/thread-self/schedstat" if native_id is None
            else f"/proc/self/task/{native_id}/schedstat")
    wall = time.perf_counter()
    try:
        with open(path) as f:
            cpu_ns, wait_ns, _ = f.read().split()
        return wall, int(cpu_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return wall, time.thread_time(), 0.0


def run_main_loop(seconds: float, wait_s: float, feeder=None) -> dict:
    """Steps for `seconds` (wall). Between steps, `feeder.wanted()` (an attribute read) and, when
    true, `feeder.feed()`: its time is taken out of the figures. The main thread's time in the
    steps splits into CPU, run-queue wait (the machine's other load), the steps' own sleeps,
    and the rest: time blocked, which without I/O in the steps is waiting for the GIL."""
    reqs, x = make_requests(), torch.zeros(256)
    steps: list[float] = []
    out = [0.0, 0.0, 0.0]  # wall, cpu, run-queue wait spent feeding: left out
    start = thread_clock()
    end = start[0] + seconds
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        scheduler_step(reqs, x, wait_s)
        steps.append(time.perf_counter() - t0)
        if feeder is not None and feeder.wanted():
            a = thread_clock()
            feeder.feed()
            b = thread_clock()
            out = [o + (y - z) for o, y, z in zip(out, b, a)]
    stop = thread_clock()
    wall, cpu, runq = (y - z - o for y, z, o in zip(stop, start, out))
    return {"step_s": steps, "wall_s": wall, "cpu_s": cpu, "runq_s": runq,
            "sleep_s": len(steps) * wait_s, "feed_s": out[0]}


def summarize(run: dict, stall_s: float) -> dict:
    steps = sorted(run["step_s"])
    n, wall = len(steps), run["wall_s"]
    gil = max(0.0, wall - run["cpu_s"] - run["runq_s"] - run["sleep_s"])
    return {"steps": n, "steps_per_s": n / wall,
            # the rate with a CPU always free for this thread (a many-core host): the run-queue
            # wait that the machine's other load caused taken out
            "steps_per_s_free_core": n / max(wall - run["runq_s"], 1e-9),
            "steps_per_cpu_s": n / max(run["cpu_s"], 1e-9),
            "gil_wait_share": gil / wall, "runq_share": run["runq_s"] / wall,
            "gil_wait_us_per_step": 1e6 * gil / n,
            "p50_us": 1e6 * steps[n // 2], "p99_us": 1e6 * steps[min(n - 1, int(n * 0.99))],
            "max_ms": 1e3 * steps[-1],
            "stalled_share": sum(s for s in steps if s > stall_s) / sum(steps),
            "feed_s": run["feed_s"]}


# ---------------------------------------------------------------------------------------------
# The dumps


def make_pass(hidden: int, tokens: int, requests: int, seed: int = 0):
    """A fake EXTEND ForwardBatch of `requests` equal requests and its states (random bf16)."""
    gen = torch.Generator().manual_seed(seed)
    n = tokens // requests
    final = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    aux = torch.randn(tokens, len(CAPTURE) * hidden, generator=gen).to(torch.bfloat16)
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(name="EXTEND"),
        input_ids=torch.randint(0, 163840, (tokens,), generator=gen),
        rids=[f"eagle3-{j}" for j in range(requests)], extend_start_loc=None,
        extend_seq_lens_cpu=[n] * requests, extend_prefix_lens_cpu=[0] * requests)
    return batch, final, aux


class PassFeeder:
    """Hands `writer` the next pass whenever fewer than a pass's requests are pending."""

    def __init__(self, config: DumpConfig, writer, args, files: int):
        self.config, self.writer, self.files = config, writer, files
        self.batch, self.final, self.aux = make_pass(args.hidden, args.tokens_per_pass,
                                                     args.requests)
        self.requests, self.count = args.requests, 0

    def wanted(self) -> bool:
        """Whether the writer is short of work (a plain read of its counter: no lock)."""
        return self.writer.stats.queue_jobs < self.requests

    def feed(self) -> None:
        base = self.count * self.requests
        self.batch.rids = [f"eagle3-f{(base + j) % self.files}" for j in range(self.requests)]
        self.count += 1
        sglang_dump.dump_forward_pass(self.config, self.batch, self.final, self.aux, CAPTURE,
                                      self.writer)


def _drain_in_process(config: DumpConfig, args: argparse.Namespace, files: int, stop, result):
    """The process condition: the hook's inline writer, pass after pass, until `stop`."""
    feeder = PassFeeder(config, None, args, files)
    feeder.writer = dump_writer.InlineWriter(lambda job: written.append(
        sglang_dump.write_job(config, job)))
    written: list[int] = []
    result.put("ready")
    t0 = time.perf_counter()
    while not stop.is_set():
        feeder.feed()
    result.put({"file_bytes": sum(written), "seconds": time.perf_counter() - t0})


# ---------------------------------------------------------------------------------------------
# Conditions


def measure(condition: str, config: DumpConfig, args, wait_s: float) -> dict:
    files = args.files
    if condition == "process":
        ctx = multiprocessing.get_context("spawn")
        stop, result = ctx.Event(), ctx.Queue()
        child = ctx.Process(target=_drain_in_process, args=(config, args, files, stop, result))
        child.start()
        assert result.get(timeout=120) == "ready"
        time.sleep(0.2)  # the child is writing
        run = run_main_loop(args.seconds, wait_s)
        stop.set()
        done = result.get(timeout=300)
        child.join(timeout=60)
        out = summarize(run, args.stall_ms / 1e3)
        out["writer_bytes_per_s"] = done["file_bytes"] / done["seconds"]
        return out
    writer = sglang_dump.writer_for(config)  # the hook's own writer (and staging ring)
    try:
        feeder = PassFeeder(config, writer, args, files)
        interval = sys.getswitchinterval()
        if condition.startswith("thread@"):
            sys.setswitchinterval(float(condition.split("@")[1]) / 1e3)
        try:
            if condition == "idle":
                run = run_main_loop(args.seconds, wait_s)
            else:
                feeder.feed()
                before = writer.snapshot()
                t0 = time.perf_counter()
                run = run_main_loop(args.seconds, wait_s, feeder)
                dt = time.perf_counter() - t0
        finally:
            sys.setswitchinterval(interval)
        out = summarize(run, args.stall_ms / 1e3)
        if condition != "idle":
            after = writer.snapshot()
            out["writer_bytes_per_s"] = (after["file_bytes"] - before["file_bytes"]) / dt
            out["blocked_s"] = after["blocked_s"] - before["blocked_s"]
            out["ring_misses"] = after.get("ring_misses", 0) - before.get("ring_misses", 0)
        return out
    finally:
        sglang_dump.close_writer(config)


def resolve_dirs(names: list[str] | None, scratch: Path) -> dict[str, Path]:
    if names is None:
        names = ["tmp"] + (["shm"] if Path("/dev/shm").is_dir() else [])
    dirs = {}
    for name in names:
        base = {"tmp": Path(tempfile.gettempdir()), "shm": Path("/dev/shm")}.get(name, Path(name))
        dirs[name] = Path(tempfile.mkdtemp(prefix="bench_dump_gil_", dir=base))
    return dirs


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> int:
    args = parse_args(argv)
    conditions = ["idle", "thread", "process"] + [f"thread@{ms:g}" for ms in args.switch_ms]
    wait_s = args.wait_us / 1e6
    dirs = resolve_dirs(args.dirs, Path(tempfile.gettempdir()))
    row_bytes = {"bf16": 8 + 2 * args.hidden * (1 + len(CAPTURE)),
                 "fp8": 8 + 2 * args.hidden + len(CAPTURE) * (args.hidden + 4)}
    results: dict = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "switch_interval_ms": 1e3 * sys.getswitchinterval()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "row_bytes": row_bytes, "cells": {}}
    print(f"{cpu_name()}, {os.cpu_count()} cores; {args.tokens_per_pass} tokens x hidden "
          f"{args.hidden} a pass, {args.requests} requests; conditions {conditions}")
    try:
        for layout in args.layouts:
            for dname, path in dirs.items():
                config = DumpConfig(path, 0, layout=layout,
                                    max_pending_bytes=args.max_pending_mb << 20)
                runs: dict[str, list] = {c: [] for c in conditions}
                for _ in range(args.repeats):
                    for c in conditions:
                        runs[c].append(measure(c, config, args, wait_s))
                cell = {c: median_of(r) for c, r in runs.items()}
                idle = cell["idle"]
                for m in cell.values():
                    m["ratio_to_idle"] = m["steps_per_s"] / idle["steps_per_s"]
                    m["free_core_ratio_to_idle"] = (m["steps_per_s_free_core"]
                                                    / idle["steps_per_s_free_core"])
                    m["gil_wait_us_per_step_over_idle"] = (m["gil_wait_us_per_step"]
                                                           - idle["gil_wait_us_per_step"])
                results["cells"][f"{layout}/{dname}"] = {"dir": str(path), **cell}
                print_cell(f"{layout} -> {dname} ({path})", cell)
                args.json.write_text(json.dumps(results, indent=1))
    finally:
        for path in dirs.values():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
    args.json.write_text(json.dumps(results, indent=1))
    print(f"written: {args.json}")
    return 0


def print_cell(title: str, cell: dict) -> None:
    print(f"\n{title}")
    print(f"  {'condition':<11} {'steps/s':>8} {'of idle':>7} {'free-core':>9} {'of idle':>7} "
          f"{'GIL wait':>8} {'µs/step':>7} {'run-queue':>9} {'p99 µs':>7} {'writer MB/s':>11}")
    for c, m in cell.items():
        mb = m.get("writer_bytes_per_s")
        print(f"  {c:<11} {m['steps_per_s']:>8,.0f} {m['ratio_to_idle']:>7.1%} "
              f"{m['steps_per_s_free_core']:>9,.0f} {m['free_core_ratio_to_idle']:>7.1%} "
              f"{m['gil_wait_share']:>8.1%} {m['gil_wait_us_per_step']:>7.1f} "
              f"{m['runq_share']:>9.1%} {m['p99_us']:>7.0f} "
              f"{'-' if mb is None else f'{mb / 1e6:,.0f}':>11}")


if __name__ == "__main__":
    sys.exit(main())
