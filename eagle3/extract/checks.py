"""Stage 02b's two gates: a merged record must be valid to be extracted, and its states must be
finite to be written. What fails either is skipped into the stage's skip list
(`eagle3.core.faults.BadRecords`, `02b_hidden_states/skipped.jsonl`), counted in the summary
and the manifest, and never written as good.

Input (`read_split`, over `merged_line`, which 03 runs too): each line of
`01c_merged/<split>.jsonl` must be a JSON object (that a parser can take) with a
non-empty string `id` (unique in the split), a `source`, `input_ids` a non-empty list of ints in
`[0, vocab_size)` and `loss_mask` a list of 0/1 of the same length (`seq_len`, when present,
equal to it). A bad line keeps its index (its slot is None), so that every other record keeps
the file name `data_<idx>.pt` it would have with the line fixed.

States (`pack_checked`): the aux captures and the final state of a record (and the stored teacher
of `--dtype fp8-topk`) must be finite: a bf16 overflow in the target gives NaN or Inf, which
would poison training. The skip reason names the record, the layer and the number of bad values.

Skip-list keys are `<split>:<record id>` (a record id may repeat across splits); a line without
a usable id is `<split>:line <n>`, a repeated id `<split>:<id>@line <n>` (n counts from 1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.faults import BadRecords
from eagle3.core.fp8 import Fp8Rows
from eagle3.core.records import tokenized_problem

log = logging.getLogger(__name__)


class BadStates(Exception):
    """A record's states (or teacher) hold NaN or Inf; str() is the skip reason."""


def skip_key(split: str, record_id: str) -> str:
    """The skip-list key of a record of `split`."""
    return f"{split}:{record_id}"


def record_problem(rec, vocab_size: int) -> str | None:
    """Why a parsed merged line cannot be extracted (`kind: detail`), None when it can."""
    if isinstance(rec, dict) and "source" not in rec:
        return "bad record: no source"
    return tokenized_problem(rec, vocab_size)


def merged_line(raw: bytes, n: int, vocab_size: int,
                first_line: dict[str, int]) -> tuple[str, object, str | None]:
    """(key, parsed line, problem or None) of line `n` (from 1) of a merged split: the one check
    of a merged line, run by 02b and 03 alike. The problem (`kind: detail`) is bad JSON (a
    `torn line` when it is the last and has no newline; nesting too deep to parse), a line that
    is not a record (`record_problem`), or an id already on an earlier line (`first_line`:
    id -> line, filled in with each good line). The key is the record's id, `line <n>` when it
    has none, `<id>@line <n>` for a repeated one."""
    key, rec = f"line {n}", None
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        kind = "torn line" if not raw.endswith(b"\n") else "bad json"
        detail = "nested too deep to parse" if isinstance(e, RecursionError) else e
        return key, None, f"{kind}: {detail}"
    problem = record_problem(rec, vocab_size)
    if isinstance(rec, dict) and isinstance(rec.get("id"), str) and rec["id"]:
        key = rec["id"]
    if problem is None and key in first_line:
        return (f"{key}@line {n}", rec,
                f"duplicate id: {key!r} is on lines {first_line[key]} and {n}")
    if problem is None:
        first_line[key] = n
    return key, rec, problem


def read_split(path: Path, split: str, vocab_size: int, bad: BadRecords) -> list[dict | None]:
    """The records of a merged split file, one slot per non-blank line; a line that cannot be
    extracted is None and listed in `bad` (which raises TooManyBad past its budget)."""
    records: list[dict | None] = []
    first_line: dict[str, int] = {}
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):  # streams: merged files reach several GB
            if not raw.strip():
                continue
            key, rec, problem = merged_line(raw, n, vocab_size, first_line)
            if problem is not None:
                kind, detail = problem.split(": ", 1)
                bad.add(skip_key(split, key), f"{kind}: {path} line {n}: {detail}", file=path)
                records.append(None)
                continue
            records.append(rec)
    return records


def _nonfinite(t: torch.Tensor) -> int:
    """Number of NaN / Inf values of `t`. The fast path is one min/max pass (NaN propagates
    through both, an Inf is the max or the min): 0.15 s/GB of bf16 on one CPU core, against
    2.1 s/GB for `isfinite(t).all()`, which only runs to count a bad record's values."""
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def pack_checked(rec: dict, aux: list[torch.Tensor | Fp8Rows], final: torch.Tensor, meta: dict,
                 dtype: str, teacher=None) -> dict:
    """`hs.pack` of a record whose states are finite; raises BadStates naming the record, the
    layer and the count of bad values otherwise. `aux` `[T, H]` x 3 (or already quantized, from
    an fp8 dump), `final` `[T, H]`."""
    T = len(rec["input_ids"])
    layers = meta["capture_layers"]
    names = [f"capture layer {layer}" for layer in layers] + ["final state"]
    for name, t in zip(names, [*aux, final]):
        if isinstance(t, Fp8Rows):
            # A row holding NaN or Inf has a NaN or Inf scale (max |x| propagates both): the
            # bad tokens are counted, their values are gone in e4m3.
            assert t.scale_T.shape[0] == T, (rec["id"], name, tuple(t.scale_T.shape), T)
            if bad := _nonfinite(t.scale_T):
                raise BadStates(f"non-finite states: record {rec['id']}: {name} has NaN/Inf "
                                f"values in {bad:,} of {T:,} tokens (a bf16 overflow in the "
                                "target?)")
            continue
        # An internal invariant: the backends slice T rows (sglang checks the dump first).
        assert t.shape[0] == T, (rec["id"], name, tuple(t.shape), T)
        if bad := _nonfinite(t):
            raise BadStates(f"non-finite states: record {rec['id']}: {name} has {bad:,} NaN/Inf "
                            f"values of {t.numel():,} (a bf16 overflow in the target?)")
    data = hs.pack(rec["input_ids"], rec["loss_mask"], aux, final, meta, dtype, teacher)
    if "teacher_logprobs" in data and (bad := _nonfinite(data["teacher_logprobs"])):
        raise BadStates(f"non-finite states: record {rec['id']}: the teacher log-probs have "
                        f"{bad:,} NaN/Inf values")
    return data
