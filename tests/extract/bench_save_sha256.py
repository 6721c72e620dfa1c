"""What hashing a hidden-state file while it is written costs (02b's index `sha256`), per GB.

    python tests/extract/bench_save_sha256.py [--gb 1] [--dir /dev/shm] [--repeats 3]

Prints, per GB written: `torch.save` through the atomic writer without hashing, the same with
`hidden_states.save_with_sha256`, and sha256 alone over the bytes (the CPU the hash adds; the
writers run in 02b's conversion threads and hashlib releases the GIL, so it overlaps the I/O).
Best of `--repeats` each, to see through a busy machine.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.stage import atomic_writer


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="file size in GB")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="where to write")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = int(args.gb * 1e9) // 2
    data = {"hidden_states": [torch.randn(n // 4096, 4096).to(torch.bfloat16)]}
    plain_path, hashed_path = args.dir / "bench_plain.pt", args.dir / "bench_hashed.pt"

    def plain():
        with atomic_writer(plain_path) as f:
            torch.save(data, f)

    try:
        t_plain = best_of(args.repeats, plain)
        t_hashed = best_of(args.repeats, lambda: hs.save_with_sha256(data, hashed_path))
        raw = hashed_path.read_bytes()
        t_sha = best_of(args.repeats, lambda: hashlib.sha256(raw).hexdigest())
        gb = len(raw) / 1e9
        print(f"{gb:.2f} GB to {args.dir}: save {t_plain / gb:.2f} s/GB, save + sha256 "
              f"{t_hashed / gb:.2f} s/GB (+{(t_hashed - t_plain) / gb:.2f}), sha256 alone "
              f"{t_sha / gb:.2f} s/GB ({gb / t_sha:.2f} GB/s)")
    finally:
        plain_path.unlink(missing_ok=True)
        hashed_path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
