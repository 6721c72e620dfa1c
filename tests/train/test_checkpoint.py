"""Checkpoint folders: atomic, complete-only, pruned, and refused when the run changed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from eagle3.train.checkpoint import (
    CheckpointError,
    check_data_position,
    clean_state_dict,
    complete_steps,
    load_latest,
    save_checkpoint,
)

CONFIG = {"hidden_size": 16, "num_attention_heads": 2, "capture_layers": [2, 4, 5], "lr": 1e-3}


def _state(step: int) -> dict:
    return {"model": {"_orig_mod.module.fc.weight": torch.full((2, 2), float(step))},
            "optimizer": {"state": {}, "param_groups": []},
            "loop_state": {"step": step}, "data": {"rows_per_step": 4, "seed": 0}}


def test_latest_complete_checkpoint_is_loaded_with_clean_names_and_rng(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=5)
    random.seed(1)
    torch.manual_seed(1)
    save_checkpoint(tmp_path, 6, _state(6), CONFIG, keep_latest=5)
    expected = (random.random(), torch.rand(1))
    state = load_latest(tmp_path, CONFIG)
    assert state["loop_state"]["step"] == 6
    assert list(state["model"]) == ["fc.weight"]  # no torch.compile / DDP prefixes
    from eagle3.train.checkpoint import set_rng_state

    set_rng_state(state["rng"])
    assert (random.random(), torch.rand(1)) == expected


def test_state_file_loads_with_weights_only_and_restores_every_rng(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=5)
    raw = torch.load(tmp_path / "step_000003" / "state.pt", weights_only=True)  # no pickle
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    expected_state = np.random.get_state()
    save_checkpoint(tmp_path, 6, _state(6), CONFIG, keep_latest=5)
    expected = (np.random.standard_normal(), random.random())
    np.random.seed(0)
    random.seed(0)
    from eagle3.train.checkpoint import set_rng_state

    set_rng_state(load_latest(tmp_path, CONFIG)["rng"])
    assert np.random.get_state()[2:] == expected_state[2:]
    assert (np.random.standard_normal(), random.random()) == expected
    assert raw["loop_state"]["step"] == 3


class Payload:
    """Stands for any object a pickle could carry (and run code while loading)."""


def test_state_file_holding_a_pickled_object_is_refused_when_resuming(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=5)
    path = tmp_path / "step_000003" / "state.pt"
    state = torch.load(path, weights_only=True)
    state["extra"] = Payload()  # torch.load(weights_only=False) would build it
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="state.pt holds more than tensors"):
        load_latest(tmp_path, CONFIG)


def test_folder_without_marker_is_ignored_when_a_save_was_killed(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=5)
    torn = tmp_path / ".tmp_step_000006"  # what a kill mid-save leaves
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"partial")
    half = tmp_path / "step_000009"  # a folder someone copied without its marker
    half.mkdir()
    assert complete_steps(tmp_path) == [3]
    assert load_latest(tmp_path, CONFIG)["loop_state"]["step"] == 3
    save_checkpoint(tmp_path, 6, _state(6), CONFIG, keep_latest=5)
    assert not torn.exists()  # cleaned by the next save


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, _state(step), CONFIG, keep_latest=2)
    assert complete_steps(tmp_path) == [6, 8]


def test_resume_refused_when_the_architecture_changed(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=2)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_latest(tmp_path, {**CONFIG, "hidden_size": 32})
    assert load_latest(tmp_path, {**CONFIG, "lr": 5e-4}) is not None  # not architecture


def test_resume_refused_when_the_global_batch_or_seed_changed():
    state = _state(3)
    check_data_position(state, 4, 0, "step_000003")
    with pytest.raises(CheckpointError, match="global batch"):
        check_data_position(state, 8, 0, "step_000003")
    with pytest.raises(CheckpointError, match="--seed"):
        check_data_position(state, 4, 1, "step_000003")


def test_clean_state_dict_strips_nested_wrapper_prefixes():
    out = clean_state_dict({"module._orig_mod.norm.weight": 1, "fc.weight": 2})
    assert out == {"norm.weight": 1, "fc.weight": 2}



def test_resume_refused_when_the_draft_arch_changed(tmp_path):
    save_checkpoint(tmp_path, 3, _state(3), CONFIG, keep_latest=2)  # no arch key: the old default
    assert load_latest(tmp_path, {**CONFIG, "arch": "llama"}) is not None
    with pytest.raises(CheckpointError, match="arch"):
        load_latest(tmp_path, {**CONFIG, "arch": "mla"})


def test_background_writer_saves_what_the_state_was_when_save_returned(tmp_path):
    """The loop goes on (and changes the weights) while the writer thread writes: the folder
    holds the state at the time of `save`, equal to a synchronous save's, pruned the same way."""
    from eagle3.train.checkpoint import CheckpointWriter

    weight = torch.zeros(64, 64)
    writer = CheckpointWriter()
    for step in (3, 6, 9):
        weight.fill_(float(step))
        writer.save(tmp_path / "bg", step, {**_state(step), "model": {"fc.weight": weight}},
                    CONFIG, keep_latest=2)
        weight.fill_(-1.0)  # the next update, before the write has finished
        save_checkpoint(tmp_path / "sync", step, {**_state(step), "model": {
            "fc.weight": torch.full((64, 64), float(step))}}, CONFIG, keep_latest=2)
    writer.wait()
    assert complete_steps(tmp_path / "bg") == complete_steps(tmp_path / "sync") == [6, 9]
    got, want = (load_latest(tmp_path / d, CONFIG) for d in ("bg", "sync"))
    torch.testing.assert_close(got["model"]["fc.weight"], want["model"]["fc.weight"])
    assert got["loop_state"] == want["loop_state"] == {"step": 9}
    assert len(writer.blocked_s) == len(writer.write_s) == 3


def test_background_writer_error_reaches_the_loop_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    """A full disk during a background write: the next `wait` (the next save, or the end of
    training) raises the DiskError; the step folder is not complete and the one before stays
    the latest."""
    from eagle3.core.faults import DiskError
    from eagle3.train.checkpoint import CheckpointWriter
    from tests.fault_helpers import full_disk_shim

    writer = CheckpointWriter()
    writer.save(tmp_path, 3, _state(3), CONFIG, keep_latest=2)
    writer.wait()
    with full_disk_shim(monkeypatch, after_bytes=100, under=tmp_path):
        writer.save(tmp_path, 6, _state(6), CONFIG, keep_latest=2)
        with pytest.raises(DiskError, match="no space left"):
            writer.wait()
    assert complete_steps(tmp_path) == [3]
    assert load_latest(tmp_path, CONFIG)["loop_state"] == {"step": 3}
    writer.save(tmp_path, 6, _state(6), CONFIG, keep_latest=2)  # space is back
    writer.wait()
    assert complete_steps(tmp_path) == [3, 6] and not list(tmp_path.glob(".tmp_*"))


def test_background_writer_error_is_only_logged_when_the_loop_is_already_stopping(
        tmp_path, monkeypatch, caplog):
    """The loop stops on another error (a signal) while a write fails: the write in flight is
    joined and its error logged, so that the loop's own error is the one raised."""
    from eagle3.train.checkpoint import CheckpointWriter
    from tests.fault_helpers import full_disk_shim

    writer = CheckpointWriter()
    with full_disk_shim(monkeypatch, after_bytes=100, under=tmp_path):
        writer.save(tmp_path, 3, _state(3), CONFIG, keep_latest=2)
        writer.wait(raise_error=False)
    assert "the checkpoint write in flight failed too" in caplog.text
    assert complete_steps(tmp_path) == []
    writer.wait()  # nothing left to raise


def test_reserve_allocates_every_buffer_of_the_save_ahead_in_its_thread(tmp_path):
    """`reserve` after the first optimizer step allocates, in its own thread, exactly the host
    buffers the saves then copy into: no save allocates one (on CUDA these are the pinned
    buffers whose first allocation had blocked the loop for 17.8 s), and what is written equals
    a synchronous save of the same state. Device tensors are simulated: every tensor takes the
    buffer path, allocated with plain `torch.empty`."""
    import threading

    from eagle3.train.checkpoint import CheckpointWriter

    allocated = []

    class Writer(CheckpointWriter):
        @staticmethod
        def _needs_buffer(t):
            return True

        @staticmethod
        def _allocate(shape, dtype):
            allocated.append(threading.current_thread().name)
            return torch.empty(shape, dtype=dtype)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    writer = Writer()
    writer.reserve({"model": model.state_dict(), "optimizer": opt.state_dict()})
    n_tensors = len(model.state_dict()) + sum(
        len([v for v in s.values() if torch.is_tensor(v)]) for s in opt.state.values())
    for k in (1, 2):
        state = {**_state(k), "model": model.state_dict(), "optimizer": opt.state_dict()}
        writer.save(tmp_path / "bg", k, state, CONFIG, keep_latest=2)
        save_checkpoint(tmp_path / "sync", k, state, CONFIG, keep_latest=2)
        step()  # the weights and moments move on while the writer writes
    writer.wait()
    assert allocated == ["checkpoint-reserve"] * n_tensors and n_tensors == 4 + 4 * 3
    assert writer.reserve_s is not None
    got, want = (load_latest(tmp_path / d, CONFIG) for d in ("bg", "sync"))
    for key, value in want["model"].items():
        torch.testing.assert_close(got["model"][key], value, rtol=0, atol=0)
    for i, moments in want["optimizer"]["state"].items():
        for name, value in moments.items():
            torch.testing.assert_close(got["optimizer"]["state"][i][name], value, rtol=0, atol=0)
