"""Tests of eagle3/extract/dump_staging.py's `HostRing`: slots are aligned views of one buffer,
handed out in FIFO order without ever overlapping a live slot, wrapping to the start; a job the
ring has no room for in one piece is a miss; a slot given back out of order (a job whose staging
failed) is freed once those before it are, at once if it is the newest. The ring through the
hook and the writer: tests/extract/test_dump_writer.py; on a GPU: test_dump_cuda.py."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from eagle3.extract.dump_staging import SLOT_ALIGN, HostRing, ring_capacity


def offset(ring: HostRing, t: torch.Tensor) -> int:
    return t.data_ptr() - ring.allocate().data_ptr()


def test_take_returns_aligned_views_of_the_ring_in_the_shapes_asked():
    ring = HostRing(4096, pin_memory=False)
    slot, (ids, aux, scale) = ring.take([((3,), torch.int64), ((3, 5), torch.bfloat16),
                                         ((3, 3), torch.float32)])  # each under SLOT_ALIGN
    assert (ids.dtype, tuple(ids.shape)) == (torch.int64, (3,))
    assert (aux.dtype, tuple(aux.shape)) == (torch.bfloat16, (3, 5))
    assert (scale.dtype, tuple(scale.shape)) == (torch.float32, (3, 3))
    assert [offset(ring, t) for t in (ids, aux, scale)] == [0, SLOT_ALIGN, 2 * SLOT_ALIGN]
    aux.fill_(1.5)  # views: the ring's own bytes
    assert ring.allocate()[SLOT_ALIGN:SLOT_ALIGN + 30].view(torch.bfloat16).eq(1.5).all()
    assert ring.in_use() == 3 * SLOT_ALIGN and ring.takes == 1
    slot.give_back()
    slot.give_back()  # idempotent
    assert ring.in_use() == 0


def test_take_misses_when_no_room_in_one_piece_and_wraps_to_the_start():
    ring = HostRing(4 * SLOT_ALIGN, pin_memory=False)
    a, _ = ring.take([((2 * SLOT_ALIGN,), torch.uint8)])
    b, (b_t,) = ring.take([((SLOT_ALIGN,), torch.uint8)])
    assert ring.take([((2 * SLOT_ALIGN,), torch.uint8)]) is None  # one slot's room left
    assert ring.take([((5 * SLOT_ALIGN,), torch.uint8)]) is None  # larger than the ring
    assert ring.misses == 2
    a.give_back()
    c, (c_t,) = ring.take([((2 * SLOT_ALIGN,), torch.uint8)])  # wraps: before the oldest
    assert (offset(ring, b_t), offset(ring, c_t)) == (2 * SLOT_ALIGN, 0)
    assert ring.in_use() == 4 * SLOT_ALIGN  # the unused end counts while wrapped
    assert ring.take([((SLOT_ALIGN,), torch.uint8)]) is None  # wrapped: no gap left
    b.give_back()
    c.give_back()
    assert ring.in_use() == 0


def test_a_slot_given_back_out_of_order_is_freed_when_those_before_it_are():
    ring = HostRing(8 * SLOT_ALIGN, pin_memory=False)
    a, b, c = (ring.take([((SLOT_ALIGN,), torch.uint8)])[0] for _ in range(3))
    b.give_back()  # the middle one: still held behind a
    assert ring.in_use() == 3 * SLOT_ALIGN
    c.give_back()  # the newest: b and c go at once
    assert ring.in_use() == SLOT_ALIGN
    a.give_back()
    assert ring.in_use() == 0


def test_ring_never_hands_out_live_bytes_when_jobs_of_any_size_come_and_go_in_order():
    rng = random.Random(0)
    ring = HostRing(64 * SLOT_ALIGN, pin_memory=False)
    live: collections.deque = collections.deque()  # (slot, tensor, mark), oldest first
    taken = 0
    for step in range(3000):
        if live and rng.random() < 0.5:
            slot, t, mark = live.popleft()
            assert t.eq(mark).all(), f"step {step}: a live slot was written over"
            slot.give_back()
            continue
        n = rng.choice([1, 7, SLOT_ALIGN, 3 * SLOT_ALIGN, 10 * SLOT_ALIGN, 30 * SLOT_ALIGN])
        got = ring.take([((n,), torch.uint8)])
        if got is None:
            assert live, "an empty ring refused a slot it has room for"
            continue
        mark = step % 251
        got[1][0].fill_(mark)
        live.append((got[0], got[1][0], mark))
        taken += n
    assert taken > 20 * ring.capacity and ring.takes > 1000  # it wrapped many times
    for slot, t, mark in live:
        assert t.eq(mark).all()
        slot.give_back()
    assert ring.in_use() == 0


def test_ring_is_host_memory_when_allocated_under_another_default_device():
    ring = HostRing(1024, pin_memory=False)
    with torch.device("meta"):  # SGLang builds the model (where the hook allocates) this way
        buffer = ring.allocate()
    assert buffer.device.type == "cpu" and ring.take([((8,), torch.int64)]) is not None


def test_ring_capacity_is_the_bound_plus_an_eighth_and_must_be_positive():
    assert ring_capacity(2048 << 20) == 2304 << 20
    with pytest.raises(ValueError, match="capacity 0"):
        HostRing(0, pin_memory=False)
