"""Tests of eagle3/extract/dump_writer.py through the dump hook (eagle3/extract/sglang_dump.py):
the writer thread writes the files a synchronous write writes, in order; a slow writer makes the
server wait (logged), never loses a dump nor holds more than the bound; the queue is written out
at exit; a writer killed mid-file leaves only a temp file, which no reader takes for a dump.
Fake forward passes: tests/dump_helpers.py."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from dump_helpers import (
    CAPTURE,
    forward_pass,
    kill_writer_mid_file,
    prefill_schedule,
    reference,
    reference_ids,
    start_writer_child,
)

from eagle3.extract import dump_staging, dump_writer, dumps, sglang_dump
from eagle3.extract.sglang_dump import DumpConfig

# 30 prompts, up to 5 chunks of 6 rows, 14 rows a pass: chunks of one rid in consecutive passes
TOTALS = {f"eagle3-r{i}": 1 + (7 * i) % 29 for i in range(30)}
PROMPTS = {f"eagle3-p{i}": 3 + i for i in range(5)}  # the server processes' requests


@pytest.fixture(autouse=True)
def _close_writers():
    yield
    sglang_dump.close_writers()


def run_passes(config: DumpConfig, writer, totals=TOTALS, chunk=6, budget=14) -> int:
    """Every pass of the prefill schedule of `totals` through the hook; returns the passes."""
    config.dump_dir.mkdir(parents=True, exist_ok=True)
    passes = prefill_schedule(totals, chunk, budget)
    for k, chunks in enumerate(passes):
        batch, final, aux = forward_pass(chunks, pad_rows=k % 3, packed=k % 2 == 1,
                                         totals=totals)
        sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE, writer)
    return len(passes)


def slow(write, seconds: float, seen: list | None = None, writer_box: list | None = None):
    """`write` delayed by `seconds` a job; records the writer's queue bytes at each job."""
    def write_slowly(job):
        if seen is not None:
            seen.append(writer_box[0].snapshot()["queue_bytes"])
        time.sleep(seconds)
        return write(job)
    return write_slowly


def assert_dumps_equal_reference(dump_dir: Path, totals=TOTALS) -> None:
    for rid, n in totals.items():
        data = sglang_dump.load_dump(sglang_dump.dump_file_path(dump_dir, rid))
        aux, final = reference(rid, n)
        assert (data["rid"], data["num_tokens"], data["layout"]) == (rid, n, "bf16")
        assert torch.equal(data["input_ids"], reference_ids(rid, n))
        assert torch.equal(data["aux_hidden_states"], aux)
        assert torch.equal(data["final_hidden_states"], final)


def test_writer_thread_writes_the_synchronous_files_when_requests_and_chunks_interleave(
        tmp_path):
    inline = DumpConfig(tmp_path / "inline", 0)
    run_passes(inline, None)  # None: written in this thread, at once
    threaded = DumpConfig(tmp_path / "threaded", 0)
    box: list = []
    writer = dump_writer.DumpWriter(slow(functools.partial(sglang_dump.write_job, threaded),
                                         0.002), threaded.max_pending_bytes)
    box.append(writer)
    assert run_passes(threaded, writer) >= 10
    assert writer.flush(timeout_s=60)
    stats = writer.snapshot()
    assert stats["max_queue_jobs"] > 5  # the writer lagged: chunks waited behind others
    assert stats["jobs_written"] == stats["jobs_submitted"] and stats["jobs_failed"] == 0
    assert stats["tokens"] == sum(TOTALS.values())
    names = sorted(p.name for p in inline.dump_dir.iterdir())
    assert names == sorted(p.name for p in threaded.dump_dir.iterdir())
    assert len(names) == len(TOTALS)
    for name in names:  # same metadata, same tensors: the chunks appended in their order
        a, b = (sglang_dump.load_dump(d / name) for d in (inline.dump_dir, threaded.dump_dir))
        assert a.keys() == b.keys()
        for key in a:
            same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else \
                a[key] == b[key]
            assert same, (name, key)
    assert_dumps_equal_reference(threaded.dump_dir)
    writer.close()


def test_submit_waits_and_logs_when_the_writer_falls_behind_and_loses_no_dump(tmp_path, caplog):
    H, K = 8, len(CAPTURE)
    row_bytes = 8 + 2 * H + 2 * K * H
    limit = 40 * row_bytes  # a few requests' rows
    config = DumpConfig(tmp_path / "dump", 0, max_pending_bytes=limit)
    seen: list[int] = []
    box: list = []
    writer = dump_writer.DumpWriter(
        slow(functools.partial(sglang_dump.write_job, config), 0.02, seen, box), limit,
        warn_every_s=0.0)
    box.append(writer)
    totals = {f"eagle3-s{i}": 5 + i % 11 for i in range(24)}
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        run_passes(config, writer, totals, chunk=8, budget=24)
        queued_s = time.monotonic() - t0
        assert writer.flush(timeout_s=60)
    stats = writer.snapshot()
    # The hook waited for room: the passes took about as long as the writes.
    assert stats["blocked_waits"] > 0 and stats["blocked_s"] > 0.1 and queued_s > 0.2
    assert "the writer is behind" in caplog.text and "MB pending" in caplog.text
    # Bounded: the queue never held more than the limit (each job is below it).
    assert stats["max_queue_bytes"] <= limit and max(seen) <= limit
    assert stats["jobs_written"] == stats["jobs_submitted"] and stats["jobs_failed"] == 0
    assert stats["job_bytes"] == sum(totals.values()) * row_bytes
    assert stats["bytes_per_token"] == row_bytes
    assert_dumps_equal_reference(config.dump_dir, totals)


def test_submit_lets_a_job_larger_than_the_bound_through_alone(tmp_path):
    config = DumpConfig(tmp_path / "dump", 0, max_pending_bytes=1)
    writer = dump_writer.DumpWriter(functools.partial(sglang_dump.write_job, config), 1)
    run_passes(config, writer, {"eagle3-a": 9, "eagle3-b": 4}, chunk=4, budget=8)
    assert writer.flush(timeout_s=30)
    assert writer.snapshot()["max_queue_jobs"] == 1  # one at a time, none refused
    assert_dumps_equal_reference(config.dump_dir, {"eagle3-a": 9, "eagle3-b": 4})


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_writer_whose_staging_ring_wraps_many_times_writes_the_synchronous_files(tmp_path,
                                                                               layout):
    inline = DumpConfig(tmp_path / "inline", 0, layout=layout)
    run_passes(inline, None)
    H, K = 8, len(CAPTURE)
    limit = 60 * (8 + 2 * H + 2 * K * H)  # ~60 rows: the ring is reused every few passes
    config = DumpConfig(tmp_path / "ring", 0, layout=layout, max_pending_bytes=limit)
    writer = sglang_dump.writer_for(config)
    slow_write = slow(writer._write, 0.002)  # a lagging writer: the queue and the ring fill
    writer._write = slow_write
    run_passes(config, writer)
    assert writer.flush(timeout_s=60)
    stats, ring = writer.snapshot(), writer.ring
    assert stats["ring_bytes"] == dump_staging.ring_capacity(limit) == ring.capacity
    assert stats["jobs_failed"] == 0 and stats["jobs_written"] == stats["jobs_submitted"]
    assert stats["job_bytes"] > 5 * ring.capacity  # every byte of the ring used again and again
    assert ring.takes + stats["ring_misses"] == stats["jobs_submitted"]
    assert ring.takes > 3 * stats["ring_misses"] and ring.in_use() == 0
    for path in sorted(inline.dump_dir.iterdir()):  # the same files, a slot never written over
        a, b = sglang_dump.load_dump(path), sglang_dump.load_dump(config.dump_dir / path.name)
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.uint8), b[key].view(torch.uint8)), (path, key)
            else:
                assert value == b[key], (path, key)


def test_a_job_whose_staging_fails_gives_its_slot_back_and_the_next_pass_is_written(
        tmp_path, monkeypatch, caplog):
    config = DumpConfig(tmp_path / "dump", 0)
    writer = sglang_dump.writer_for(config)
    rows, calls = dump_staging.HostStaging.rows, [0]

    def rows_failing_once(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:  # the first job's aux rows: its ids are in its slot already
            raise RuntimeError("copy failed")
        return rows(self, *args, **kwargs)

    monkeypatch.setattr(dump_staging.HostStaging, "rows", rows_failing_once)
    with caplog.at_level(logging.ERROR):
        run_passes(config, writer, {"eagle3-a": 5, "eagle3-b": 4}, chunk=8, budget=16)
    assert writer.flush(timeout_s=30)
    assert "skipped rid eagle3-a: copy failed" in caplog.text
    assert writer.ring.in_use() == 0 and writer.ring.takes == 2
    assert [p.name for p in config.dump_dir.iterdir()] == ["eagle3-b.safetensors"]
    assert_dumps_equal_reference(config.dump_dir, {"eagle3-b": 4})


def test_writer_keeps_its_counters_in_the_stats_file_when_asked(tmp_path):
    stats_file = tmp_path / "stats" / "writer.json"
    stats_file.parent.mkdir()
    config = DumpConfig(tmp_path / "dump", 0, stats_file=stats_file)
    writer = sglang_dump.writer_for(config)
    run_passes(config, writer)
    assert writer.flush(timeout_s=60)  # the thread wrote the file when the queue ran empty
    stats = json.loads(stats_file.read_text())
    assert stats["jobs_written"] == stats["jobs_submitted"] == writer.snapshot()["jobs_written"]
    assert stats["tokens"] == sum(TOTALS.values()) and stats["queue_jobs"] == 0
    assert stats["pid"] == os.getpid() and stats["bytes_per_token"] == 8 + 2 * 8 + 2 * 3 * 8
    assert stats["max_pending_bytes"] == 2048 << 20
    assert not [p for p in config.dump_dir.iterdir() if p.name.startswith(".")]
    assert not [p for p in stats_file.parent.iterdir() if p.name.endswith(".tmp")]


def test_client_listing_skips_stats_and_temp_files_and_takes_older_dumps(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    for name in ("eagle3-a.safetensors", "eagle3-b.pt", ".eagle3_writer_stats.json",
                 ".eagle3-c.safetensors.123.tmp", "other-d.safetensors", "%2Ex.safetensors"):
        (d / name).write_bytes(b"x")
    assert [p.name for p in dumps.dump_files(d, "eagle3-")] == ["eagle3-a.safetensors",
                                                                "eagle3-b.pt"]
    assert dumps.clean_dump_dir(d, "eagle3-") == 2
    assert sorted(p.name for p in d.iterdir()) == [
        "%2Ex.safetensors", ".eagle3-c.safetensors.123.tmp", ".eagle3_writer_stats.json",
        "other-d.safetensors"]
    assert [p.name for p in dumps.dump_files(d, "")] == ["%2Ex.safetensors",
                                                         "other-d.safetensors"]


def test_queued_dumps_are_written_when_the_server_process_exits_normally(tmp_path):
    child = start_writer_child(tmp_path / "dump", "exit", PROMPTS)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and "queued" in out
    assert_dumps_equal_reference(tmp_path / "dump", PROMPTS)
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        f"eagle3-p{i}.safetensors" for i in range(5)]  # no temp file either


def test_writer_killed_mid_file_leaves_no_file_a_client_takes_for_a_dump(tmp_path):
    dump_dir = tmp_path / "dump"
    pid = kill_writer_mid_file(dump_dir, PROMPTS)
    names = sorted(p.name for p in dump_dir.iterdir())
    assert names == [f".eagle3-p2.safetensors.{pid}.tmp", "eagle3-p0.safetensors",
                     "eagle3-p1.safetensors"]
    assert [p.name for p in dumps.dump_files(dump_dir, "eagle3-")] == names[1:]
    assert sglang_dump.peek_num_tokens(dump_dir / names[0]) is None
    expected = dumps.Expected(8, tuple(CAPTURE), tmp_path)
    for i in (0, 1):  # the whole ones read and check as dumps
        rid = f"eagle3-p{i}"
        dump = dumps.read_dump(sglang_dump.dump_file_path(dump_dir, rid), 3 + i, expected)
        dumps.check_dump(dump, rid, reference_ids(rid, 3 + i).tolist(), expected, dump_dir)
    with pytest.raises(sglang_dump.DumpError, match="truncated|header"):
        sglang_dump.load_dump(dump_dir / names[0])
    # The next writer on this folder removes the dead writer's temp file.
    sglang_dump.writer_for(DumpConfig(dump_dir, 0))
    assert not (dump_dir / names[0]).exists()
