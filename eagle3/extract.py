"""Stage 02b with the `hf` backend: hidden states from an in-process transformers target.

Records are processed in fixed length-sorted batches (the same batches on every run); a batch
whose files all exist is skipped, so a killed run resumes and writes the same files. Each file
is written atomically (temp + rename) to `shard_NNNNN/data_<idx>.pt`, where idx is the record's
line index in the split file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3 import hidden_states as hs
from eagle3.stage import atomic_torch_save

log = logging.getLogger(__name__)


@dataclass
class ExtractCounts:
    written: int = 0
    skipped_existing: int = 0
    tokens: int = 0
    bytes: int = 0


def fixed_batches(lengths: list[int], max_tokens: int, max_batch: int) -> list[list[int]]:
    """Record indices grouped into padded batches of at most `max_tokens` (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        width = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and (width * (len(cur) + 1) > max_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def extract_split(model, records: list[dict], out_root: Path, capture_layers: list[int],
                  dtype: str, max_tokens: int, bar, max_batch: int = 64) -> ExtractCounts:
    """Write one file per record of a split; returns counts."""
    counts = ExtractCounts()
    device = model.device
    for batch in fixed_batches([r["seq_len"] for r in records], max_tokens, max_batch):
        if all(hs.file_path(out_root, i).exists() for i in batch):
            counts.skipped_existing += len(batch)
            bar.update(len(batch))
            continue
        width = max(records[i]["seq_len"] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, i in enumerate(batch):  # right padding: causal attention never sees it
            n = records[i]["seq_len"]
            ids[b, :n] = torch.tensor(records[i]["input_ids"])
            attn[b, :n] = 1
        aux, final = hs.capture_hf(model, ids.to(device), attn.to(device), capture_layers)
        for b, i in enumerate(batch):
            rec, n = records[i], records[i]["seq_len"]
            path = hs.file_path(out_root, i)
            if path.exists():
                continue
            meta = {"id": rec["id"], "capture_layers": capture_layers, "final": "post_norm",
                    "source": rec["source"]}
            data = hs.pack(rec["input_ids"], rec["loss_mask"],
                           [a[b, :n].cpu() for a in aux], final[b, :n].cpu(), meta, dtype)
            atomic_torch_save(data, path)
            counts.written += 1
            counts.tokens += n
            counts.bytes += path.stat().st_size
        bar.update(len(batch))
    return counts
