"""One record's trip through the dump server, client side: its request id, the checks of the
answer and of the dump file, and the conversion of the dump into the record's file (the rules
are in eagle3/extract/sglang.py's docstring; the dump format, version 3, in
eagle3/extract/dump_file.py).

A dump comes in one of two layouts (the server's `EAGLE3_DUMP_LAYOUT`): `bf16` aux states, which
every `--dtype` is made from, or `fp8` aux states quantized by the server with the quantizer
02b itself uses (eagle3/core/fp8.py), which the fp8 layouts (`--dtype fp8`, `fp8-all`,
`fp8-topk`) store as they are: the same file bytes as from a bf16 dump. An fp8 dump cannot give
`--dtype bf16` back: that stops the run, naming the variable and the flag.
"""

from __future__ import annotations

import logging
import os
import stat
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.fp8 import Fp8Rows
from eagle3.extract import sglang_dump
from eagle3.extract.checks import pack_checked
from eagle3.extract.writer import ExtractError, check_disk, record_meta

log = logging.getLogger(__name__)

# A dump's safetensors header, whatever its length: 4 tensors and their metadata (under 2 KB;
# the reader refuses more than HEADER_MAX_BYTES), plus the 8 bytes saying its length.
DUMP_OVERHEAD_BYTES = sglang_dump.HEADER_MAX_BYTES + 8


class SampleError(Exception):
    """One record's attempt failed; str() is the reason, `kind: detail`."""


@dataclass(frozen=True)
class Expected:
    """What every dump must look like (from the target's config.json)."""

    hidden_size: int
    capture_layers: tuple[int, ...]
    target: Path


def make_rid(prefix: str, record_id: str, attempt: int) -> str:
    """The request id of a record's attempt: injective, file-system safe, readable."""
    rid = prefix + urllib.parse.quote(record_id, safe="-_.")
    return rid if attempt == 0 else f"{rid}+retry{attempt}"  # '+' is encoded in ids


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_answer(answer: dict, rid: str, num_tokens: int) -> None:
    """The /generate answer of a dump request: its own rid, whole prompt computed, nothing
    cached."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise SampleError(f"bad answer: no meta_info in {str(answer)[:300]}")
    if meta.get("id") not in (None, rid):
        raise SampleError(f"bad answer: meta_info.id is {str(meta['id'])[:200]!r}, the request "
                          f"was {rid!r} (the answer of another request)")
    cached = meta.get("cached_tokens")
    if cached is not None and (not _is_int(cached) or cached < 0):
        raise SampleError(f"bad answer: cached_tokens is {str(cached)[:100]!r}, not a count")
    if cached:
        raise ExtractError(f"request {rid}: the server reused {cached} cached "
                           "tokens, whose states are not recomputed and so not dumped. Restart "
                           "the dump server with --disable-radix-cache")
    prompt = meta.get("prompt_tokens")
    if not _is_int(prompt) or prompt != num_tokens:
        raise SampleError(f"prompt_tokens: the server saw {str(prompt)[:100]} prompt "
                          f"tokens, the record has {num_tokens} (truncated by the server?)")


def max_dump_bytes(num_tokens: int, expected: Expected) -> int:
    """The most bytes a dump of `num_tokens` tokens can hold: the bf16 layout (int64 ids, bf16
    states; the fp8 layout holds fewer) and its header."""
    per_token = 2 * (len(expected.capture_layers) + 1) * expected.hidden_size + 8
    return num_tokens * per_token + DUMP_OVERHEAD_BYTES


def read_dump(path: Path, num_tokens: int, expected: Expected) -> dict:
    """Load the dump at `path` as the dump of a `num_tokens`-token prompt: only a regular file
    (a directory or a pipe is refused; opened without blocking, so a FIFO never hangs the
    client) no larger than such a dump can be (a tensor viewing a larger storage makes
    a writer may pad: the client never loads more than a dump holds).
    SampleError for a file to request again; ExtractError for a dump of an older format (the
    server runs an older dump module: every dump would be)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise SampleError(f"missing dump: {path} vanished before it was read") from e
    except OSError as e:
        raise SampleError(f"bad dump: {path} cannot be opened ({e.strerror})") from e
    st = os.fstat(fd)
    limit = max_dump_bytes(num_tokens, expected)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        if stat.S_ISREG(st.st_mode):
            raise SampleError(f"bad dump: {path} has {st.st_size:,} bytes, more than a dump of "
                              f"{num_tokens} tokens can ({limit:,}); not read")
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise SampleError(f"bad dump: {path} is {kind}; the dump module writes regular files")
    with os.fdopen(fd, "rb") as f:
        try:
            return sglang_dump.load_dump(f, path)
        except sglang_dump.OldDumpError as e:
            raise ExtractError(f"{e}, then re-run this command (the stage resumes)") from None
        except Exception as e:  # a torn file, a bad header, not a dump: all per-sample
            raise SampleError(f"unreadable dump: {path}: {e!r}"[:500]) from e


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return f"a {type(value).__name__}"


def _check_fields(dump: dict, path: Path) -> None:
    """The keys and the types of a dump's fields (format version 3: sglang_dump.DUMP_KEYS and
    what its layout adds, LAYOUT_KEYS)."""
    layout = dump.get("layout")
    if layout not in sglang_dump.LAYOUTS:
        raise SampleError(f"bad dump: {path} has layout {str(layout)[:50]!r}, not one of "
                          f"{list(sglang_dump.LAYOUTS)}")
    keys = (*sglang_dump.DUMP_KEYS, *sglang_dump.LAYOUT_KEYS[layout])
    missing = [k for k in keys if k not in dump]
    if missing:
        raise SampleError(f"unreadable dump: {path} has no {missing}")
    extra = sorted(str(k) for k in dump if k not in keys)
    if extra:
        raise SampleError(f"bad dump: {path} has keys {extra[:5]} outside the dump format "
                          f"({layout} layout: {list(keys)})")
    layers = dump["capture_layers"]
    if not isinstance(dump["rid"], str) or not _is_int(dump["num_tokens"]) or \
            not isinstance(layers, list) or not all(_is_int(x) for x in layers):
        raise SampleError(f"bad dump: {path}: rid {_shape(dump['rid'])}, num_tokens "
                          f"{_shape(dump['num_tokens'])}, capture_layers {_shape(layers)}: "
                          "expected a str, an int and a list of ints")
    aux, final, ids = dump["aux_hidden_states"], dump["final_hidden_states"], dump["input_ids"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (aux, final)):
        raise SampleError(f"short dump: {path} holds aux {_shape(aux)} and final "
                          f"{_shape(final)}, expected two [T, width] tensors")
    aux_dtype = torch.float8_e4m3fn if layout == "fp8" else sglang_dump.DUMP_DTYPE
    if aux.dtype != aux_dtype or final.dtype != sglang_dump.DUMP_DTYPE:
        raise SampleError(f"bad dump: {path} holds aux {aux.dtype} and final {final.dtype} "
                          f"states; the {layout} layout stores aux {aux_dtype} and final "
                          f"{sglang_dump.DUMP_DTYPE}, the dtype the target computes in")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        raise SampleError(f"bad dump: {path} holds input_ids {_shape(ids)}, expected int64 [T]")
    scale = dump.get("aux_hidden_states_scale")
    if layout == "fp8" and (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                            or scale.dim() != 2):
        raise SampleError(f"bad dump: {path} holds aux_hidden_states_scale {_shape(scale)}, "
                          "expected float32 [T, K]")


def check_dump(dump: dict, rid: str, input_ids: list[int], expected: Expected,
               path: Path) -> None:
    """A dump file's contract; wrong widths or layers are fatal, a short dump or one of
    other tokens is not (requested again)."""
    num_tokens = len(input_ids)
    _check_fields(dump, path)
    aux, final = dump["aux_hidden_states"], dump["final_hidden_states"]
    H, K = expected.hidden_size, len(expected.capture_layers)
    if aux.shape[-1] != K * H or final.shape[-1] != H:
        hint = (" (one capture: the server captures no aux layers, or another target)"
                if aux.shape[-1] == H else "")
        raise ExtractError(
            f"{path}: aux states are {aux.shape[-1]} wide and the final state {final.shape[-1]}, "
            f"but {expected.target}/config.json has hidden_size {H}, so {K} captures must be "
            f"{K} x {H} = {K * H} wide{hint}. The server and --target must be the same model")
    if list(dump["capture_layers"]) != list(expected.capture_layers):
        raise ExtractError(f"{path}: the server captured layers {dump['capture_layers']}, "
                           f"expected {list(expected.capture_layers)}; re-apply the patch "
                           "(python -m eagle3.extract.patching) and pass matching --capture-layers")
    if dump["rid"] != rid:
        raise SampleError(f"wrong dump: {path} holds rid {dump['rid']!r}, expected {rid!r}")
    ids = dump["input_ids"]
    scale = dump.get("aux_hidden_states_scale")
    scale_shape = None if scale is None else tuple(scale.shape)
    if dump["num_tokens"] != num_tokens or num_tokens != aux.shape[0] or \
            num_tokens != final.shape[0] or num_tokens != ids.shape[0] or \
            scale_shape not in (None, (num_tokens, K)):
        scales = "" if scale is None else f", scales {list(scale.shape)}"
        raise SampleError(f"short dump: {path} holds {dump['num_tokens']} tokens "
                          f"({aux.shape[0]}/{final.shape[0]} rows, {ids.shape[0]} ids{scales}), "
                          f"the record {num_tokens}")
    differ = (ids != torch.as_tensor(input_ids, dtype=torch.int64)).nonzero()
    if len(differ):
        raise SampleError(f"wrong dump: {path} holds the states of other tokens than the prompt "
                          f"sent as {rid!r} ({len(differ)} of {num_tokens} ids differ, the first "
                          f"at token {int(differ[0])}): the server computed another request")


def convert_dump(path: Path, rid: str, rec: dict, expected: Expected, dtype: str,
                 save: Callable[[dict], hs.SavedFile], teacher=None) -> hs.SavedFile:
    """Load and check a dump, write the record's file through `save` (SplitWriter.save of the
    record), delete the dump; returns what was written. Raises SampleError for a dump to
    request again, checks.BadStates for finite-less states (the record is skipped)."""
    dump = read_dump(path, len(rec["input_ids"]), expected)
    check_dump(dump, rid, rec["input_ids"], expected, path)
    H = expected.hidden_size
    aux = list(dump["aux_hidden_states"].split(H, dim=-1))
    if dump["layout"] == "fp8":
        if dtype == "bf16":
            raise ExtractError(
                f"{path}: the dump server writes fp8 aux states ({sglang_dump.ENV_LAYOUT}=fp8), "
                "but --dtype bf16 stores bf16 ones, which an fp8 dump cannot give back. Restart "
                f"the server without {sglang_dump.ENV_LAYOUT} (or ={sglang_dump.LAYOUTS[0]}), or "
                "pass --dtype fp8, fp8-all or fp8-topk")
        scale = dump["aux_hidden_states_scale"]
        aux = [Fp8Rows(values, scale[:, k]) for k, values in enumerate(aux)]
    data = pack_checked(rec, aux, dump["final_hidden_states"],
                        record_meta(rec, list(expected.capture_layers)), dtype, teacher)
    saved = save(data)
    remove_dump(path)
    return saved


def remove_dump(path: Path) -> None:
    """Remove a dump (or what sits at its name: a symlink, an empty directory); a non-empty
    directory is left, with a warning (the rid is not asked again: retries get new rids)."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        try:
            path.rmdir()
        except OSError as e:
            log.warning("%s is a directory that cannot be removed (%s); it is not a dump",
                        path, e.strerror)


def dump_files(dump_dir: Path, rid_prefix: str) -> list[Path]:
    """The entries of the dump directory named like dumps of `rid_prefix`'s requests (format 3,
    and the `.pt` of older servers); never a dot name (a writer's temp or stats file)."""
    name_prefix = urllib.parse.quote(rid_prefix, safe="-_.")
    suffixes = (sglang_dump.SUFFIX, sglang_dump.LEGACY_SUFFIX)
    return sorted(p for p in dump_dir.iterdir() if p.name.endswith(suffixes)
                  and p.name.startswith(name_prefix) and not p.name.startswith("."))


def clean_dump_dir(dump_dir: Path, rid_prefix: str) -> int:
    """Delete dump files left by an earlier (killed) client; returns how many."""
    stale = dump_files(dump_dir, rid_prefix)
    for p in stale:
        remove_dump(p)
    return len(stale)


def check_dump_dir(dump_dir: Path, pending_lengths: list[int], expected: Expected,
                   in_flight: int) -> None:
    """The dump directory exists (the server made it) and holds the dumps in flight."""
    if not dump_dir.is_dir():
        raise ExtractError(
            f"dump directory {dump_dir} does not exist: start the patched server with "
            f"EAGLE3_DUMP_DIR={dump_dir} on this machine (it creates the directory at start) "
            "and pass the same path to --dump-dir")
    longest = sorted(pending_lengths, reverse=True)[:in_flight]
    need = sum(max_dump_bytes(n, expected) for n in longest)
    check_disk(dump_dir, need, 0.2,
               f"{len(longest)} dumps in flight, the longest records, {sum(longest):,} tokens "
               f"at up to {max_dump_bytes(1, expected) - DUMP_OVERHEAD_BYTES:,} B",
               "Lower --concurrency or put EAGLE3_DUMP_DIR on a larger file system")
