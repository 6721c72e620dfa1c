"""Fake SGLang forward passes for the dump hook's tests (no SGLang needed): a ForwardBatch of
several requests' chunks, with CUDA-graph padding rows of garbage, and the reference states each
request's dump must hold."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import torch

H = 8  # hidden size of the fake target
CAPTURE = [2, 30, 58]


class ForwardMode(enum.IntEnum):
    """Mirror of SGLang's enum (0.5.23 order), including its broad `is_extend`."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)


def reference(rid: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-request states: aux [T, 3H] and final [T, H], bf16."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)))
    aux = torch.randn(num_tokens, 3 * H, generator=gen).to(torch.bfloat16)
    final = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    return aux, final


def reference_ids(rid: str, num_tokens: int) -> torch.Tensor:
    """Deterministic per-request prompt: int64 [T]."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)) + 1)
    return torch.randint(0, 1000, (num_tokens,), generator=gen)


def forward_pass(chunks, mode=ForwardMode.EXTEND, pad_rows=0, packed=False, totals=None):
    """A fake ForwardBatch plus the model output for `chunks` = [(rid, prefix, num_rows)].

    The states come from `reference(rid, totals[rid])`; padded rows are garbage (1e4). With
    `packed=False` the aux states are a list of 3 [rows, H] tensors (SGLang <= 0.5.16).
    """
    totals = totals or {}
    aux_rows, final_rows, positions, ids = [], [], [], []
    for rid, prefix, num_rows in chunks:
        aux, final = reference(rid, totals.get(rid, prefix + num_rows))
        ids.append(reference_ids(rid, totals.get(rid, prefix + num_rows))[prefix:prefix + num_rows])
        aux_rows.append(aux[prefix:prefix + num_rows])
        final_rows.append(final[prefix:prefix + num_rows])
        positions.append(torch.arange(prefix, prefix + num_rows))
    aux_rows.append(torch.full((pad_rows, 3 * H), 1e4, dtype=torch.bfloat16))
    final_rows.append(torch.full((pad_rows, H), 1e4, dtype=torch.bfloat16))
    lens = [n for _, _, n in chunks]
    batch = SimpleNamespace(
        forward_mode=mode,
        input_ids=torch.cat(ids + [torch.zeros(pad_rows, dtype=torch.long)]),
        rids=[rid for rid, _, _ in chunks],
        extend_start_loc=torch.tensor([sum(lens[:j]) for j in range(len(lens))]),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[prefix for _, prefix, _ in chunks],
        seq_lens_cpu=torch.tensor([prefix + n for _, prefix, n in chunks]),
        positions=torch.cat(positions + [torch.zeros(pad_rows, dtype=torch.long)]),
    )
    aux_all, final_all = torch.cat(aux_rows), torch.cat(final_rows)
    aux_out = aux_all if packed else list(aux_all.split(H, dim=-1))
    return batch, final_all, aux_out


def prefill_schedule(totals: dict[str, int], chunk: int, budget: int) -> list[list[tuple]]:
    """The passes SGLang's chunked prefill makes of `totals` = {rid: prompt tokens}: FIFO, each
    pass up to `budget` rows, at most `chunk` rows of a request per pass (so long prompts span
    several passes, interleaved with others); each pass a list of (rid, prefix, rows)."""
    done = dict.fromkeys(totals, 0)
    passes = []
    while any(done[rid] < n for rid, n in totals.items()):
        left, chunks = budget, []
        for rid, n in totals.items():
            rows = min(chunk, n - done[rid], left)
            if rows <= 0:
                if left <= 0:
                    break
                continue
            chunks.append((rid, done[rid], rows))
            done[rid] += rows
            left -= rows
        passes.append(chunks)
    return passes
