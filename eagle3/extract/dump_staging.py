"""The dump hook's staging: getting a forward pass's rows off the device into host memory that the
dump jobs reuse (the scheduler thread, inside the forward pass).

Pure torch, importing nothing from eagle3: the dump hook (`eagle3/extract/sglang_dump.py`)
runs inside SGLang and loads this file by path.

`HostRing`: one host buffer (pinned on a CUDA host) in which each job's rows get a slot, handed
out and given back in FIFO order, the order in which the writer thread writes the jobs. So a
pass allocates no host memory and a write frees none. Both cost the server otherwise:

- on a GPU, a pinned buffer per request costs a cudaHostAlloc whenever PyTorch's caching host
  allocator has no free block of its power-of-two size class: the first few GB of a server's
  dumps, and each new size class, inside the forward pass; and the cache grows to up to twice
  the queue bound, which it never gives back;
- on a CPU, a fresh buffer per request faults its pages in during the copy, and its free (an
  munmap: 3-30 ms for a 58 MB job on a 2-core VM, 2026-12-07) runs in the writer thread with
  the GIL held, time that the scheduler thread waits (benchmarks/bench_dump_gil.py).

Its capacity is the writer's bound on queued bytes plus an eighth (the room that wrapping
wastes). A job that does not fit the room left (larger than the ring, or behind the wrap) gets
buffers of its own as before, and counts as a miss. `allocate()` makes the buffer (the hook
calls it at model build on a CUDA host, so that the pinning is not paid in a pass).

`HostStaging` (CPU tensors) and `CudaStaging` (copies on the dump's own CUDA stream) copy a
request's rows into the slot's tensors (or, on a miss, into new ones); `staging_for` picks one.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

SLOT_ALIGN = 64  # bytes: each tensor of a slot starts at a multiple (any dtype, a cache line)


def ring_capacity(max_pending_bytes: int) -> int:
    """The ring's bytes for a writer bound: the bound plus an eighth, for the wrap."""
    return max_pending_bytes + max_pending_bytes // 8


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


class RingSlot:
    """One job's bytes in a `HostRing`; `give_back()` (idempotent) once the job is written."""

    def __init__(self, ring: HostRing, entry: list):
        self._ring, self._entry = ring, entry

    def give_back(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._ring._give_back(entry)


class HostRing:
    """A host buffer handed out in FIFO slots (see the module docstring). Thread-safe: slots are
    taken on the scheduler thread and given back on the writer thread."""

    def __init__(self, capacity: int, pin_memory: bool):
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: expected >= 1")
        self.capacity, self.pin_memory = capacity, pin_memory
        self.takes = 0  # slots handed out
        self.misses = 0  # jobs that found no room (staged in buffers of their own)
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._live: collections.deque = collections.deque()  # [start, end, returned], oldest 1st

    def allocate(self) -> torch.Tensor:
        """The buffer, made on first call (uint8 [capacity], pinned if asked)."""
        with self._lock:
            if self._buffer is None:
                # device="cpu": the hook calls this inside the model's __init__, which SGLang's
                # loader runs under `with torch.device("cuda")` (or "meta").
                self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device="cpu",
                                           pin_memory=self.pin_memory)
            return self._buffer

    def take(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]
             ) -> tuple[RingSlot, list[torch.Tensor]] | None:
        """A slot holding one tensor per (shape, dtype) of `specs`, uninitialised, each at a
        multiple of SLOT_ALIGN; None (a miss) when the ring has no room for them in one piece."""
        sizes = [_aligned(dtype.itemsize * math.prod(shape)) for shape, dtype in specs]
        buffer = self.allocate()
        with self._lock:
            start = self._place(sum(sizes))
            if start is None:
                self.misses += 1
                return None
            entry = [start, start + sum(sizes), False]
            self._live.append(entry)
            self.takes += 1
        views, offset = [], start
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            nbytes = dtype.itemsize * math.prod(shape)
            views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
            offset += size
        return RingSlot(self, entry), views

    def _place(self, nbytes: int) -> int | None:
        """Where a slot of `nbytes` goes: after the newest slot, else (wrapping) before the
        oldest; None if neither has room."""
        if nbytes > self.capacity:
            return None
        if not self._live:
            return 0
        oldest, newest = self._live[0], self._live[-1]
        if newest[0] >= oldest[0]:  # not wrapped: the live slots span [oldest, newest)
            if self.capacity - newest[1] >= nbytes:
                return newest[1]
            return 0 if oldest[0] >= nbytes else None
        return newest[1] if oldest[0] - newest[1] >= nbytes else None  # wrapped: one gap

    def _give_back(self, entry: list) -> None:
        with self._lock:
            entry[2] = True
            # FIFO: the oldest slots go back in order; a slot given back out of order (a job
            # whose staging failed) is freed once those before it are, or at once if newest.
            while self._live and self._live[0][2]:
                self._live.popleft()
            while self._live and self._live[-1][2]:
                self._live.pop()

    def in_use(self) -> int:
        """Bytes between the oldest live slot and the newest one's end (wasted wrap included)."""
        with self._lock:
            if not self._live:
                return 0
            oldest, newest = self._live[0], self._live[-1]
            if newest[0] >= oldest[0]:
                return newest[1] - oldest[0]
            return self.capacity - oldest[0] + newest[1]


# ---------------------------------------------------------------------------------------------
# Getting the rows off the device


class HostStaging:
    """Plain copies of CPU tensors (the tests, SGLang's CPU device): done when they return."""

    on_device = False

    def rows(self, src: torch.Tensor, start: int, num_rows: int, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `start:start+num_rows` of `src` as `dtype`, copied into `out` (a ring slot's
        tensor) or new memory: the host rows must own their memory (the model reuses its
        buffers)."""
        part = src[start:start + num_rows]
        if out is None:
            return part.to("cpu", dtype, copy=True)
        return out.copy_(part)

    def compute(self, fn: Callable[[], Any], *inputs) -> Any:
        return fn()

    def done(self) -> None:
        return None


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


class CudaStaging:
    """Copies of one pass's rows into pinned host memory on the dump's own CUDA stream.

    Made once per forward pass: the copy stream first waits for an event recorded on the current
    stream (the work that computes the states). Every source is marked used by the copy stream
    (`record_stream`), so the caching allocator does not hand its memory out again before the
    copies queued so far are done; `done()` is the event a job's writer waits on (a blocking
    event: the writer thread sleeps rather than spins). A ring slot is written again only after
    the writer gave it back, that is after it waited for that event and wrote the file, so a
    copy never lands in memory still being read."""

    on_device = True

    def __init__(self, device: torch.device):
        self.stream = _copy_stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        self.stream.wait_event(ready)

    def rows(self, src: torch.Tensor, start: int, num_rows: int, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `start:start+num_rows` of `src` as `dtype` into `out` (a pinned ring slot's
        tensor) or a new pinned tensor, asynchronously: read them after `done()` fired."""
        with torch.cuda.stream(self.stream):
            if src.is_cuda:
                src.record_stream(self.stream)
            part = src[start:start + num_rows]
            if part.dtype != dtype:
                part = part.to(dtype)  # on the copy stream, in its memory
            if out is None:
                out = torch.empty(part.shape, dtype=dtype, device="cpu", pin_memory=True)
            out.copy_(part, non_blocking=True)
        return out

    def compute(self, fn: Callable[[], Any], *inputs) -> Any:
        """`fn()` run on the copy stream, reading `inputs` (quantizing the pass's aux rows)."""
        with torch.cuda.stream(self.stream):
            for t in inputs:
                t.record_stream(self.stream)
            return fn()

    def done(self):
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event


def staging_for(device: torch.device) -> HostStaging | CudaStaging:
    """How rows of tensors on `device` get to the host."""
    return CudaStaging(device) if device.type == "cuda" else HostStaging()
