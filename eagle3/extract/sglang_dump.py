"""Hidden-state dump that runs inside a patched SGLang server (stage 02b, sglang backend).

`python -m eagle3.extract.patching` injects a few lines into SGLang's `sglang/srt/models/deepseek_v2.py`
(see `patches/README.md`). When the environment variable `EAGLE3_DUMP_DIR` is set in the server's
environment, those lines load this file by path and call:

- `enable_capture(model)` at the end of `DeepseekV2ForCausalLM.__init__`, which switches on the
  capture of the aux hidden states at build time, before SGLang captures any CUDA graph;
- `maybe_dump(model, forward_batch, hidden_states, aux_hidden_states)` in
  `DeepseekV2ForCausalLM.forward`, after the model returned its states and before the logits
  processor. It never raises: any error is logged and the request is skipped.

Without the variable the patched SGLang never imports this file and runs unchanged. This module
must import without SGLang (pure torch); it is also loaded under the name `eagle3_sglang_dump`,
so it imports nothing from the `eagle3` package: its four siblings, also pure torch, are
loaded by path the same way (`_sibling`): the file format (`dump_file.py`), the writer thread
(`dump_writer.py`), the staging of rows in host memory (`dump_staging.py`) and the fp8
quantizer (`eagle3/core/fp8.py`, the one 02b stores with).

What is read. Only TP rank 0 writes (with plain tensor parallelism every rank holds the same
states). Only forward passes whose `forward_mode` is `EXTEND` are read: not MIXED, TARGET_VERIFY,
IDLE, DECODE, DRAFT_EXTEND(_V2) or anything else, although SGLang's `is_extend()` counts MIXED and
TARGET_VERIFY as extend. A pass holds several requests: request `j` owns rows
`extend_start_loc[j] : extend_start_loc[j] + extend_seq_lens_cpu[j]` and is named by `rids[j]`;
rows past `sum(extend_seq_lens_cpu)` are CUDA-graph padding and are never read. Requests whose
rid does not start with the rid prefix (`EAGLE3_DUMP_RID_PREFIX`, default `"eagle3-"`) are
ignored, and so are health checks (rid prefix `HEALTH_CHECK`) whatever the prefix: SGLang's
startup warmup sends no rid and gets a random hex one, so it never matches the default prefix.

Off the forward path (patches/README.md, "What is written when"). `maybe_dump` only starts
copies and queues one job per request; one writer thread (`dump_writer.DumpWriter`, FIFO) writes
them. A job's rows go into a slot of the writer's staging ring (`dump_staging.HostRing`: one
host buffer of the queue bound plus an eighth, pinned on a CUDA host at model build, reused in
FIFO order; a job it has no room for gets buffers of its own), so that passes allocate no host
memory and writes free none. On a GPU a request's real rows (input_ids, aux, final) are copied
into that pinned memory on the dump's own CUDA stream, which first waits for the work queued on
the current stream; the sources are marked used by that stream (`record_stream`) so the caching
allocator keeps their memory until the copies are done, and the job carries the event that says
so. With `EAGLE3_DUMP_LAYOUT=fp8` and `EAGLE3_DUMP_FP8_ON_GPU=1` the pass's aux rows are
quantized on that stream first (transient GPU memory: half the pass's aux states); otherwise the
writer quantizes them, in place in the job's rows. On a CPU (the tests, SGLang's CPU device)
the copies are plain. While the queued jobs hold more than `EAGLE3_DUMP_MAX_PENDING_MB` of host
memory, `maybe_dump` waits (logged): the server slows, no dump is lost. The queue is written out
at interpreter exit; a SIGKILL (SGLang's own shutdown of its schedulers) leaves at most a temp
file, never a partial dump.

Dump file, format version 3 (`dump_file.py`): `dump_file_path(dump_dir, rid)` =
`<dump_dir>/<rid>.safetensors`, tensors `input_ids` int64 [T], `aux_hidden_states` [T, K*H] (bf16,
or e4m3 with `aux_hidden_states_scale` float32 [T, K]), `final_hidden_states` bf16 [T, H], and
metadata (format, version, rid, num_tokens, capture_layers, layout). Capture index `i` is the
residual stream entering decoder layer `i` (Hugging Face `output_hidden_states[i]`).
`input_ids` is the dump's identity: a client compares them with the prompt it sent under the rid.

Chunked prefill: a prompt prefilled in several passes arrives as several chunks of the same rid,
`extend_prefix_lens_cpu[j]` being where the chunk starts. The first chunk (prefix 0) writes the
file; each later one must start where the file ends and is appended (the file rewritten), so the
file holds the prompt's first `num_tokens` tokens until its last chunk is written. A chunk that
does not fit (a radix-cache hit, a chunk run in a MIXED pass) removes the file and is logged as
an error: an incomplete dump is never left behind.

Server flags the dump needs (see `patches/README.md`): `--disable-radix-cache`,
`--skip-server-warmup`, no `--enable-mixed-chunk`, no pipeline parallelism, no prefill CUDA graph
(`--disable-piecewise-cuda-graph` up to 0.5.13, `--cuda-graph-backend-prefill disabled` from
0.5.14), no `--allow-auto-truncate`.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _sibling(package: str, module: str) -> Any:
    """A pure-torch module of this checkout: imported from the eagle3 package when this file was
    (02b, the tests), else loaded by path under `eagle3_<module>` (inside SGLang), once."""
    if __package__ == "eagle3.extract":
        return importlib.import_module(f"eagle3.{package}.{module}")
    name = f"eagle3_{module}"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / package / f"{module}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    return sys.modules[name]


_file = _sibling("extract", "dump_file")
_writer = _sibling("extract", "dump_writer")
_staging = _sibling("extract", "dump_staging")
_fp8 = _sibling("core", "fp8")

# The file format's names, for the hook's callers (02b's client, the tests).
DUMP_FORMAT, DUMP_VERSION, DUMP_DTYPE = _file.DUMP_FORMAT, _file.DUMP_VERSION, _file.DUMP_DTYPE
DUMP_KEYS, LAYOUT_KEYS, LAYOUTS = _file.DUMP_KEYS, _file.LAYOUT_KEYS, _file.LAYOUTS
HEADER_MAX_BYTES, SUFFIX, LEGACY_SUFFIX = _file.HEADER_MAX_BYTES, _file.SUFFIX, _file.LEGACY_SUFFIX
DumpError, OldDumpError = _file.DumpError, _file.OldDumpError
dump_file_path, legacy_dump_path = _file.dump_file_path, _file.legacy_dump_path
load_dump, save_dump, peek_num_tokens = _file.load_dump, _file.save_dump, _file.peek_num_tokens

# Environment variables, read only by the server-side entry points below.
ENV_DUMP_DIR = "EAGLE3_DUMP_DIR"
ENV_RID_PREFIX = "EAGLE3_DUMP_RID_PREFIX"
ENV_LAYOUT = "EAGLE3_DUMP_LAYOUT"
ENV_MAX_PENDING_MB = "EAGLE3_DUMP_MAX_PENDING_MB"
ENV_STATS_FILE = "EAGLE3_DUMP_STATS_FILE"
# "1": the fp8 layout quantizes on the GPU, before the copy (half the bytes over PCIe). Off by
# default until tests/extract/test_dump_cuda.py passes on a GPU with the quantizer's exact
# division (on an H100, 2026-12-07, the scales were one ulp off the host's: CUDA divided by a
# Python number as a product with its reciprocal); without it the writer thread quantizes the
# bf16 rows.
ENV_FP8_ON_GPU = "EAGLE3_DUMP_FP8_ON_GPU"
DEFAULT_RID_PREFIX = "eagle3-"
DEFAULT_MAX_PENDING_MB = 2048
# SGLang's own prefix for /health generations (sglang.srt.constants.HEALTH_CHECK_RID_PREFIX).
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class CaptureSetupError(RuntimeError):
    """Aux capture could not be switched on; raised at model build so the server stops."""


@dataclass(frozen=True)
class DumpConfig:
    """Where and what the dump writes."""

    dump_dir: Path  # created mode 0700 if missing
    tp_rank: int  # this process's tensor-parallel rank; only rank 0 writes
    rid_prefix: str = DEFAULT_RID_PREFIX  # only rids starting with it are dumped ("" = all)
    layout: str = "bf16"  # of the aux states in the files: "bf16" or "fp8" (LAYOUTS)
    max_pending_bytes: int = DEFAULT_MAX_PENDING_MB << 20  # host bytes queued, at most
    stats_file: Path | None = None  # the writer's counters as JSON; None: not written
    fp8_on_gpu: bool = False  # fp8 layout: quantize on the GPU (ENV_FP8_ON_GPU), else the host


@dataclass(frozen=True)
class RequestRows:
    """Where one request's rows sit in a forward pass."""

    rid: str
    start: int  # first row in the pass (extend_start_loc)
    num_rows: int  # rows of this chunk (extend_seq_lens_cpu)
    prefix_len: int  # tokens of the prompt before this chunk (extend_prefix_lens_cpu)


@dataclass
class DumpJob:
    """One request's chunk on its way to the writer: host tensors, filled once `ready` fired."""

    req: RequestRows
    input_ids_T: torch.Tensor  # int64 [n]
    aux_TW: torch.Tensor  # [n, K*H]: bf16, or e4m3 when aux_scale_TK is set
    aux_scale_TK: torch.Tensor | None  # float32 [n, K] (fp8 quantized on the GPU), else None
    final_TH: torch.Tensor  # bf16 [n, H]
    capture_layers: tuple[int, ...]
    ready: Any = None  # a torch.cuda.Event recorded after the copies; None: copied already
    slot: Any = None  # the staging ring's slot the tensors are in (given back once written)


# ---------------------------------------------------------------------------------------------
# Capture layers


def default_capture_layers(num_layers: int) -> list[int]:
    """SGLang's default EAGLE-3 capture indices `[2, N//2, N-3]`: `[2, 30, 58]` for 61 layers.

    The copy of `eagle3.core.target.default_capture_layers` this server-side file needs, as it
    imports nothing from eagle3; tests/extract/test_sglang_dump.py checks the two agree."""
    return [2, num_layers // 2, num_layers - 3]


def capture_argument(capture_layers: Sequence[int]) -> list[int]:
    """The ids to pass to `set_eagle3_layers_to_capture` to capture `capture_layers`.

    The rule is per model file and release (read from their sources, 0.5.10-0.5.23):
    `DeepseekV2ForCausalLM` adds 1 to every id in 0.5.10-0.5.12 and, from 0.5.13, only when the
    first id is 1; `Qwen2ForCausalLM` and `LlamaForCausalLM` add 1 to every id in every release.
    Passing `capture - 1` with a first capture of 2 (first id 1) therefore gives the same
    captures in every hooked class on every supported version: `[1, 29, 57]` captures
    `[2, 30, 58]`, `[1, 13, 24]` captures `[2, 14, 25]` (28 layers, Qwen2.5-Coder-1.5B).
    """
    if not capture_layers or capture_layers[0] != 2:
        raise CaptureSetupError(
            f"capture layers {list(capture_layers)} must start at 2: only then does one "
            "set_eagle3_layers_to_capture argument mean the same layers on every SGLang version"
        )
    return [layer - 1 for layer in capture_layers]


def enable_capture(model: Any) -> list[int]:
    """Switch on aux capture of `default_capture_layers` on a hooked model: a
    `DeepseekV2ForCausalLM`, `Qwen2ForCausalLM` or `LlamaForCausalLM` (or a subclass).

    Called from the patched `__init__`; raises `CaptureSetupError` (stopping the server) when
    SGLang did not end up capturing exactly those layers, e.g. under pipeline parallelism or in
    a release whose id rule differs from `capture_argument`'s.
    """
    capture_layers = default_capture_layers(int(model.config.num_hidden_layers))
    model.set_eagle3_layers_to_capture(capture_argument(capture_layers))
    actual = list(getattr(model.model, "layers_to_capture", []))
    if not getattr(model, "capture_aux_hidden_states", False) or actual != capture_layers:
        raise CaptureSetupError(
            f"asked SGLang's {type(model).__name__} to capture layers {capture_layers} but it "
            f"captures {actual}; "
            "the dump needs plain tensor parallelism on one pipeline stage (drop --pp-size) "
            "and a supported SGLang (python -m eagle3.extract.patching --check)"
        )
    config = server_config()
    if config.tp_rank == 0:
        logger.info("eagle3 dump: %s capturing layers %s of %d, writing to %s (rid prefix %r, "
                    "layout %s, at most %d MB queued)", type(model).__name__, capture_layers,
                    model.config.num_hidden_layers, config.dump_dir, config.rid_prefix,
                    config.layout, config.max_pending_bytes >> 20)
        if torch.cuda.is_available():  # pin the staging ring now, not in the first passes
            t0 = time.monotonic()
            ring = writer_for(config).ring
            ring.allocate()
            logger.info("eagle3 dump: %d MB of pinned host memory for staging in %.1f s",
                        ring.capacity >> 20, time.monotonic() - t0)
    return capture_layers


# ---------------------------------------------------------------------------------------------
# Configuration and the writer


def config_from_env(environ: Mapping[str, str], tp_rank: int) -> DumpConfig:
    """The dump configuration named by the environment; raises `DumpError` if the dir is unset
    or a value is not one the dump takes."""
    dump_dir = environ.get(ENV_DUMP_DIR, "")
    if not dump_dir:
        raise DumpError(f"{ENV_DUMP_DIR} is not set; set it to the dump directory")
    prefix = environ.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
    layout = environ.get(ENV_LAYOUT, "") or "bf16"
    if layout not in LAYOUTS:
        raise DumpError(f"{ENV_LAYOUT}={layout!r}: expected one of {', '.join(LAYOUTS)}")
    pending = environ.get(ENV_MAX_PENDING_MB, "") or str(DEFAULT_MAX_PENDING_MB)
    if not pending.isdigit() or int(pending) < 1:
        raise DumpError(f"{ENV_MAX_PENDING_MB}={pending!r}: expected a whole number of MB >= 1 "
                        f"(default {DEFAULT_MAX_PENDING_MB})")
    stats = environ.get(ENV_STATS_FILE, "")
    on_gpu = environ.get(ENV_FP8_ON_GPU, "") or "0"
    if on_gpu not in ("0", "1"):
        raise DumpError(f"{ENV_FP8_ON_GPU}={on_gpu!r}: expected 0 or 1")
    return DumpConfig(dump_dir=Path(dump_dir), tp_rank=tp_rank, rid_prefix=prefix,
                      layout=layout, max_pending_bytes=int(pending) << 20,
                      stats_file=Path(stats) if stats else None, fp8_on_gpu=on_gpu == "1")


def _sglang_tp_rank() -> int:
    # Imported here: this module must import without SGLang.
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


@functools.cache
def server_config() -> DumpConfig:
    """The configuration of this server process, resolved once (the hook's `main`)."""
    config = config_from_env(os.environ, _sglang_tp_rank())
    if config.tp_rank == 0:
        ensure_dump_dir(config.dump_dir)
    return config


def ensure_dump_dir(dump_dir: Path) -> None:
    """Create the dump directory with mode 0700 (hidden states of private prompts) if missing."""
    if not dump_dir.is_dir():
        dump_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        dump_dir.chmod(0o700)  # mkdir's mode is filtered by the umask


_WRITERS: dict[DumpConfig, Any] = {}  # one writer thread per configuration (a server has one)
_WRITERS_LOCK = threading.Lock()


def writer_for(config: DumpConfig) -> Any:
    """The `dump_writer.DumpWriter` of `config` and its staging ring (`dump_staging.HostRing`,
    the bound plus an eighth, pinned on a CUDA host), started on first use (it first removes the
    temp files a killed writer left); every writer is flushed at interpreter exit."""
    with _WRITERS_LOCK:
        writer = _WRITERS.get(config)
        if writer is None:
            if config.dump_dir.is_dir() and (stale := _file.remove_stale_temp_files(
                    config.dump_dir)):
                logger.info("eagle3 dump: removed %d temp files of a dump writer that is gone",
                            stale)
            if not _WRITERS:
                atexit.register(close_writers)
            # Pinned where a GPU is: the rows come from it (a CPU server's rows copy into the
            # pinned memory as into any other).
            ring = _staging.HostRing(_staging.ring_capacity(config.max_pending_bytes),
                                     pin_memory=torch.cuda.is_available())
            writer = _WRITERS[config] = _writer.DumpWriter(
                functools.partial(write_job, config), config.max_pending_bytes,
                config.stats_file, ring=ring)
        return writer


def close_writer(config: DumpConfig) -> None:
    """Write out and stop the writer of `config`, if it runs."""
    with _WRITERS_LOCK:
        writer = _WRITERS.pop(config, None)
    if writer is not None:
        writer.close()


def close_writers() -> None:
    """Write out and stop every writer (atexit)."""
    for config in list(_WRITERS):
        close_writer(config)


# ---------------------------------------------------------------------------------------------
# Writing (the writer thread)


def write_job(config: DumpConfig, job: DumpJob) -> int:
    """Write one job's chunk (the writer thread's `write`): wait for its copies, quantize on the
    host if the fp8 layout was not made on the GPU, write or extend the file, give its ring slot
    back; returns the file's bytes."""
    try:
        if job.ready is not None:
            job.ready.synchronize()
        aux_TW, scale_TK = job.aux_TW, job.aux_scale_TK
        if config.layout == "fp8" and scale_TK is None:
            # In place: the job owns its rows, and a fresh [T, K*H] result would be freed
            # (an munmap) in this thread with the GIL held.
            aux_TW, scale_TK = _fp8.quantize_captures(aux_TW, len(job.capture_layers),
                                                      in_place=True)
        return write_request(config, job.req, job.input_ids_T, aux_TW, scale_TK, job.final_TH,
                             job.capture_layers)
    finally:  # written or failed, its rows are read no more: the ring may hand them out again
        if job.slot is not None:
            job.slot.give_back()


def _append_to_previous(path: Path, req: RequestRows, chunk: dict) -> dict:
    """The tensors of tokens [0, prefix + n), each as two parts: the file's rows, then this
    chunk's (written one after the other: no concatenated copy to allocate and free)."""
    previous = load_dump(path) if path.exists() else None
    if previous is None or previous["rid"] != req.rid or previous["num_tokens"] != req.prefix_len:
        held = None if previous is None else previous["num_tokens"]
        path.unlink(missing_ok=True)
        raise DumpError(
            f"rid {req.rid}: chunk starts at token {req.prefix_len} but the dump holds {held} "
            "tokens; dropped. A radix-cache hit or a chunk run in a MIXED pass: start the server "
            "with --disable-radix-cache and without --enable-mixed-chunk"
        )
    return {key: [previous[key], rows] for key, rows in chunk.items()}


def write_request(config: DumpConfig, req: RequestRows, ids_T: torch.Tensor,
                  aux_TW: torch.Tensor, aux_scale_TK: torch.Tensor | None,
                  final_TH: torch.Tensor, capture_layers: Sequence[int]) -> int:
    """Write (or extend, for a later chunk) the dump file of one request; returns its bytes.
    `ids_T`: the chunk's token ids (int64), `aux_TW`, `aux_scale_TK` (fp8 layout), `final_TH`:
    its states."""
    path = dump_file_path(config.dump_dir, req.rid)
    tensors = {"input_ids": ids_T, "aux_hidden_states": aux_TW, "final_hidden_states": final_TH}
    if aux_scale_TK is not None:
        tensors["aux_hidden_states_scale"] = aux_scale_TK
    if req.prefix_len > 0:
        tensors = _append_to_previous(path, req, tensors)
    num_tokens = req.prefix_len + int(final_TH.shape[0])
    return save_dump({"rid": req.rid, "num_tokens": num_tokens,
                      "capture_layers": [int(layer) for layer in capture_layers],
                      "layout": config.layout, **tensors}, path)


# ---------------------------------------------------------------------------------------------
# Forward passes (the scheduler thread)


def is_dumpable_rid(rid: str, rid_prefix: str) -> bool:
    """Whether a request is ours: it has the rid prefix and is not a health check."""
    return (isinstance(rid, str) and rid.startswith(rid_prefix)
            and not rid.startswith(HEALTH_CHECK_RID_PREFIX))


def is_plain_extend(forward_batch: Any) -> bool:
    """Whether the pass is `ForwardMode.EXTEND` exactly (compared by name across versions)."""
    return getattr(forward_batch.forward_mode, "name", None) == "EXTEND"


def _as_int_list(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def split_requests(forward_batch: Any) -> list[RequestRows]:
    """The requests of an EXTEND pass and their rows; raises `DumpError` if metadata is missing."""
    rids = getattr(forward_batch, "rids", None)
    lens = forward_batch.extend_seq_lens_cpu
    prefixes = forward_batch.extend_prefix_lens_cpu
    if rids is None or lens is None or prefixes is None:
        raise DumpError(
            "EXTEND pass without rids/extend_seq_lens_cpu/extend_prefix_lens_cpu (a prefill "
            "CUDA graph replay?); start the server with --disable-piecewise-cuda-graph "
            "(SGLang <= 0.5.13) or --cuda-graph-backend-prefill disabled (>= 0.5.14)"
        )
    lens, prefixes = _as_int_list(lens), _as_int_list(prefixes)
    starts_src = forward_batch.extend_start_loc
    if starts_src is None:  # the exclusive cumulative sum, as SGLang computes it
        starts = [sum(lens[:j]) for j in range(len(lens))]
    else:
        starts = _as_int_list(starts_src)
    if not len(rids) == len(lens) == len(prefixes) == len(starts):
        raise DumpError(f"batch metadata disagree: {len(rids)} rids, {len(lens)} lengths, "
                        f"{len(prefixes)} prefixes, {len(starts)} starts")
    return [RequestRows(str(rid), start, n, prefix)
            for rid, start, n, prefix in zip(rids, starts, lens, prefixes, strict=True)]


def pack_aux(aux_hidden_states: Any) -> torch.Tensor:
    """Aux states as one `[rows, K*H]` tensor: SGLang <= 0.5.16 hands a list of K `[rows, H]`
    tensors, later versions an already packed tensor."""
    if isinstance(aux_hidden_states, torch.Tensor):
        return aux_hidden_states
    if not aux_hidden_states:
        raise DumpError("no aux hidden states: capture is off (was enable_capture called?)")
    return torch.cat(list(aux_hidden_states), dim=-1)


def _check_pass(forward_batch: Any, hidden_states: torch.Tensor, aux: torch.Tensor,
                num_captures: int) -> tuple[int, torch.Tensor]:
    """(real rows of the pass, its input_ids); raises `DumpError` when the states or the ids do
    not cover them."""
    num_real = sum(_as_int_list(forward_batch.extend_seq_lens_cpu))  # rows past it are padding
    aux_width = hidden_states.shape[-1] * num_captures
    if min(hidden_states.shape[0], aux.shape[0]) < num_real or aux.shape[-1] != aux_width:
        raise DumpError(
            f"states do not fit the batch: final {tuple(hidden_states.shape)}, aux "
            f"{tuple(aux.shape)}, {num_real} tokens, {num_captures} captures (scattered "
            "rows under attention DP or sequence parallelism are not supported)"
        )
    # The pass's token ids, row for row with the states: each dump's identity.
    input_ids = getattr(forward_batch, "input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or \
            input_ids.shape[0] < num_real:
        raise DumpError(f"EXTEND pass whose input_ids ({getattr(input_ids, 'shape', input_ids)})"
                        f" do not cover its {num_real} tokens")
    return num_real, input_ids


def dump_forward_pass(config: DumpConfig, forward_batch: Any, hidden_states: torch.Tensor,
                      aux_hidden_states: Any, capture_layers: Sequence[int],
                      writer: Any = None) -> list[Path]:
    """Queue the dump of every request of one forward pass on `writer` (None: write them now,
    in this thread: `dump_writer.InlineWriter`); returns the files they go to.

    Passes other than EXTEND and ranks other than 0 write nothing. A request that fails is
    logged and skipped; a pass whose metadata is unusable raises `DumpError`.
    """
    if config.tp_rank != 0 or not is_plain_extend(forward_batch):
        return []
    requests = [req for req in split_requests(forward_batch)
                if is_dumpable_rid(req.rid, config.rid_prefix)]
    if not requests:
        return []
    aux = pack_aux(aux_hidden_states)
    K, H = len(capture_layers), hidden_states.shape[-1]
    num_real, input_ids = _check_pass(forward_batch, hidden_states, aux, K)
    writer = writer or _writer.InlineWriter(functools.partial(write_job, config))
    staging = _staging.staging_for(hidden_states.device)
    aux_scale = None
    if config.layout == "fp8" and config.fp8_on_gpu and staging.on_device:  # before PCIe
        real_aux = aux[:num_real]
        aux, aux_scale = staging.compute(lambda: _fp8.quantize_captures(
            real_aux.to(DUMP_DTYPE), K, _fp8.gpu_block_rows(H)), real_aux)
    row_bytes = 8 + 2 * H + (K * H + 4 * K if aux_scale is not None else 2 * K * H)
    layers = tuple(int(layer) for layer in capture_layers)
    # What a job holds: (source, dtype on the host); None where the layout has no such tensor.
    sources = [(input_ids, torch.int64),
               (aux, aux.dtype if aux_scale is not None else DUMP_DTYPE),
               None if aux_scale is None else (aux_scale, torch.float32),
               (hidden_states, DUMP_DTYPE)]
    ring = getattr(writer, "ring", None)

    def make_job(req: RequestRows) -> DumpJob:
        n = req.num_rows
        specs = [((n, *src.shape[1:]), dtype) for src, dtype in filter(None, sources)]
        taken = ring.take(specs) if ring is not None else None  # None: buffers of its own
        slot, outs = taken if taken is not None else (None, [None] * len(specs))
        outs = iter(outs)
        try:
            ids_T, aux_TW, scale_TK, final_TH = (
                None if s is None else staging.rows(s[0], req.start, n, s[1], next(outs))
                for s in sources)
            return DumpJob(req, ids_T, aux_TW, scale_TK, final_TH, layers, staging.done(), slot)
        except BaseException:
            if slot is not None:
                slot.give_back()
            raise

    queued = []
    for req in requests:
        try:
            if req.start < 0 or req.start + req.num_rows > num_real:
                raise DumpError(f"rid {req.rid}: rows {req.start}+{req.num_rows} outside the "
                                f"{num_real} tokens of the pass")
            writer.submit(functools.partial(make_job, req), req.num_rows * row_bytes,
                          req.num_rows, f"rid {req.rid}")
            queued.append(dump_file_path(config.dump_dir, req.rid))
        except Exception as exc:  # a full disk or a bad chunk costs this request, not the server
            logger.exception("eagle3 dump: skipped rid %s: %s", req.rid, exc)
    return queued


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@torch.compiler.disable  # never traced: it must run on every pass, outside any compiled graph
def maybe_dump(model: Any, forward_batch: Any, hidden_states: torch.Tensor,
               aux_hidden_states: Any) -> None:
    """The forward hook: queue this pass's dumps if it is an EXTEND pass on TP rank 0 (waiting
    while the writer's queue is full). Never raises."""
    try:
        if not is_plain_extend(forward_batch):
            return
        config = server_config()
        if config.tp_rank != 0:
            return
        capture_layers = list(model.model.layers_to_capture)
        dump_forward_pass(config, forward_batch, hidden_states, aux_hidden_states,
                          capture_layers, writer_for(config))
    except DumpError as exc:
        _warn_once(f"eagle3 dump: pass skipped: {exc}")
    except Exception:  # the dump must never take the server down
        logger.exception("eagle3 dump: pass skipped")
