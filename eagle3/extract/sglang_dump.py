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
so it imports nothing from the `eagle3` package.

What is written. Only TP rank 0 writes (with plain tensor parallelism every rank holds the same
states). Only forward passes whose `forward_mode` is `EXTEND` are read: not MIXED, TARGET_VERIFY,
IDLE, DECODE, DRAFT_EXTEND(_V2) or anything else, although SGLang's `is_extend()` counts MIXED and
TARGET_VERIFY as extend. A pass holds several requests: request `j` owns rows
`extend_start_loc[j] : extend_start_loc[j] + extend_seq_lens_cpu[j]` and is named by `rids[j]`;
rows past `sum(extend_seq_lens_cpu)` are CUDA-graph padding and are never read. Requests whose
rid does not start with the rid prefix (`EAGLE3_DUMP_RID_PREFIX`, default `"eagle3-"`) are
ignored, and so are health checks (rid prefix `HEALTH_CHECK`) whatever the prefix: SGLang's
startup warmup sends no rid and gets a random hex one, so it never matches the default prefix.

Dump file, format version 2: `dump_file_path(dump_dir, rid)`, that is `<dump_dir>/<rid>.pt` (rid
percent-encoded for the file system), written atomically (temp file + rename); a `torch.save` of

    {"format": "eagle3-sglang-dump", "version": 2,
     "rid": str, "num_tokens": int T,
     "input_ids": int64 [T],                  # the token ids the server computed for this rid
                                              # (ForwardBatch.input_ids of its rows, every chunk)
     "capture_layers": list[int],            # SGLang capture indices, e.g. [2, 30, 58]
     "aux_hidden_states": bf16 [T, K*H],      # the K captures side by side, in capture order:
                                              # columns k*H:(k+1)*H hold capture_layers[k]
     "final_hidden_states": bf16 [T, H]}      # after the final norm: what the logits processor
                                              # (and so the lm_head) sees

Capture index `i` is the residual stream entering decoder layer `i` (the output of layer `i-1`,
Hugging Face `output_hidden_states[i]`). Load with `load_dump(path)` (`weights_only=True`).

`input_ids` is the dump's identity: the states are those of these tokens, so a client compares
them with the prompt it sent under the rid and refuses a dump of another prompt (a server that
mixed up requests, or a file of another client). They cost 8 bytes a token beside the states'
8H. Version 1 (no `input_ids`) is refused by `load_dump` with `OldDumpError`: a dump lives only
between the server's write and the client's read, so a v1 file means a server still running an
older copy of this module (restart it).

Chunked prefill. A prompt prefilled in several passes arrives as several chunks of the same rid;
`extend_prefix_lens_cpu[j]` is where the chunk starts in the prompt. The first chunk (prefix 0)
writes the file; each later chunk must start exactly where the file ends: it is appended and the
file rewritten. A chunk that does not fit (its start is not the file's length, for example a
radix-cache hit or a chunk that ran in a MIXED pass) removes the file and is logged as an error,
so that an incomplete dump is never left behind. Files are written synchronously, before the
forward pass returns, so a dump is complete by the time SGLang answers the request; a client
checks that the dump's `input_ids` are the prompt it sent.

Server flags the dump needs (see `patches/README.md`): `--disable-radix-cache`,
`--skip-server-warmup`, no `--enable-mixed-chunk`, no pipeline parallelism, no prefill CUDA graph
(`--disable-piecewise-cuda-graph` up to 0.5.13, `--cuda-graph-backend-prefill disabled` from
0.5.14), no `--allow-auto-truncate`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Environment variables, read only by the server-side entry points below.
ENV_DUMP_DIR = "EAGLE3_DUMP_DIR"
ENV_RID_PREFIX = "EAGLE3_DUMP_RID_PREFIX"
DEFAULT_RID_PREFIX = "eagle3-"
# SGLang's own prefix for /health generations (sglang.srt.constants.HEALTH_CHECK_RID_PREFIX).
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
DUMP_FORMAT = "eagle3-sglang-dump"
DUMP_VERSION = 2
DUMP_DTYPE = torch.bfloat16  # of the states; input_ids are int64
# Every key of a version-2 dump, no more (a client refuses other keys).
DUMP_KEYS = ("format", "version", "rid", "num_tokens", "input_ids", "capture_layers",
             "aux_hidden_states", "final_hidden_states")
# File names longer than this are shortened with a hash (file systems allow 255 bytes).
_MAX_NAME_CHARS = 200


class DumpError(RuntimeError):
    """A forward pass or request that cannot be dumped; logged and skipped by `maybe_dump`."""


class OldDumpError(DumpError):
    """A dump of an older format version: the server runs an older copy of this module."""


class CaptureSetupError(RuntimeError):
    """Aux capture could not be switched on; raised at model build so the server stops."""


@dataclass(frozen=True)
class DumpConfig:
    """Where and what the dump writes."""

    dump_dir: Path  # created mode 0700 if missing
    tp_rank: int  # this process's tensor-parallel rank; only rank 0 writes
    rid_prefix: str = DEFAULT_RID_PREFIX  # only rids starting with it are dumped ("" = all)


@dataclass(frozen=True)
class RequestRows:
    """Where one request's rows sit in a forward pass."""

    rid: str
    start: int  # first row in the pass (extend_start_loc)
    num_rows: int  # rows of this chunk (extend_seq_lens_cpu)
    prefix_len: int  # tokens of the prompt before this chunk (extend_prefix_lens_cpu)


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
        logger.info("eagle3 dump: %s capturing layers %s of %d, writing to %s (rid prefix %r)",
                    type(model).__name__, capture_layers, model.config.num_hidden_layers,
                    config.dump_dir, config.rid_prefix)
    return capture_layers


# ---------------------------------------------------------------------------------------------
# Configuration and files


def config_from_env(environ: Mapping[str, str], tp_rank: int) -> DumpConfig:
    """The dump configuration named by the environment; raises `DumpError` if the dir is unset."""
    dump_dir = environ.get(ENV_DUMP_DIR, "")
    if not dump_dir:
        raise DumpError(f"{ENV_DUMP_DIR} is not set; set it to the dump directory")
    prefix = environ.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
    return DumpConfig(dump_dir=Path(dump_dir), tp_rank=tp_rank, rid_prefix=prefix)


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


def dump_file_path(dump_dir: Path, rid: str) -> Path:
    """The dump file of request `rid`: `<dump_dir>/<rid>.pt`, rid percent-encoded.

    Characters other than letters, digits and `-_.` become `%XX`; a name longer than 200
    characters keeps its first 100 and gains a hash of the whole rid.
    """
    if not rid:
        raise DumpError("empty rid: send requests with a non-empty rid")
    name = urllib.parse.quote(rid, safe="-_.")
    if len(name) > _MAX_NAME_CHARS:
        digest = hashlib.sha256(rid.encode()).hexdigest()[:16]
        name = f"{name[:100]}-{digest}"
    return dump_dir / f"{name}.pt"


def load_dump(source: Path | Any, name: str | Path | None = None) -> dict:
    """Load a dump file (format version 2) safely; `source` is a path or an open binary file
    (`name`: its path, for the messages). Raises `OldDumpError` for an older version,
    `DumpError` for anything else than a dump."""
    data = torch.load(source, map_location="cpu", weights_only=True)
    name = name or source
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        raise DumpError(f"{name}: not an {DUMP_FORMAT} file")
    if data.get("version") != DUMP_VERSION:
        version = data.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version < DUMP_VERSION:
            raise OldDumpError(
                f"{name}: an {DUMP_FORMAT} v{version} file, this module reads v{DUMP_VERSION} "
                "(v2 adds the input_ids that prove which request a dump belongs to): the server "
                "runs an older eagle3/extract/sglang_dump.py. Restart the dump server")
        raise DumpError(f"{name}: an {DUMP_FORMAT} file of version {version!r}, not "
                        f"v{DUMP_VERSION}")
    return data


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Forward passes


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


def _cpu_rows(states: torch.Tensor, start: int, num_rows: int,
              dtype: torch.dtype = DUMP_DTYPE) -> torch.Tensor:
    # copy=True: a slice shares its storage, and torch.save would write the whole buffer.
    return states[start:start + num_rows].to("cpu", dtype, copy=True)


def _append_to_previous(path: Path, req: RequestRows, ids_T: torch.Tensor, aux_TK: torch.Tensor,
                        final_TH: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows of tokens [0, prefix + n): the file's rows (and ids) followed by this chunk's."""
    previous = load_dump(path) if path.exists() else None
    if previous is None or previous["rid"] != req.rid or previous["num_tokens"] != req.prefix_len:
        held = None if previous is None else previous["num_tokens"]
        path.unlink(missing_ok=True)
        raise DumpError(
            f"rid {req.rid}: chunk starts at token {req.prefix_len} but the dump holds {held} "
            "tokens; dropped. A radix-cache hit or a chunk run in a MIXED pass: start the server "
            "with --disable-radix-cache and without --enable-mixed-chunk"
        )
    return (torch.cat([previous["input_ids"], ids_T]),
            torch.cat([previous["aux_hidden_states"], aux_TK]),
            torch.cat([previous["final_hidden_states"], final_TH]))


def write_request(config: DumpConfig, req: RequestRows, ids_T: torch.Tensor,
                  aux_TK: torch.Tensor, final_TH: torch.Tensor,
                  capture_layers: Sequence[int]) -> Path:
    """Write (or extend, for a later chunk) the dump file of one request; returns its path.
    `ids_T`: the chunk's token ids (int64), `aux_TK`, `final_TH`: its states."""
    path = dump_file_path(config.dump_dir, req.rid)
    if req.prefix_len > 0:
        ids_T, aux_TK, final_TH = _append_to_previous(path, req, ids_T, aux_TK, final_TH)
    record = {
        "format": DUMP_FORMAT, "version": DUMP_VERSION,
        "rid": req.rid, "num_tokens": int(final_TH.shape[0]), "input_ids": ids_T,
        "capture_layers": [int(layer) for layer in capture_layers],
        "aux_hidden_states": aux_TK, "final_hidden_states": final_TH,
    }
    _atomic_save(record, path)
    return path


def dump_forward_pass(config: DumpConfig, forward_batch: Any, hidden_states: torch.Tensor,
                      aux_hidden_states: Any, capture_layers: Sequence[int]) -> list[Path]:
    """Dump every request of one forward pass; returns the files written.

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
    num_real = sum(_as_int_list(forward_batch.extend_seq_lens_cpu))  # rows past it are padding
    aux_width = hidden_states.shape[-1] * len(capture_layers)
    if min(hidden_states.shape[0], aux.shape[0]) < num_real or aux.shape[-1] != aux_width:
        raise DumpError(
            f"states do not fit the batch: final {tuple(hidden_states.shape)}, aux "
            f"{tuple(aux.shape)}, {num_real} tokens, {len(capture_layers)} captures (scattered "
            "rows under attention DP or sequence parallelism are not supported)"
        )
    # The pass's token ids, row for row with the states: each dump's identity.
    input_ids = getattr(forward_batch, "input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or \
            input_ids.shape[0] < num_real:
        raise DumpError(f"EXTEND pass whose input_ids ({getattr(input_ids, 'shape', input_ids)})"
                        f" do not cover its {num_real} tokens")
    written = []
    for req in requests:
        try:
            if req.start < 0 or req.start + req.num_rows > num_real:
                raise DumpError(f"rid {req.rid}: rows {req.start}+{req.num_rows} outside the "
                                f"{num_real} tokens of the pass")
            ids_T = _cpu_rows(input_ids, req.start, req.num_rows, torch.int64)
            aux_TK = _cpu_rows(aux, req.start, req.num_rows)
            final_TH = _cpu_rows(hidden_states, req.start, req.num_rows)
            written.append(write_request(config, req, ids_T, aux_TK, final_TH, capture_layers))
        except Exception as exc:  # a full disk or a bad chunk costs this request, not the server
            logger.exception("eagle3 dump: skipped rid %s: %s", req.rid, exc)
    return written


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@torch.compiler.disable  # never traced: it must run on every pass, outside any compiled graph
def maybe_dump(model: Any, forward_batch: Any, hidden_states: torch.Tensor,
               aux_hidden_states: Any) -> None:
    """The forward hook: dump this pass if it is an EXTEND pass on TP rank 0. Never raises."""
    try:
        if not is_plain_extend(forward_batch):
            return
        config = server_config()
        if config.tp_rank != 0:
            return
        capture_layers = list(model.model.layers_to_capture)
        dump_forward_pass(config, forward_batch, hidden_states, aux_hidden_states, capture_layers)
    except DumpError as exc:
        _warn_once(f"eagle3 dump: pass skipped: {exc}")
    except Exception:  # the dump must never take the server down
        logger.exception("eagle3 dump: pass skipped")
