"""04's torch.compile cache lives in the workdir (`<workdir>/.cache/torch_compile`, or
--compile-cache), so a re-run on a fresh container or host compiles from it; the environment's
TORCHINDUCTOR_CACHE_DIR wins; the process's environment is as it was once the run ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import train_helpers as th

from eagle3.train.distributed import DistInfo
from eagle3.train.loop import COMPILE_CACHE, Runtime, compile_cache

ENV = "TORCHINDUCTOR_CACHE_DIR"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return th.write_splits(tmp_path_factory.mktemp("cachedata"), 8, 2)


def _runtime(compiled: bool) -> Runtime:
    return Runtime(torch.device("cpu"), DistInfo(), False, "naive", compiled)


def test_the_compiled_run_compiles_with_its_workdir_cache_and_restores_the_environment(
        tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    seen = []
    real = torch.compile

    def spy(model, **kw):  # the training forward's compile: where would Inductor cache it?
        seen.append(os.environ.get(ENV))
        return real(model, backend="aot_eager", **kw)

    monkeypatch.setattr(torch, "compile", spy)
    th.run_tiny(tiny_data, tmp_path / "w", epochs=1, compile=True)
    assert seen == [str((tmp_path / "w" / COMPILE_CACHE).absolute())]
    assert ENV not in os.environ

    seen.clear()
    th.run_tiny(tiny_data, tmp_path / "x", epochs=1, compile=True,
                compile_cache=tmp_path / "mine")
    assert seen == [str((tmp_path / "mine").absolute())] and ENV not in os.environ


def test_inductor_writes_its_entries_into_the_folder_and_the_environment_wins(
        tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cfg = th.tiny_config(tmp_path / "w")
    with compile_cache(cfg, _runtime(False)) as folder:  # eager on CPU: nothing compiles
        assert folder is None and ENV not in os.environ
    torch._dynamo.reset()
    with compile_cache(cfg, _runtime(True)) as folder:
        assert folder == (tmp_path / "w" / COMPILE_CACHE).absolute()
        fn = torch.compile(lambda x: torch.sin(x) * 3 + 0.12345)
        assert torch.allclose(fn(torch.ones(8)), torch.sin(torch.ones(8)) * 3 + 0.12345)
    torch._dynamo.reset()
    assert ENV not in os.environ
    assert [p for p in folder.rglob("*") if p.is_file()], "Inductor wrote nothing there"

    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    with compile_cache(cfg, _runtime(True)) as folder:
        assert folder == tmp_path / "env"
    assert os.environ[ENV] == str(tmp_path / "env")
