"""Process groups for `torchrun`: rank, device, DDP wrapping, reductions.

One process per GPU (`torchrun --nproc-per-node 8 04_train.py ...`; several nodes add
`--nnodes N --node-rank i --rdzv-endpoint HOST:PORT`). NCCL on CUDA, gloo on CPU (tests). Rank 0
logs and saves; every rank reads its own rows of the data plan (data.py). The work directory must
be on a filesystem every node sees (checkpoints are written by rank 0 and read by all).

Memory per GPU at Kimi-K2.5 draft size (1.19B trained parameters): fp32 weights + grads + two
AdamW moments = 16 B/param = 19 GB, the bf16 weight copies autocast makes 2.4 GB, the frozen
embedding and teacher rows 2.8 GB, activations ~3 GB per 1K tokens of a packed row with 7 TTT
steps. DDP keeps all of it on each GPU, which fits an 80 GB card at rows of 16K tokens. FSDP2
(`torch.distributed.fsdp.fully_shard` on the draft, states sharded over N GPUs: 19/N GB) is only
needed for cards under ~48 GB or much wider drafts; this trainer does not implement it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def env_dist_info(env: dict | None = None) -> DistInfo:
    """Rank, world size and local rank as `torchrun` sets them (1 process otherwise)."""
    env = os.environ if env is None else env
    return DistInfo(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                    int(env.get("LOCAL_RANK", 0)))


def init(info: DistInfo, device: str) -> torch.device:
    """Join the process group (when world > 1) and return this rank's device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", info.local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if info.enabled and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=info.rank, world_size=info.world,
                                device_id=dev if dev.type == "cuda" else None)
        log.info("rank %d/%d on %s (%s)", info.rank, info.world, dev, backend)
    return dev


def wrap(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """DDP around `model` (buffers are frozen target tensors: never broadcast)."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               broadcast_buffers=False, gradient_as_bucket_view=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (no-op on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
