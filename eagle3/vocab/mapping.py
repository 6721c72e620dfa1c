"""Draft vocabulary: the most frequent supervised target ids, as `d2t` / `t2d`.

`d2t[draft_id]` is the offset such that `target_id = draft_id + d2t[draft_id]`; `t2d[target_id]`
is True for the ids in the draft vocabulary. The draft vocabulary is the `draft_vocab` target ids
seen most often among `loss_mask == 1` tokens (ties broken by the lower id), sorted ascending,
padded with the lowest unused ids when fewer are seen. Counting streams the merged JSONL with a
`[target_vocab]` counter: memory is O(vocab), not O(data).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from eagle3.core.records import read_jsonl

COVERAGE_SIZES = (8192, 16384, 32768, 65536)


class VocabError(ValueError):
    """A vocabulary request that cannot be met; the message names the flag."""


def count_supervised(path: Path, target_vocab: int, bar=None,
                     chunk_tokens: int = 1 << 20) -> np.ndarray:
    """Occurrences of each target id among supervised tokens of a tokenized JSONL.

    Streams the file; supervised ids are buffered up to `chunk_tokens` and then counted with one
    `bincount`, so memory is O(target_vocab + chunk_tokens) whatever the file size.
    """
    counts = np.zeros(target_vocab, dtype=np.int64)
    pending: list[np.ndarray] = []
    buffered = 0
    for rec in read_jsonl(path):
        ids = np.asarray(rec["input_ids"], dtype=np.int64)
        mask = np.asarray(rec["loss_mask"], dtype=bool)
        if ids.shape != mask.shape:
            raise VocabError(f"record {rec.get('id')}: {ids.size} input_ids but {mask.size} "
                             "loss_mask values: re-run the stage that wrote it")
        if ids.size and (ids.max() >= target_vocab or ids.min() < 0):
            raise VocabError(f"record {rec.get('id')}: token id {ids.max()} outside the target "
                             f"vocab of {target_vocab} (wrong --target?)")
        pending.append(ids[mask])
        buffered += pending[-1].size
        if buffered >= chunk_tokens:
            counts += np.bincount(np.concatenate(pending), minlength=target_vocab)
            pending, buffered = [], 0
        if bar is not None:
            bar.update(1)
    if pending:
        counts += np.bincount(np.concatenate(pending), minlength=target_vocab)
    return counts


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


def report(counts: np.ndarray, hot_ids: np.ndarray, tokenizer=None, top: int = 50) -> dict:
    """Coverage at several sizes and at the chosen size, plus the most frequent tokens."""
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
    }
