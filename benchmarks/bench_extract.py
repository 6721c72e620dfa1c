#!/usr/bin/env python3
"""CPU-side cost of stage 02b's SGLang path, beside the raw disk write speed of the same disk.

Three measurements on the same directory, with realistic widths (H = 7168, Kimi-K2.5):

- raw disk: the same bytes as the bf16 output, one file per sample, write + fsync (the floor);
- dump write: `eagle3.extract.sglang_dump.dump_forward_pass` on prefill passes of several requests,
  written in the caller's thread (bf16 states already on the CPU: the GPU->CPU copy is not
  measured), i.e. the work of the server's dump writer thread;
- client: `eagle3.extract.dumps.convert_dump` (load, check, split, pack bf16 or fp8, save with
  fsync, delete the dump) per sample, alone and with a pool of threads as the client runs it.

Each line gives tokens/s (wall), tokens per CPU-second (all threads: what the work costs,
less sensitive to a busy machine), GB/s of what it writes, bytes per token, and the ratio to
the raw disk's tokens/s at that output's bytes per token (1.0 = as fast as the disk allows).

    python benchmarks/bench_extract.py                          # H 7168, 8 x 2048 tokens
    python benchmarks/bench_extract.py --dir /data/bench --samples 16 --workers 8
    python benchmarks/bench_extract.py --toy                    # seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from eagle3.core import hidden_states as hs
from eagle3.extract import sglang_dump
from eagle3.extract.dumps import Expected, convert_dump, make_rid

ROOT = Path(__file__).resolve().parent.parent

LAYERS = [2, 30, 58]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (default 7168)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--samples", type=int, default=8, help="samples per measurement (default 8)")
    p.add_argument("--per-pass", type=int, default=4, help="requests per prefill pass (4)")
    p.add_argument("--workers", type=int, default=4, help="client conversion threads (4)")
    p.add_argument("--dir", type=Path, default=None,
                   help="directory on the disk to measure (default: a temp dir under ./runs)")
    p.add_argument("--dump-dir", type=Path, default=None,
                   help="where the dumps go (default: under --dir); /dev/shm keeps them in RAM")
    p.add_argument("--toy", action="store_true", help="H 256, 4 x 128 tokens: a smoke test")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.toy:
        args.hidden, args.seq_len, args.samples, args.per_pass = 256, 128, 4, 2
    return args


class Clock:
    """Wall and process CPU seconds (all threads) of the timed sections."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def raw_disk(root: Path, nbytes_per_file: int, files: int) -> Clock:
    """Time to write `files` files of `nbytes_per_file` incompressible bytes with fsync."""
    mb = os.urandom(1 << 20)  # incompressible, repeated: the disk sees as many bytes
    block = (mb * (nbytes_per_file // len(mb) + 1))[:nbytes_per_file]
    with Clock() as clock:
        for i in range(files):
            with open(root / f"raw_{i}.bin", "wb") as f:
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
    for i in range(files):
        (root / f"raw_{i}.bin").unlink()
    return clock


def write_dumps(dump_dir: Path, args, records: list[dict]) -> Clock:
    """Seconds for the server-side dump of every record, `per_pass` requests a pass."""
    config = sglang_dump.DumpConfig(dump_dir, 0)
    H, T = args.hidden, args.seq_len
    clock = Clock()
    for start in range(0, len(records), args.per_pass):
        group = records[start:start + args.per_pass]
        rows = T * len(group)
        final = torch.randn(rows + 3, H).to(torch.bfloat16)  # + CUDA-graph padding rows
        aux = torch.randn(rows + 3, 3 * H).to(torch.bfloat16)
        ids = torch.tensor([t for r in group for t in r["input_ids"]] + [0] * 3)  # the dump's
        batch = SimpleNamespace(  # identity: each record's ids, row for row with its states
            forward_mode=SimpleNamespace(name="EXTEND"), rids=[r["rid"] for r in group],
            input_ids=ids,
            extend_start_loc=torch.arange(len(group)) * T, extend_seq_lens_cpu=[T] * len(group),
            extend_prefix_lens_cpu=[0] * len(group))
        with clock:
            sglang_dump.dump_forward_pass(config, batch, final, aux, LAYERS)
    return clock


def convert_all(dump_dir: Path, out: Path, records, expected, dtype, workers: int) -> Clock:
    def one(rec):
        path = sglang_dump.dump_file_path(dump_dir, rec["rid"])
        dest = hs.file_path(out, rec["i"])
        return convert_dump(path, rec["rid"], rec, expected, dtype,
                            lambda data: hs.save_with_sha256(data, dest))

    with Clock() as clock:
        if workers <= 1:
            for rec in records:
                one(rec)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, records))
    return clock


def main(argv=None) -> int:
    args = parse_args(argv)
    base = args.dir or ROOT / "runs"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_extract_", dir=base))
    dump_root = Path(tempfile.mkdtemp(prefix="bench_dump_", dir=args.dump_dir or root))
    H, T, n = args.hidden, args.seq_len, args.samples
    tokens = T * n
    records = [{"id": f"bench/{i}", "source": "bench", "i": i,
                "rid": make_rid("eagle3-", f"bench/{i}", 0),
                "input_ids": list(range(T)), "loss_mask": [1] * T} for i in range(n)]
    expected = Expected(H, tuple(LAYERS), Path("<bench>"))
    results = []

    def row(name, clock, nbytes):
        results.append({"what": name, "tokens_per_s": tokens / clock.wall,
                        "tokens_per_cpu_s": tokens / max(clock.cpu, 1e-9),
                        "gb_per_s": nbytes / clock.wall / 1e9, "bytes_per_token": nbytes / tokens})

    try:
        bf16_file = hs.bytes_per_token(H, "bf16") * T + hs.FILE_OVERHEAD_BYTES
        row("raw disk write+fsync (bf16-sized files)", raw_disk(root, bf16_file, n), bf16_file * n)
        for dtype in ("bf16", "fp8"):
            for workers in sorted({1, args.workers}):
                dump_dir, out = dump_root / "dump", root / f"out_{dtype}_{workers}"
                dump_dir.mkdir(exist_ok=True)
                clock = write_dumps(dump_dir, args, records)
                dump_bytes = sum(sglang_dump.dump_file_path(dump_dir, r["rid"]).stat().st_size
                                 for r in records)
                if dtype == "bf16" and workers == 1:
                    row("dump write (server, no fsync)", clock, dump_bytes)
                clock = convert_all(dump_dir, out, records, expected, dtype, workers)
                out_bytes = sum(p.stat().st_size for p in out.rglob("data_*.pt"))
                row(f"client {dtype}, {workers} thread{'s' * (workers > 1)}", clock, out_bytes)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(dump_root, ignore_errors=True)
    raw_bpt = results[0]["bytes_per_token"]
    raw_tps = results[0]["tokens_per_s"]
    print(f"bench_extract: H {H}, {n} samples x {T} tokens, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}, files in {base}, dumps in "
          f"{args.dump_dir or base}")
    print(f"{'what':<42}{'tokens/s':>10}{'tok/CPU-s':>11}{'GB/s':>7}{'B/token':>9}"
          f"{'vs disk':>9}")
    for r in results:
        disk_tps = raw_tps * raw_bpt / r["bytes_per_token"]  # the disk's rate at these bytes
        r["vs_disk"] = r["tokens_per_s"] / disk_tps
        print(f"{r['what']:<42}{r['tokens_per_s']:>10,.0f}{r['tokens_per_cpu_s']:>11,.0f}"
              f"{r['gb_per_s']:>7.2f}{r['bytes_per_token']:>9,.0f}{r['vs_disk']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
