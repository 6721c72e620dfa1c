"""Training checkpoints: `step_{step:06d}/` folders, written under a temp name then renamed,
valid only with their `COMPLETE` marker; the latest complete one is resumed from.

Writing runs in the background (`CheckpointWriter`): the loop only enqueues the copy of the
state into host memory (reused pinned buffers on CUDA; on one H200 the copy of a Kimi-K2.5-size
draft and its AdamW moments, 12.7 GB, made the next log window 0.33 s slower), then a writer
thread waits for it, serialises, fsyncs and renames while training goes on. The pinned buffers
are allocated by `reserve`, in a thread, after the first optimizer step: allocating them inside
the first save had blocked the loop for 17.8 s (BENCHMARKS.md, "Training stage (04), start to exit").
The rename stays last, so a kill mid-write leaves the previous checkpoint the latest complete
one; one save is in flight at a time, and the stage waits for it before it
exports or exits. A writer error (a full disk) is raised in the loop at the next save or at the
end.

A folder holds `state.pt` — draft weights (no `_orig_mod.`/`module.` prefixes), optimizer,
schedule, loop state, data position, RNG states — and `config.json` (the resolved training
config). A process killed while writing leaves only a `.tmp_step_*` folder, which is ignored and
removed by the next save.

`state.pt` holds only tensors and plain Python values (the RNG states too, as tensors), so it
loads with `torch.load(..., weights_only=True)`: a checkpoint folder copied from elsewhere
cannot run code on resume, and one holding a pickled object is refused (CheckpointError).
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from eagle3.core.stage import atomic_torch_save, atomic_write_json

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
# Fields whose change makes a checkpoint unusable (the architecture and the data it indexes).
ARCH_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "draft_vocab_size", "vocab_size", "target_hidden_size",
               "capture_layers", "arch", "fc_norm", "norm_output", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# What a checkpoint written before a field existed had (the Llama draft without EAGLE-3.1).
ARCH_DEFAULTS = {"arch": "llama", "fc_norm": False, "norm_output": False, "q_lora_rank": 0,
                 "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says why and what to do."""


def clean_state_dict(state: dict) -> dict:
    """Strip wrapper prefixes (torch.compile `_orig_mod.`, DDP `module.`)."""
    out = {}
    for k, v in state.items():
        stripped = True
        while stripped:  # in any order and nesting: module._orig_mod.x, _orig_mod.module.x
            stripped = False
            for prefix in ("_orig_mod.", "module."):
                if k.startswith(prefix):
                    k, stripped = k[len(prefix):], True
        out[k] = v
    return out


def rng_state() -> dict:
    """Every RNG's state as tensors and plain values (what `weights_only=True` loads)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                        "gauss": gauss},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, state: dict, config: dict, keep_latest: int) -> Path:
    """Write `state` (+ RNG) to `root/step_{step:06d}` atomically; keep the newest few.

    `state` holds at least `model` (a state dict); the other entries (optimizer, schedule,
    loop_state, data) are saved as given.
    """
    payload = {**state, "model": clean_state_dict(state["model"]), "rng": rng_state()}
    return _write_folder(Path(root), step, payload, config, keep_latest)


def _write_folder(root: Path, step: int, payload: dict, config: dict, keep_latest: int) -> Path:
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    atomic_torch_save(payload, tmp / "state.pt")
    atomic_write_json(tmp / "config.json", config)
    (tmp / MARKER).write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in complete_steps(root)[:-keep_latest]:
        shutil.rmtree(root / f"step_{old:06d}", ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):  # left by a process killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


class CheckpointWriter:
    """`save_checkpoint` with the disk write in a background thread (see the module doc).

    `save` returns once the state is in host memory (the seconds it blocked are
    `blocked_s`); `wait` joins the write in flight and raises its error, if any. On CPU the
    copy is a plain clone; on CUDA it goes into pinned buffers kept between saves, allocated
    ahead by `reserve`.
    """

    def __init__(self, background: bool = True):
        self.background = background
        self.blocked_s: list[float] = []  # per save: the loop's wait (copy, and a prior write)
        self.write_s: list[float] = []  # per save: the write itself
        self.reserve_s: float | None = None  # the reservation thread's allocation time
        self._pinned: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._reserving: threading.Thread | None = None
        self._on_device = False  # the save in progress copied a device tensor
        self._error: BaseException | None = None

    def reserve(self, state: dict) -> None:
        """Allocate, in a background thread, the host buffers a save of `state` (the same
        entries `save` gets, or a subset: the model and optimizer hold all the tensors) will
        copy into; the next `save` waits for it. Only device tensors need one."""
        specs = []

        def note(key, t):
            if self._needs_buffer(t):
                specs.append((key, t.shape, t.dtype))
            return t

        _walk({**state, "model": clean_state_dict(state["model"])}, "", note)
        if not specs:
            return

        def allocate():
            t0 = time.perf_counter()
            for key, shape, dtype in specs:
                self._buffer(key, shape, dtype)
            self.reserve_s = time.perf_counter() - t0

        self._reserving = threading.Thread(target=allocate, name="checkpoint-reserve",
                                           daemon=True)
        self._reserving.start()

    def save(self, root: Path, step: int, state: dict, config: dict, keep_latest: int) -> None:
        t0 = time.perf_counter()
        self.wait()
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        self._on_device = False
        payload = {**state, "model": clean_state_dict(state["model"])}
        payload = _walk(payload, "", self._copy)
        payload["rng"] = rng_state()
        done = torch.cuda.Event() if self._on_device else None
        if done is not None:
            done.record()
        args = (Path(root), step, payload, config, keep_latest, done)
        if self.background:
            self._thread = threading.Thread(target=self._write, args=args,
                                            name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
            self.wait()
        self.blocked_s.append(time.perf_counter() - t0)

    def wait(self, raise_error: bool = True) -> None:
        """Join the write in flight; raise what it raised (only log it: `raise_error=False`,
        when the loop is already stopping on another error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if raise_error:
                raise error
            log.error("the checkpoint write in flight failed too: %s", error)

    def _write(self, root, step, payload, config, keep_latest, done) -> None:
        t0 = time.perf_counter()
        try:
            if done is not None:
                done.synchronize()  # the device-to-host copies have landed
            _write_folder(root, step, payload, config, keep_latest)
        except BaseException as e:  # re-raised in the loop by wait()
            self._error = e
        self.write_s.append(time.perf_counter() - t0)

    @staticmethod
    def _needs_buffer(t: torch.Tensor) -> bool:
        """A device tensor: copied into a kept host buffer (a host tensor is cloned)."""
        return t.device.type == "cuda"

    @staticmethod
    def _allocate(shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _buffer(self, key: str, shape, dtype) -> torch.Tensor:
        buf = self._pinned.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._pinned[key] = self._allocate(shape, dtype)
        return buf

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if not self._needs_buffer(t):
            return t.detach().clone()
        self._on_device = self._on_device or t.device.type == "cuda"
        buf = self._buffer(key, t.shape, t.dtype)
        buf.copy_(t.detach(), non_blocking=True)
        return buf


def _walk(obj, key: str, fn):
    """`obj` with each tensor replaced by `fn(path, tensor)`, paths like `/optimizer/state/0/
    exp_avg`: the same for a save and for the `reserve` ahead of it."""
    if isinstance(obj, dict):
        return {k: _walk(v, f"{key}/{k}", fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, f"{key}/{i}", fn) for i, v in enumerate(obj))
    if isinstance(obj, torch.Tensor):
        return fn(key, obj)
    return obj


def complete_steps(root: Path) -> list[int]:
    """Steps of complete checkpoint folders, ascending."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / MARKER).exists())


def load_latest(root: Path, config: dict) -> dict | None:
    """The newest complete checkpoint's state, or None; refuses a changed architecture."""
    steps = complete_steps(root)
    if not steps:
        return None
    folder = Path(root) / f"step_{steps[-1]:06d}"
    saved = json.loads((folder / "config.json").read_text())
    then, now = ({k: c.get(k, ARCH_DEFAULTS.get(k)) for k in ARCH_FIELDS} for c in (saved, config))
    changed = {k: (then[k], now[k]) for k in ARCH_FIELDS if then[k] != now[k]}
    if changed:
        raise CheckpointError(f"{folder} was trained with other architecture settings "
                              f"{changed} (saved, now): use the same flags or --force to restart")
    state = load_state(folder / "state.pt")
    state["folder"] = str(folder)
    log.info("resuming from %s", folder)
    return state


def load_state(path: Path) -> dict:
    """A checkpoint's `state.pt`, read with `weights_only=True`; a file that needs more (a
    pickled object, or a checkpoint written before the RNG states were stored as tensors) is
    refused rather than unpickled."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds more than tensors and plain values, so it is not loaded (unpickling "
            "it could run code): use a checkpoint this pipeline wrote, or pass --force to "
            f"restart ({str(e).splitlines()[0]})") from e


def check_data_position(state: dict, rows_per_step: int, seed: int, folder: str) -> None:
    """Refuse a resume whose global batch (ranks x grad-accum) or data seed changed: the same
    step would then index other rows, and the schedule would not line up."""
    data = state.get("data", {})
    saved = (data.get("rows_per_step"), data.get("seed"))
    if saved != (rows_per_step, seed):
        raise CheckpointError(
            f"{folder} was written with {saved[0]} rows per step (ranks x --grad-accum) and "
            f"--seed {saved[1]}; this run has {rows_per_step} and {seed}: resume with the same "
            "global batch and seed, or pass --force to restart")
