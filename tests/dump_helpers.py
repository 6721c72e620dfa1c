"""Fake SGLang forward passes for the dump hook's tests (no SGLang needed): a ForwardBatch of
several requests' chunks, with CUDA-graph padding rows of garbage, and the reference states each
request's dump must hold; and a process running the hook that exits or is killed mid-file."""

from __future__ import annotations

import enum
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
H = 8  # hidden size of the fake target
CAPTURE = [2, 30, 58]


class ForwardMode(enum.IntEnum):
    """Mirror of SGLang's enum (0.5.23 order), including its broad `is_extend`."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)


def reference(rid: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-request states: aux [T, 3H] and final [T, H], bf16."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)))
    aux = torch.randn(num_tokens, 3 * H, generator=gen).to(torch.bfloat16)
    final = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    return aux, final


def reference_ids(rid: str, num_tokens: int) -> torch.Tensor:
    """Deterministic per-request prompt: int64 [T]."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)) + 1)
    return torch.randint(0, 1000, (num_tokens,), generator=gen)


def forward_pass(chunks, mode=ForwardMode.EXTEND, pad_rows=0, packed=False, totals=None):
    """A fake ForwardBatch plus the model output for `chunks` = [(rid, prefix, num_rows)].

    The states come from `reference(rid, totals[rid])`; padded rows are garbage (1e4). With
    `packed=False` the aux states are a list of 3 [rows, H] tensors (SGLang <= 0.5.16).
    """
    totals = totals or {}
    aux_rows, final_rows, positions, ids = [], [], [], []
    for rid, prefix, num_rows in chunks:
        aux, final = reference(rid, totals.get(rid, prefix + num_rows))
        ids.append(reference_ids(rid, totals.get(rid, prefix + num_rows))[prefix:prefix + num_rows])
        aux_rows.append(aux[prefix:prefix + num_rows])
        final_rows.append(final[prefix:prefix + num_rows])
        positions.append(torch.arange(prefix, prefix + num_rows))
    aux_rows.append(torch.full((pad_rows, 3 * H), 1e4, dtype=torch.bfloat16))
    final_rows.append(torch.full((pad_rows, H), 1e4, dtype=torch.bfloat16))
    lens = [n for _, _, n in chunks]
    batch = SimpleNamespace(
        forward_mode=mode,
        input_ids=torch.cat(ids + [torch.zeros(pad_rows, dtype=torch.long)]),
        rids=[rid for rid, _, _ in chunks],
        extend_start_loc=torch.tensor([sum(lens[:j]) for j in range(len(lens))]),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[prefix for _, prefix, _ in chunks],
        seq_lens_cpu=torch.tensor([prefix + n for _, prefix, n in chunks]),
        positions=torch.cat(positions + [torch.zeros(pad_rows, dtype=torch.long)]),
    )
    aux_all, final_all = torch.cat(aux_rows), torch.cat(final_rows)
    aux_out = aux_all if packed else list(aux_all.split(H, dim=-1))
    return batch, final_all, aux_out


def prefill_schedule(totals: dict[str, int], chunk: int, budget: int) -> list[list[tuple]]:
    """The passes SGLang's chunked prefill makes of `totals` = {rid: prompt tokens}: FIFO, each
    pass up to `budget` rows, at most `chunk` rows of a request per pass (so long prompts span
    several passes, interleaved with others); each pass a list of (rid, prefix, rows)."""
    done = dict.fromkeys(totals, 0)
    passes = []
    while any(done[rid] < n for rid, n in totals.items()):
        left, chunks = budget, []
        for rid, n in totals.items():
            rows = min(chunk, n - done[rid], left)
            if rows <= 0:
                if left <= 0:
                    break
                continue
            chunks.append((rid, done[rid], rows))
            done[rid] += rows
            left -= rows
        passes.append(chunks)
    return passes


_WRITER_CHILD = """
import json, sys, time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [{root!r}, {tests!r}]
from dump_helpers import CAPTURE, forward_pass
from eagle3.extract import dump_file, sglang_dump

mode, dump_dir, prompts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
config = sglang_dump.DumpConfig(dump_dir, 0)
save, count = dump_file.write_safetensors, [0]


def save_file(tensors, path, metadata=None):
    count[0] += 1
    if mode == "exit":
        time.sleep(0.2)  # a slow disk: the queue is still full at exit
    elif count[0] == 3:  # killed mid-file: half a file in the temp, then the kill
        save(tensors, path, metadata=metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        sys.stdout.write("writing\\n")  # one write: the main thread prints too
        sys.stdout.flush()
        time.sleep(120)  # killed long before
    save(tensors, path, metadata=metadata)


dump_file.write_safetensors = save_file
dump_dir.mkdir(exist_ok=True)
model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=CAPTURE))
sglang_dump.server_config = lambda: config
for rid, n in prompts.items():
    sglang_dump.maybe_dump(model, *forward_pass([(rid, 0, n)]))
sys.stdout.write("queued\\n")
sys.stdout.flush()
"""


def start_writer_child(dump_dir: Path, mode: str, prompts: dict[str, int]) -> subprocess.Popen:
    """A process running the real dump hook on one pass per prompt of `prompts` ({rid: tokens},
    reference states), its disk slowed: `mode` "exit" ends the process normally with its queue
    full; "kill" hangs in the middle of the third file (after printing "writing"), to be
    killed. stdout is a pipe."""
    script = dump_dir.parent / "writer_child.py"
    script.write_text(_WRITER_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests")))
    return subprocess.Popen([sys.executable, str(script), mode, str(dump_dir),
                             json.dumps(prompts)], stdout=subprocess.PIPE, text=True, cwd=ROOT)


def kill_writer_mid_file(dump_dir: Path, prompts: dict[str, int]) -> int:
    """Run `start_writer_child(..., "kill")` and SIGKILL it mid-file; returns its pid."""
    child = start_writer_child(dump_dir, "kill", prompts)
    try:
        while "writing" not in child.stdout.readline():
            assert child.poll() is None, "the writer process ended before its third file"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    return child.pid
