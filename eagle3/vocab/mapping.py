"""Draft vocabulary: the most frequent supervised target ids, as `d2t` / `t2d`.

`d2t[draft_id]` is the offset such that `target_id = draft_id + d2t[draft_id]`; `t2d[target_id]`
is True for the ids in the draft vocabulary. The draft vocabulary is the `draft_vocab` target ids
seen most often among `loss_mask == 1` tokens (ties broken by the lower id), sorted ascending,
padded with the lowest unused ids when fewer are seen. Counting streams the merged JSONL with a
`[target_vocab]` counter: memory is O(vocab), not O(data).

Origin of a record's supervised tokens: `target` when the target wrote them (01b regenerated
the reply: `finish_reason` "stop" or "length"), `dataset` when they are a dataset's own text
(`finish_reason` "dataset": recipes with `"regenerate": false`). A record the merge cut
(`finish_reason` "truncated") takes its dataset's origin from 01b's manifest. Serving proposes
the target's tokens, so the coverage that predicts acceptance is that of target-written tokens;
the report gives it apart, and warns when dataset-written text chose part of the vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from eagle3.core.faults import BadRecords, InputFileError
from eagle3.core.records import read_jsonl, tokenized_problem
from eagle3.core.stage import STAGE_DIRS, read_manifest
from eagle3.extract.checks import merged_line

MAPPING_FILE = "vocab_mapping.safetensors"  # 03's output, in 03_vocab/
ORIGINS = ("target", "dataset", "unknown")

COVERAGE_SIZES = (8192, 16384, 32768, 65536)


class VocabError(ValueError):
    """A vocabulary request that cannot be met; the message names the flag."""


def regenerated_datasets(workdir: Path) -> dict[str, bool]:
    """{dataset: regenerated} from `<workdir>/01b_generated/manifest.json` ({} without one)."""
    manifest = read_manifest(Path(workdir) / STAGE_DIRS["01b"])
    if manifest is None:
        return {}
    datasets = manifest.get("outputs", {}).get("datasets", {})
    return {name: bool(c.get("regenerate")) for name, c in datasets.items()}


def record_origin(rec: dict, regenerated: dict[str, bool]) -> str:
    """`target`, `dataset` or `unknown`: who wrote the record's supervised tokens."""
    reason = rec.get("finish_reason")
    if reason == "dataset":
        return "dataset"
    if reason in ("stop", "length"):
        return "target"
    if rec.get("source") in regenerated:
        return "target" if regenerated[rec["source"]] else "dataset"
    return "unknown"


def count_supervised(path: Path, target_vocab: int, bar=None,
                     chunk_tokens: int = 1 << 20) -> np.ndarray:
    """Occurrences of each target id among supervised tokens of a tokenized JSONL."""
    return count_supervised_by_origin(path, target_vocab, {}, bar, chunk_tokens).sum(0)


def count_supervised_by_origin(path: Path, target_vocab: int, regenerated: dict[str, bool],
                               bar=None, chunk_tokens: int = 1 << 20,
                               bad: BadRecords | None = None) -> np.ndarray:
    """`[len(ORIGINS), target_vocab]`: occurrences of each target id among supervised tokens,
    per origin (`record_origin`).

    Streams the file; supervised ids are buffered up to `chunk_tokens` and then counted with one
    `bincount`, so memory is O(target_vocab + chunk_tokens) whatever the file size. A bad line
    (torn, blank, not JSON or too deeply nested to parse, wrong types, no source, ids outside
    the target vocab, an id already on an earlier line) goes to `bad`, the stage's skip list,
    and counts nothing; without `bad` it raises VocabError (RecordError for bad JSON).
    """
    counts = np.zeros((len(ORIGINS), target_vocab), dtype=np.int64)
    pending: list[np.ndarray] = []
    buffered = 0
    for rec in _good_records(path, target_vocab, bad, bar):
        ids = np.asarray(rec["input_ids"], dtype=np.int64)
        mask = np.asarray(rec["loss_mask"], dtype=bool)
        # one id space per origin: id + origin * target_vocab
        pending.append(ids[mask] + ORIGINS.index(record_origin(rec, regenerated)) * target_vocab)
        buffered += pending[-1].size
        if buffered >= chunk_tokens:
            counts += _bincount(pending, counts.shape)
            pending, buffered = [], 0
    if pending:
        counts += _bincount(pending, counts.shape)
    return counts


def _good_records(path: Path, target_vocab: int, bad: BadRecords | None, bar):
    """The records of a merged JSONL that pass 02b's check of a merged line (`merged_line`:
    JSON, the record contract with its `source`, an id not on an earlier line); the others go
    to `bad` under their key (the id, `line N` when the line has none, `id@line N` for a
    repeated id), or raise when `bad` is None (then only `tokenized_problem` is checked)."""
    if bad is None:
        for rec in read_jsonl(path):
            if (problem := tokenized_problem(rec, target_vocab)) is not None:
                raise VocabError(f"record {rec.get('id') if isinstance(rec, dict) else None}: "
                                 f"{problem}")
            if bar is not None:
                bar.update(1)
            yield rec
        return
    first_line: dict[str, int] = {}
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):  # streams: merged files reach several GB
            if bar is not None:
                bar.update(1)
            if not raw.strip():  # damage: 01c writes none (as 01c's merge counts its inputs')
                key, rec, problem = f"line {n}", None, (
                    f"empty line: {len(raw)} bytes of blanks; 01c writes none, so the file "
                    "was damaged")
            else:
                key, rec, problem = merged_line(raw, n, target_vocab, first_line)
            if problem is None:
                yield rec
                continue
            bad.add(key, f"{problem} (line {n})", path)


def check_merged_count(path: Path, lines: int, upstream: dict | None, manifest: Path,
                       first_bad: str | None) -> None:
    """InputFileError unless the merged split holds the records the merge wrote (its
    manifest's `outputs.<split>`, when it has that count): a line added or removed since is
    damage no line check may see (a valid-looking record), and the file is not the merge's."""
    outputs = (upstream or {}).get("outputs") or {}
    want = outputs.get(Path(path).stem)
    if not (upstream or {}).get("complete") or type(want) is not int or want == lines:
        return
    raise InputFileError(path, f"{lines:,} lines, but the merge wrote {want:,} records "
                               f"({manifest}): the file changed after the merge"
                               + (f" (first bad line: {first_bad})" if first_bad else "")
                               + "; restore it or re-run the merge with --force")


def _bincount(pending: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    return np.bincount(np.concatenate(pending), minlength=shape[0] * shape[1]).reshape(shape)


def select_hot_ids(counts: np.ndarray, draft_vocab: int) -> np.ndarray:
    """The `draft_vocab` most frequent ids (ties: lower id first), padded, sorted ascending."""
    if draft_vocab > counts.size:
        raise VocabError(f"--draft-vocab {draft_vocab} exceeds the target vocab {counts.size}")
    order = np.lexsort((np.arange(counts.size), -counts))  # by count desc, then id asc
    seen = order[counts[order] > 0][:draft_vocab]
    if seen.size < draft_vocab:  # pad with the lowest ids not yet chosen
        unused = np.setdiff1d(np.arange(counts.size), seen)[: draft_vocab - seen.size]
        seen = np.concatenate([seen, unused])
    return np.sort(seen)


def build_mapping(hot_ids: np.ndarray, target_vocab: int) -> dict[str, torch.Tensor]:
    """`d2t` int64 [draft_vocab] and `t2d` bool [target_vocab] for sorted `hot_ids`."""
    hot = torch.as_tensor(hot_ids, dtype=torch.int64)
    d2t = hot - torch.arange(hot.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[hot] = True
    return {"d2t": d2t, "t2d": t2d}


def hot_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary: `arange + d2t` (what SGLang computes on load)."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t


def vocab_sha256(d2t: torch.Tensor) -> str:
    """Identity of a draft vocabulary, stored in files whose teacher ids are draft ids."""
    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def coverage(counts: np.ndarray, sizes=COVERAGE_SIZES) -> dict[int, float]:
    """Share of supervised tokens inside the top-k vocabulary, per size k."""
    total = max(int(counts.sum()), 1)
    ranked = np.sort(counts)[::-1]
    return {k: float(ranked[: min(k, ranked.size)].sum() / total) for k in sizes}


def origin_report(by_origin: np.ndarray, hot_ids: np.ndarray) -> tuple[dict, list[str]]:
    """({origin: {supervised_tokens, coverage}}, warnings) of per-origin counts."""
    out, warnings = {}, []
    for name, c in zip(ORIGINS, by_origin):
        n = int(c.sum())
        if n:
            out[name] = {"supervised_tokens": n, "coverage": float(c[hot_ids].sum() / n)}
    total = max(int(by_origin.sum()), 1)
    for name in ("dataset", "unknown"):
        if name in out:
            share = out[name]["supervised_tokens"] / total
            target = out.get("target", {}).get("coverage")
            warnings.append(
                f"{share:.0%} of the supervised tokens that chose the draft vocabulary are "
                + ("dataset-written (recipes with \"regenerate\": false): the target never wrote "
                   "them, so their coverage says nothing of what serving proposes"
                   if name == "dataset" else "of unknown origin (no 01b manifest names their "
                   "dataset)")
                + (f"; coverage of target-written tokens: {target:.4f}" if target is not None
                   else "; no target-written tokens: regenerate the data with the target"))
    return out, warnings


def report(counts: np.ndarray, hot_ids: np.ndarray, tokenizer=None, top: int = 50,
           by_origin: np.ndarray | None = None) -> dict:
    """Coverage at several sizes and at the chosen size (per origin when `by_origin` is
    given), plus the most frequent tokens."""
    total = int(counts.sum())
    chosen = float(counts[hot_ids].sum() / max(total, 1))
    order = np.lexsort((np.arange(counts.size), -counts))[:top]
    top_tokens = [
        {"id": int(i), "count": int(counts[i]),
         "token": tokenizer.convert_ids_to_tokens(int(i)) if tokenizer is not None else None}
        for i in order if counts[i] > 0
    ]
    return {
        "supervised_tokens": total,
        "distinct_ids_seen": int((counts > 0).sum()),
        "draft_vocab": int(hot_ids.size),
        "coverage": chosen,
        "coverage_at": {str(k): v for k, v in coverage(counts).items()},
        "top_tokens": top_tokens,
        **(dict(zip(("coverage_by_origin", "warnings"), origin_report(by_origin, hot_ids)))
           if by_origin is not None else {}),
    }
