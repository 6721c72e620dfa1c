"""One record's trip through the dump server, client side: its request id, the checks of the
answer and of the dump file, and the conversion of the dump into the record's file (the rules
are in eagle3/extract/sglang.py's docstring; the dump format in eagle3/extract/sglang_dump.py).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.extract import sglang_dump
from eagle3.extract.checks import pack_checked
from eagle3.extract.writer import ExtractError, check_disk, record_meta

DUMP_BYTES_PER_TOKEN = 8  # x H: aux [T, 3H] + final [T, H], bf16


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


def check_answer(answer: dict, rid: str, num_tokens: int) -> None:
    """The /generate answer of a dump request: whole prompt computed, nothing cached."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise SampleError(f"bad answer: no meta_info in {str(answer)[:300]}")
    if meta.get("cached_tokens", 0):
        raise ExtractError(f"request {rid}: the server reused {meta['cached_tokens']} cached "
                           "tokens, whose states are not recomputed and so not dumped. Restart "
                           "the dump server with --disable-radix-cache")
    if meta.get("prompt_tokens") != num_tokens:
        raise SampleError(f"prompt_tokens: the server saw {meta.get('prompt_tokens')} prompt "
                          f"tokens, the record has {num_tokens} (truncated by the server?)")


DUMP_KEYS = ("rid", "num_tokens", "capture_layers", "aux_hidden_states", "final_hidden_states")


def check_dump(dump: dict, rid: str, num_tokens: int, expected: Expected, path: Path) -> None:
    """A dump file's contract; wrong widths or layers are fatal, a short dump is not."""
    missing = [k for k in DUMP_KEYS if k not in dump]
    if missing:
        raise SampleError(f"unreadable dump: {path} has no {missing}")
    aux, final = dump["aux_hidden_states"], dump["final_hidden_states"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (aux, final)):
        raise SampleError(f"short dump: {path} holds aux {getattr(aux, 'shape', aux)!r} and "
                          f"final {getattr(final, 'shape', final)!r}, expected two [T, width] "
                          "tensors")
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
    if dump["num_tokens"] != num_tokens or num_tokens != aux.shape[0] or \
            num_tokens != final.shape[0]:
        raise SampleError(f"short dump: {path} holds {dump['num_tokens']} tokens "
                          f"({aux.shape[0]}/{final.shape[0]} rows), the record {num_tokens}")


def convert_dump(path: Path, rid: str, rec: dict, expected: Expected, dtype: str,
                 save: Callable[[dict], hs.SavedFile], teacher=None) -> hs.SavedFile:
    """Load and check a dump, write the record's file through `save` (SplitWriter.save of the
    record), delete the dump; returns what was written. Raises SampleError for a dump to
    request again, checks.BadStates for finite-less states (the record is skipped)."""
    try:
        dump = sglang_dump.load_dump(path)
    except Exception as e:  # a torn zip, a wrong pickle, a vanished file: all per-sample
        raise SampleError(f"unreadable dump: {path}: {e!r}"[:500]) from e
    check_dump(dump, rid, len(rec["input_ids"]), expected, path)
    H = expected.hidden_size
    aux = list(dump["aux_hidden_states"].split(H, dim=-1))
    data = pack_checked(rec, aux, dump["final_hidden_states"],
                        record_meta(rec, list(expected.capture_layers)), dtype, teacher)
    saved = save(data)
    path.unlink(missing_ok=True)
    return saved


def clean_dump_dir(dump_dir: Path, rid_prefix: str) -> int:
    """Delete dump files left by an earlier (killed) client; returns how many."""
    name_prefix = urllib.parse.quote(rid_prefix, safe="-_.")
    stale = [p for p in dump_dir.glob("*.pt") if p.name.startswith(name_prefix)]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def check_dump_dir(dump_dir: Path, pending_lengths: list[int], hidden_size: int,
                   in_flight: int) -> None:
    """The dump directory exists (the server made it) and holds the dumps in flight."""
    if not dump_dir.is_dir():
        raise ExtractError(
            f"dump directory {dump_dir} does not exist: start the patched server with "
            f"EAGLE3_DUMP_DIR={dump_dir} on this machine (it creates the directory at start) "
            "and pass the same path to --dump-dir")
    longest = sorted(pending_lengths, reverse=True)[:in_flight]
    need = sum(longest) * DUMP_BYTES_PER_TOKEN * hidden_size
    check_disk(dump_dir, need, 0.2,
               f"{len(longest)} dumps in flight, the longest records, {sum(longest):,} tokens x "
               f"{DUMP_BYTES_PER_TOKEN * hidden_size:,} B",
               "Lower --concurrency or put EAGLE3_DUMP_DIR on a larger file system")
