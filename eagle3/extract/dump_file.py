"""The SGLang dump file, format version 3: what the dump hook writes and 02b's client reads.

Pure torch (the safetensors package is not needed: files are written and read here), importing
nothing from eagle3: the dump hook (`eagle3/extract/sglang_dump.py`) runs inside SGLang and
loads this file by path.

One file per request: `dump_file_path(dump_dir, rid)`, that is `<dump_dir>/<rid>.safetensors`
(rid percent-encoded; a leading `.` too, so that no dump name starts with a dot). A safetensors
file: an 8-byte little-endian header length, a JSON header (at most HEADER_MAX_BYTES), then the
raw bytes of the tensors; no pickle. Tensors:

    input_ids                int64 [T]          the token ids the server computed for this rid
                                                (the dump's identity: 02b compares them with
                                                the prompt it sent)
    aux_hidden_states        bf16 [T, K*H]      the K captures side by side, in capture order:
                                                columns k*H:(k+1)*H hold capture_layers[k];
                                                float8_e4m3fn in the fp8 layout
    aux_hidden_states_scale  float32 [T, K]     fp8 layout only: capture k of token t is
                                                fp8[t, k*H:(k+1)*H].float() * scale[t, k]
                                                (eagle3/core/fp8.py, per-token scale)
    final_hidden_states      bf16 [T, H]        after the final norm: what the lm_head sees

and the header's string metadata: `format` "eagle3-sglang-dump", `version` "3", `rid`,
`num_tokens` (decimal), `capture_layers` (a JSON list of SGLang capture indices, e.g.
[2, 30, 58]) and `layout` ("bf16" or "fp8"). `load_dump` returns one dict of the metadata (version
and num_tokens as ints, capture_layers a list) and the tensors by name: DUMP_KEYS, plus
LAYOUT_KEYS[layout].

Written by `save_dump` (`write_safetensors`: the bytes `safetensors.torch.save_file` writes, its
metadata in key order, straight from the tensors' memory with the GIL released): to a temp file
in the dump directory, `.<name>.<pid>.tmp` (a dot name, not ending in `.safetensors`: never
taken for a dump), then renamed over the dump's name, so a reader sees a whole file or none. A
writer killed mid-file leaves only its temp file, which `remove_stale_temp_files` deletes once
its process is gone.

Versions 1 and 2 were `torch.save` zips at `<rid>.pt` (`legacy_dump_path`); `load_dump` refuses
them with `OldDumpError` (a server running an older copy of the dump module: restart it).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import torch

DUMP_FORMAT = "eagle3-sglang-dump"
DUMP_VERSION = 3
DUMP_DTYPE = torch.bfloat16  # of the final state, and of the aux states in the bf16 layout
LAYOUTS = ("bf16", "fp8")  # EAGLE3_DUMP_LAYOUT
# Every key of a version-3 dump as load_dump returns it, and what each layout adds (a client
# refuses other keys).
DUMP_KEYS = ("format", "version", "rid", "num_tokens", "capture_layers", "layout", "input_ids",
             "aux_hidden_states", "final_hidden_states")
LAYOUT_KEYS = {"bf16": (), "fp8": ("aux_hidden_states_scale",)}
HEADER_MAX_BYTES = 64 << 10  # of the JSON header (a dump's is under 2 KB)
SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # versions 1 and 2
_MAX_NAME_CHARS = 200  # longer file names are shortened with a hash (file systems allow 255)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's container: a dump of version 1 or 2
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn}


class DumpError(RuntimeError):
    """A forward pass, request or file that is not a dump; logged and skipped by the hook."""


class OldDumpError(DumpError):
    """A dump of an older format version: the server runs an older copy of the dump module."""


# ---------------------------------------------------------------------------------------------
# Names


def _name(rid: str) -> str:
    if not rid:
        raise DumpError("empty rid: send requests with a non-empty rid")
    name = urllib.parse.quote(rid, safe="-_.")
    if name.startswith("."):  # dot names are the writer's temp and stats files
        name = "%2E" + name[1:]
    if len(name) > _MAX_NAME_CHARS:
        digest = hashlib.sha256(rid.encode()).hexdigest()[:16]
        name = f"{name[:100]}-{digest}"
    return name


def dump_file_path(dump_dir: Path, rid: str) -> Path:
    """The dump file of request `rid`: `<dump_dir>/<rid>.safetensors`, rid percent-encoded.

    Characters other than letters, digits and `-_.` (and a leading `.`) become `%XX`; a name
    longer than 200 characters keeps its first 100 and gains a hash of the whole rid.
    """
    return Path(dump_dir) / f"{_name(rid)}{SUFFIX}"


def legacy_dump_path(dump_dir: Path, rid: str) -> Path:
    """Where a dump module of format version 1 or 2 writes the dump of `rid` (`<rid>.pt`)."""
    return Path(dump_dir) / f"{_name(rid)}{LEGACY_SUFFIX}"


def temp_path(path: Path) -> Path:
    """The temp file `save_dump` writes `path` through: `.<name>.<pid>.tmp`, same folder."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(dump_dir: Path) -> int:
    """Delete the temp files of dump writers that are gone (a killed server); returns how many.
    A temp file of a live process (a server still writing) is left alone."""
    removed = 0
    for path in Path(dump_dir).glob(".*.tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


# ---------------------------------------------------------------------------------------------
# Writing


def _metadata_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return json.dumps([int(v) for v in value])
    return str(int(value))


def save_dump(record: dict, path: Path) -> int:
    """Write one dump atomically (temp file, then rename over `path`); returns its bytes.

    `record`: the tensors by name (CPU; a tensor, or a list of parts to be joined along dim 0,
    as a later chunk's rows after the file's) and the metadata (`rid`, `num_tokens`,
    `capture_layers`, `layout`); `format` and `version` are added. The hook's writer and the
    tests' stand-in servers all write through here.
    """
    tensors = {k: list(v) if isinstance(v, (list, tuple)) else [v]
               for k, v in record.items() if _is_tensor_value(v)}
    metadata = {k: _metadata_text(v) for k, v in record.items()
                if not _is_tensor_value(v) and k not in ("format", "version")}
    metadata.update(format=DUMP_FORMAT, version=str(DUMP_VERSION))
    tmp = temp_path(path)
    try:
        write_safetensors(tensors, tmp, metadata)
        size = tmp.stat().st_size
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return size


def _is_tensor_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and bool(value)
        and all(isinstance(v, torch.Tensor) for v in value))


# The safetensors dtype names, in the order of the format's `Dtype` enum (increasing alignment):
# a file lists its tensors by that order descending, then by name (safetensors `prepare`).
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32",
                "U32", "F32", "F64", "I64", "U64")
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_WRITE_MAX = 1 << 30  # bytes a write() call is given (Linux moves at most ~2 GiB per call)


def write_safetensors(tensors: dict[str, list[torch.Tensor]], path: Path,
                      metadata: dict[str, str]) -> None:
    """Write a safetensors file laid out as `safetensors.torch.save_file` lays it out (tensors
    by dtype alignment then name, back to back; the header compact JSON, `__metadata__` first,
    padded with spaces to 8 bytes), each tensor given as parts joined along dim 0.

    Written from the tensors' own memory, a part at a time: no copy, no check across tensors
    (parts may be views of one buffer, which save_file refuses), and the GIL released for every
    byte (one unbuffered write() a part), so the server's scheduler thread runs meanwhile.
    The metadata goes in sorted by key (save_file's order is its hash map's, which varies).
    """
    if sys.byteorder != "little":
        raise DumpError("dump files are little-endian; this host is not")
    entries = []
    for name, parts in tensors.items():
        dtype, tail = parts[0].dtype, tuple(parts[0].shape[1:])
        if dtype not in _NAMES or parts[0].dim() == 0 or any(
                p.dtype != dtype or tuple(p.shape[1:]) != tail for p in parts):
            raise DumpError(f"tensor {name!r}: parts of one dtype in {sorted(_NAMES.values())} "
                            f"and one row shape expected, got "
                            f"{[(p.dtype, tuple(p.shape)) for p in parts]}")
        rows = sum(int(p.shape[0]) for p in parts)
        entries.append((-_DTYPE_ORDER.index(_NAMES[dtype]), name, dtype, [rows, *tail], parts))
    entries.sort(key=lambda e: e[:2])
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for _, name, dtype, shape, _ in entries:
        nbytes = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": _NAMES[dtype], "shape": shape,
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    # serde_json's output: no spaces, non-ASCII as UTF-8, control characters as \u00XX.
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(len(head).to_bytes(8, "little") + head))
        for *_, parts in entries:
            for part in parts:
                _write_all(f, _bytes_of(part))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _write_all(f, view: memoryview) -> None:
    while len(view):
        view = view[f.write(view[:_WRITE_MAX]):]


# ---------------------------------------------------------------------------------------------
# Reading


def load_dump(source: Path | Any, name: str | Path | None = None) -> dict:
    """Load a dump file (format version 3); `source` is a path or an open binary file (`name`:
    its path, for the messages). Raises `OldDumpError` for a dump of version 1 or 2,
    `DumpError` for anything else that is not a whole dump."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return _read(f, name or source)
    return _read(source, name or getattr(source, "name", "<dump>"))


def _read(f, name) -> dict:
    head = f.read(8)
    if head[:4] == _ZIP_MAGIC:
        _refuse_torch_file(head + f.read(), name)
    header = _read_header(f, head, name)
    record = _parse_metadata(header.pop("__metadata__", None), name)
    for key, tensor in _read_tensors(f, header, name).items():
        if key in record:
            raise DumpError(f"{name}: tensor {key!r} has the name of a metadata field")
        record[key] = tensor
    return record


def _refuse_torch_file(data: bytes, name) -> None:
    try:
        old = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # a torn zip or a pickle weights_only refuses
        raise DumpError(f"{name}: a zip that is not a dump ({e!r})"[:300]) from None
    version = old.get("version") if isinstance(old, dict) else None
    if (isinstance(old, dict) and old.get("format") == DUMP_FORMAT and isinstance(version, int)
            and not isinstance(version, bool) and version < DUMP_VERSION):
        raise OldDumpError(
            f"{name}: an {DUMP_FORMAT} v{version} file (torch.save), this module reads "
            f"v{DUMP_VERSION} (safetensors, <rid>{SUFFIX}): the server runs an older "
            "eagle3/extract/sglang_dump.py. Restart the dump server")
    raise DumpError(f"{name}: a torch.save file that is not an {DUMP_FORMAT} v{DUMP_VERSION} "
                    "file")


def _read_header(f, head: bytes, name) -> dict:
    if len(head) < 8:
        raise DumpError(f"{name}: {len(head)} bytes, shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > HEADER_MAX_BYTES:
        raise DumpError(f"{name}: header of {n:,} bytes announced, a dump's is under "
                        f"{HEADER_MAX_BYTES:,}: not a dump")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"{name}: unreadable header ({len(raw)} of {n} bytes): {e}") from None
    if not isinstance(header, dict):
        raise DumpError(f"{name}: the header is not a JSON object")
    return header


def _parse_metadata(meta, name) -> dict:
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise DumpError(f"{name}: no string metadata: not an {DUMP_FORMAT} file")
    if meta.get("format") != DUMP_FORMAT:
        raise DumpError(f"{name}: not an {DUMP_FORMAT} file")
    version = meta.get("version", "")
    if version != str(DUMP_VERSION):
        if version.isdigit() and int(version) < DUMP_VERSION:
            raise OldDumpError(f"{name}: an {DUMP_FORMAT} v{version} file, this module reads "
                               f"v{DUMP_VERSION}. Restart the dump server")
        raise DumpError(f"{name}: an {DUMP_FORMAT} file of version {version!r}, not "
                        f"v{DUMP_VERSION}")
    record: dict = dict(meta)
    record["version"] = DUMP_VERSION
    if "num_tokens" in meta:
        if not meta["num_tokens"].isdigit():
            raise DumpError(f"{name}: num_tokens {meta['num_tokens'][:50]!r} is not a count")
        record["num_tokens"] = int(meta["num_tokens"])
    if "capture_layers" in meta:
        try:
            record["capture_layers"] = json.loads(meta["capture_layers"])
        except json.JSONDecodeError:
            raise DumpError(f"{name}: capture_layers {meta['capture_layers'][:50]!r} is not "
                            "a JSON list") from None
    return record


def _read_tensors(f, header: dict, name) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors body: back to back from offset 0, nothing after them."""
    entries = []
    for key, info in header.items():
        spec = info if isinstance(info, dict) else {}
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if (dtype not in _DTYPES or not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise DumpError(f"{name}: tensor {key!r} has a bad header entry {str(info)[:200]}")
        entries.append((offsets[0], offsets[1], key, _DTYPES[dtype], shape))
    tensors, end = {}, 0
    for begin, stop, key, dtype, shape in sorted(entries, key=lambda e: e[:2]):
        numel = 1
        for d in shape:
            numel *= d
        if begin != end or stop - begin != numel * dtype.itemsize:
            raise DumpError(f"{name}: tensor {key!r} at bytes {begin}:{stop} does not follow "
                            f"the previous one (at {end}) or holds not {numel} x {dtype}")
        # Read into uninitialised tensor memory: a bytearray would be zeroed first, holding the
        # GIL (the writer thread reads a chunked prompt's file back to extend it).
        raw = torch.empty(stop - begin, dtype=torch.uint8, device="cpu")
        got = f.readinto(raw.numpy()) if len(raw) else 0
        if got != len(raw):
            raise DumpError(f"{name}: truncated: tensor {key!r} has {got} of {len(raw)} bytes")
        tensors[key] = raw.view(dtype).view(shape)
        end = stop
    if f.read(1):
        raise DumpError(f"{name}: bytes after the last tensor: not a dump as written")
    return tensors


def peek_num_tokens(path: Path) -> int | None:
    """The `num_tokens` a dump's header announces, read without the states (a writer extends a
    chunked prompt's dump chunk by chunk); None when `path` is missing, not a regular file or
    not a readable v3 header (opened without blocking: a FIFO never hangs the reader)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            head = f.read(8)
            if head[:4] == _ZIP_MAGIC:
                return None
            value = _parse_metadata(_read_header(f, head, path).get("__metadata__"), path)
    except DumpError:
        return None
    finally:
        os.close(fd)
    tokens = value.get("num_tokens")
    return tokens if isinstance(tokens, int) else None
