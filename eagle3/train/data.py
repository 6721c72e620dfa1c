"""Training data: hidden-state files packed into fixed-width rows, loaded ahead by workers.

A micro-batch is one row of `width` tokens holding several samples back to back (`doc_ids`: the
sample's index in the row, -1 on padding; `positions` restart at 0 for each sample), so every
micro-batch has the same shape (one compile, no per-length kernels) and padding is only the
tail of each row. The draft's attention and loss never cross a sample boundary (see ttt.py).

Data order is a pure function of (seed, epoch): each epoch shuffles the samples, packs them
first-fit-decreasing within windows of `PACK_WINDOW` samples, then shuffles the rows. Step s of
a run with `world` ranks and `grad_accum` micro-steps consumes rows `[s*M, (s+1)*M)` of its
epoch (M = world * grad_accum); rank r's micro-step m takes row `s*M + m*world + r`. The same
global batch therefore gives the same rows per step on any number of ranks, and a resumed run
continues at the exact row.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.faults import InputFileError
from eagle3.core.stage import StageError
from eagle3.draft.attention import FLEX_BLOCK
from eagle3.train.files import FileIndex, SkipCountingLoader, read_sample

log = logging.getLogger(__name__)

PACK_WINDOW = 512  # samples packed together: larger packs tighter, smaller shuffles finer


class DataError(StageError, ValueError):
    """Training data that cannot be used as asked; the message names the file or flag (a
    StageError: the script ends it in one line, not a traceback)."""


def list_files(root: Path) -> list[Path]:
    """Hidden-state files of a split, ordered by their record index."""
    files = list(Path(root).glob("shard_*/data_*.pt"))
    return sorted(files, key=lambda p: int(p.stem.split("_")[1]))


def index_files(files: list[Path], bar=None) -> FileIndex:
    """Token count and layout of each file, unchecked (memory-mapped: only the header pages
    are read); the stage checks its files instead (eagle3/train/files.py check_split)."""
    index = FileIndex()
    for p in files:
        data = torch.load(p, mmap=True, weights_only=True)
        index.lengths.append(hs.num_tokens(data))
        index.topk.append(int(data["meta"].get("topk", 0)))
        index.vocab_sha256.append(data["meta"].get("vocab_sha256"))
        if bar is not None:
            bar.update(1)
    return index


def check_teacher_vocab(files: list[Path], index: FileIndex, vocab_sha256: str) -> None:
    """Refuse fp8-topk files whose stored teacher ids belong to another draft vocabulary."""
    for path, sha in zip(files, index.vocab_sha256):
        if sha is not None and sha != vocab_sha256:
            raise InputFileError(path, "wrong vocab: its top-k teacher was stored with "
                                 "another draft vocabulary than 03_vocab/vocab_mapping."
                                 "safetensors (re-run 02b --dtype fp8-topk after 03, or restore "
                                 "the mapping it was made with)")


def row_width(max_seq_len: int, pack_tokens: int, longest: int) -> int:
    """Tokens per packed row, rounded up to the flex block: `pack_tokens`, or (0) the longest
    sample after truncation to `max_seq_len` (no row wider than the data needs)."""
    width = pack_tokens or min(max_seq_len, longest)
    if width < min(max_seq_len, longest):
        raise DataError(f"--pack-tokens {pack_tokens} is below the longest sample "
                        f"({min(max_seq_len, longest)} tokens after --max-seq-len "
                        f"{max_seq_len}): raise --pack-tokens or lower --max-seq-len")
    return -(-width // FLEX_BLOCK) * FLEX_BLOCK


def pack_epoch(lengths: list[int], width: int, max_seq_len: int, seed: int, epoch: int,
               shuffle: bool = True) -> list[list[int]]:
    """Rows of one epoch: lists of sample indices whose (truncated) lengths fit in `width`."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_WINDOW):
        window = sorted(order[start:start + PACK_WINDOW],
                        key=lambda i: (-min(lengths[i], max_seq_len), i))
        open_rows: list[list[int]] = []
        free: list[int] = []
        for i in window:  # first fit, longest first
            n = min(lengths[i], max_seq_len)
            for j, room in enumerate(free):
                if n <= room:
                    open_rows[j].append(i)
                    free[j] -= n
                    break
            else:
                open_rows.append([i])
                free.append(width - n)
        rows.extend(open_rows)
    if shuffle:
        rng.shuffle(rows)
    return rows


@dataclass
class RunPlan:
    """The rows of every epoch and how steps, micro-steps and ranks consume them."""

    epochs: list[list[list[int]]]
    world: int
    grad_accum: int

    @property
    def rows_per_step(self) -> int:
        return self.world * self.grad_accum

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epochs[epoch]) // self.rows_per_step  # the remainder rows are dropped

    @property
    def num_steps(self) -> int:
        return sum(self.steps_in_epoch(e) for e in range(len(self.epochs)))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step inside the epoch) of a global step."""
        for epoch in range(len(self.epochs)):
            if step < self.steps_in_epoch(epoch):
                return epoch, step
            step -= self.steps_in_epoch(epoch)
        raise IndexError(f"step beyond the plan's {self.num_steps} steps")

    def rows_for(self, step: int, rank: int) -> list[list[int]]:
        """The rows rank `rank` trains on at `step`, one per micro-step."""
        epoch, j = self.locate(step)
        base = j * self.rows_per_step
        return [self.epochs[epoch][base + m * self.world + rank] for m in range(self.grad_accum)]

    def padding_share(self, lengths: list[int], width: int, max_seq_len: int) -> float:
        used = sum(min(lengths[i], max_seq_len) for rows in self.epochs for r in rows for i in r)
        total = sum(len(rows) for rows in self.epochs) * width
        return 1.0 - used / max(total, 1)


def build_plan(lengths: list[int], width: int, max_seq_len: int, seed: int, epochs: int,
               world: int, grad_accum: int) -> RunPlan:
    plan = RunPlan([pack_epoch(lengths, width, max_seq_len, seed, e) for e in range(epochs)],
                   world, grad_accum)
    if plan.num_steps < 1:
        raise DataError(f"{len(lengths)} samples pack into {len(plan.epochs[0])} rows of "
                        f"{width} tokens: not one step of {world} ranks x --grad-accum "
                        f"{grad_accum}; lower --grad-accum or --pack-tokens")
    return plan


def collate_packed(samples: list[dict], width: int, max_seq_len: int, topk: int = 0,
                   hidden_size: int = 0) -> dict:
    """One packed row `[1, width]` (aux `[1, width, 3Ht]`, final `[1, width, Ht]`, bf16).

    Files of every layout mix in a row. `topk` is the largest K of the run's fp8-topk files
    (0: none); when set, the row also has `teacher_ids` `[1, width, topk]` (int64 draft ids),
    `teacher_logprobs` (float32, -inf past a file's own K and where the file stores the final
    state), `has_final` (bool: the position's teacher comes from `final`) and `target_top`
    (the target's full-vocabulary argmax, -1 where the file does not store it). The final
    state of an fp8-topk position is zero. A row whose samples were all skipped is all
    padding, `hidden_size` wide (it trains nothing: no position has a loss weight).
    """
    Ht = samples[0]["hidden_states"][0].shape[-1] if samples else hidden_size
    shared = torch.utils.data.get_worker_info() is not None  # fill shared memory directly

    def buf(*shape, dtype=torch.bfloat16, fill=0):
        t = torch.full(shape, fill, dtype=dtype)
        return t.share_memory_() if shared else t

    out = {"input_ids": buf(1, width, dtype=torch.long),
           "loss_mask": buf(1, width, dtype=torch.long),
           "doc_ids": buf(1, width, dtype=torch.int32, fill=-1),
           "positions": buf(1, width, dtype=torch.long),
           "aux": buf(1, width, 3 * Ht), "final": buf(1, width, Ht)}
    if topk:
        out.update(teacher_ids=buf(1, width, topk, dtype=torch.long),
                   teacher_logprobs=buf(1, width, topk, dtype=torch.float32, fill=-math.inf),
                   has_final=buf(1, width, dtype=torch.bool, fill=False),
                   target_top=buf(1, width, dtype=torch.long, fill=-1))
    row = 0
    for j, data in enumerate(samples):
        aux, final = hs.unpack(data, torch.bfloat16)
        n = min(data["input_ids"].shape[0], max_seq_len)
        sl = slice(row, row + n)
        out["input_ids"][0, sl] = data["input_ids"][:n]
        out["loss_mask"][0, sl] = data["loss_mask"][:n]
        out["doc_ids"][0, sl] = j
        out["positions"][0, sl] = torch.arange(n)
        for i, a in enumerate(aux):
            out["aux"][0, sl, i * Ht:(i + 1) * Ht] = a[:n]
        if final is not None:
            out["final"][0, sl] = final[:n]
        _fill_teacher(out, data, sl, n, topk)
        row += n
    if row > width:
        raise DataError(f"{row} tokens packed into a row of {width}")
    out["tokens"] = torch.tensor(row)
    return out


def _fill_teacher(out: dict, data: dict, sl: slice, n: int, topk: int) -> None:
    """The teacher part of one sample's positions in a packed row (see collate_packed)."""
    teacher = hs.unpack_teacher(data)
    if teacher is None:
        if topk:
            out["has_final"][0, sl] = True
        return
    k = teacher["ids"].shape[1]
    if k > topk:
        raise DataError(f"record {data['meta'].get('id')!r} stores a top-{k} teacher, but the "
                        f"run was indexed for top-{topk} at most (the file changed since the "
                        "pre-flight: re-run)")
    out["teacher_ids"][0, sl, :k] = teacher["ids"][:n]
    out["teacher_logprobs"][0, sl, :k] = teacher["logprobs"][:n]
    out["target_top"][0, sl] = teacher["target_top"][:n]


class PackedRows(torch.utils.data.Dataset):
    """Item i = the collated row `rows[i]` (loaded by DataLoader workers ahead of use); `topk`:
    the largest K of the run's fp8-topk files (0 = none, see collate_packed)."""

    def __init__(self, files: list[Path], rows: list[list[int]], width: int, max_seq_len: int,
                 topk: int = 0):
        self.files, self.rows, self.width, self.max_seq_len = files, rows, width, max_seq_len
        self.topk = topk

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        samples, skipped = [], []
        for j in self.rows[i]:  # a bad file leaves its sample out of the row (files.py)
            data, skip = read_sample(self.files, j)
            if skip is None:
                samples.append(data)
            else:
                skipped.append(skip)
        out = collate_packed(samples, self.width, self.max_seq_len, self.topk,
                             getattr(self.files, "hidden_size", 0))
        if skipped:  # listed by SkipCountingLoader in the main process
            out["skipped"] = skipped
        return out


def make_loader(dataset, num_workers: int, pin_memory: bool, prefetch: int = 4):
    # Its own generator: a DataLoader draws its workers' base seed from the global torch RNG,
    # which would make the RNG state saved in a checkpoint depend on how often loaders were
    # built (a resumed run builds one more), not on the step alone.
    return SkipCountingLoader(torch.utils.data.DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=num_workers,
        prefetch_factor=prefetch if num_workers else None, pin_memory=pin_memory,
        persistent_workers=False, generator=torch.Generator().manual_seed(0)), dataset.files)


class DevicePrefetcher:
    """Batches on `device`; the next batch's host-to-device copy runs on a side CUDA stream
    while the current one computes. `wait_s` sums the host time spent blocked on the loader."""

    def __init__(self, loader, device: torch.device):
        self.it = iter(loader)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.wait_s = 0.0
        self._ready = None

    def prefetch(self) -> None:
        """Fetch the next batch and start its copy (call once the current step is enqueued)."""
        if self._ready is not None:
            return
        t0 = time.perf_counter()
        batch = next(self.it, None)
        self.wait_s += time.perf_counter() - t0
        if batch is None:  # the run's last row was taken
            return
        if self.stream is None:
            self._ready = {k: v.to(self.device) for k, v in batch.items()}
            return
        with torch.cuda.stream(self.stream):
            self._ready = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def next(self) -> dict:
        self.prefetch()
        batch, self._ready = self._ready, None
        if batch is None:
            raise StopIteration
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for v in batch.values():
                v.record_stream(current)
        return batch


def records_of_step(data, cfg, world: int, rank: int, step: int) -> list[tuple[str, str]]:
    """(record id, file) of the samples rank `rank` trained on at `step`: the plan rebuilt as
    the loop builds it (a pure function of the lengths, the flags and the world size)."""
    width = row_width(cfg.max_seq_len, cfg.pack_tokens,
                      max(data.train_lengths + data.eval_lengths))
    plan = build_plan(data.train_lengths, width, cfg.max_seq_len, cfg.seed, cfg.epochs, world,
                      cfg.grad_accum)
    files = data.train_files
    ids = getattr(files, "ids", None) or [str(p) for p in files]
    return [(ids[j], str(files[j])) for row in plan.rows_for(step, rank) for j in row]
