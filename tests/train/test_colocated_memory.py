"""04 --gpu-memory-fraction: the cap a trainer colocated with the target server takes (stream
mode's colocated placement, train_plan_v4.md); applied on CUDA only."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from eagle3.train.distributed import DistInfo
from eagle3.train.loop import TrainConfig, build_runtime


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(target=Path("t"), workdir=Path("w"), **kw)


def test_gpu_memory_fraction_caps_the_allocator_on_cuda():
    with mock.patch("torch.cuda.set_per_process_memory_fraction") as cap:
        build_runtime(_cfg(gpu_memory_fraction=0.29, compile=False, attention="naive"),
                      torch.device("cuda", 0), DistInfo())
    cap.assert_called_once_with(0.29, torch.device("cuda", 0))


def test_gpu_memory_fraction_is_left_alone_on_cpu_and_when_zero():
    with mock.patch("torch.cuda.set_per_process_memory_fraction") as cap:
        build_runtime(_cfg(gpu_memory_fraction=0.29), torch.device("cpu"), DistInfo())
        build_runtime(_cfg(compile=False, attention="naive"), torch.device("cuda", 0),
                      DistInfo())
    cap.assert_not_called()


def test_gpu_memory_fraction_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="--gpu-memory-fraction"):
        _cfg(gpu_memory_fraction=1.5)
