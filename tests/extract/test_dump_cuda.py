"""The dump hook's CUDA path (eagle3/extract/dump_staging.py `CudaStaging`): copies into the
writer's pinned staging ring on the dump's own stream, the fp8 layout quantized on the GPU. The
files equal those of the CPU path (the CPU suite's), bit for bit, also when the states' memory
is freed and overwritten on the current stream right after the hook returned, and when the ring
is small enough that every slot is copied into again while earlier jobs are written. Needs a
GPU."""

from __future__ import annotations

import pytest
import torch
from dump_helpers import CAPTURE, forward_pass, prefill_schedule

from eagle3.extract import sglang_dump
from eagle3.extract.sglang_dump import DumpConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the CUDA staging path needs a GPU")
TOTALS = {f"eagle3-g{i}": 1 + (13 * i) % 97 for i in range(24)}


def to_cuda(batch, final, aux):
    batch.input_ids = batch.input_ids.cuda()
    aux = aux.cuda() if isinstance(aux, torch.Tensor) else [a.cuda() for a in aux]
    return batch, final.cuda(), aux


def dump_all(config: DumpConfig, cuda: bool, clobber: bool = False,
             stats: dict | None = None) -> dict:
    config.dump_dir.mkdir(parents=True)
    writer = sglang_dump.writer_for(config)
    for k, chunks in enumerate(prefill_schedule(TOTALS, 32, 64)):
        batch, final, aux = forward_pass(chunks, pad_rows=k % 5, packed=k % 2 == 0,
                                         totals=TOTALS)
        if cuda:
            batch, final, aux = to_cuda(batch, final, aux)
        sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE, writer)
        if clobber:  # free the states and write over memory on the current stream at once
            del batch, final, aux
            for _ in range(4):
                torch.full((1 << 20,), float("nan"), device="cuda").mul_(2)
    assert writer.flush(timeout_s=120)
    assert writer.snapshot()["jobs_failed"] == 0
    if stats is not None:
        stats.update(writer.snapshot(), pinned=writer.ring.allocate().is_pinned())
    sglang_dump.close_writer(config)
    return {rid: sglang_dump.load_dump(sglang_dump.dump_file_path(config.dump_dir, rid))
            for rid in TOTALS}


def assert_same_dumps(cpu: dict, gpu: dict) -> None:
    for rid in TOTALS:
        assert cpu[rid].keys() == gpu[rid].keys()
        for key, value in cpu[rid].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == gpu[rid][key].dtype, (rid, key)
                assert torch.equal(value.view(torch.uint8), gpu[rid][key].view(torch.uint8)), (
                    rid, key)
            else:
                assert value == gpu[rid][key], (rid, key)


@pytest.mark.parametrize("layout,on_gpu", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_cuda_dumps_equal_cpu_dumps_bit_for_bit_when_memory_is_reused(tmp_path, layout, on_gpu):
    cpu = dump_all(DumpConfig(tmp_path / "cpu", 0, layout=layout), cuda=False)
    gpu = dump_all(DumpConfig(tmp_path / "gpu", 0, layout=layout, fp8_on_gpu=on_gpu), cuda=True,
                   clobber=True)
    assert_same_dumps(cpu, gpu)


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_cuda_dumps_equal_cpu_dumps_when_the_pinned_staging_ring_is_reused(tmp_path, layout):
    H, K = 8, len(CAPTURE)
    limit = 200 * (8 + 2 * H + 2 * K * H)  # ~200 rows of 1,176: each slot is copied into again
    cpu = dump_all(DumpConfig(tmp_path / "cpu", 0, layout=layout), cuda=False)
    stats: dict = {}
    gpu = dump_all(DumpConfig(tmp_path / "gpu", 0, layout=layout, max_pending_bytes=limit),
                   cuda=True, clobber=True, stats=stats)
    assert stats["pinned"] and stats["job_bytes"] > 3 * stats["ring_bytes"]
    assert stats["ring_misses"] < stats["jobs_submitted"] // 4  # most jobs staged in the ring
    assert_same_dumps(cpu, gpu)
