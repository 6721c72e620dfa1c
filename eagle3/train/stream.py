"""Stage 04 in stream mode (`--stream`): trains on the train split's states as 02b `--stream`
writes them into the spool (eagle3/core/spool.py has the contract; eagle3/extract/stream.py the
other side).

04 knows its whole data order before any state exists: the merged train split gives every
record's length, and the packing and shuffling are a pure function of the lengths, the seed and
the flags (eagle3/train/data.py). Rank 0 publishes that order (`plan.json`); 02b extracts in it.
Each rank's loader waits for the files of its row, loads them, deletes them, and reports the
next demand it will read; the loop's data-wait share is the time it waited for 02b. The eval
split is 02b's ordinary folder (written first, kept).

Given the same records in the same order and seed, the draft equals the offline 04's to the
byte: the rows, the samples in them and the files' contents are the same (a test checks it). A
record that 02b skips (non-finite states, failed every attempt) is left out of its row, where
the offline 04 never sees it at all: then the rows differ.

Resume: a restarted 04 resumes from its last checkpoint as offline, reporting a new session;
02b extracts again the files read since that checkpoint.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from eagle3.core.faults import BadRecords, InputFileError, StopSignals
from eagle3.core.spool import Spool, SpoolError, SpoolPlan, SpoolReader, remove_file
from eagle3.core.stage import STAGE_DIRS
from eagle3.extract.checks import read_split, skip_key
from eagle3.train.data import build_plan, collate_packed, row_width
from eagle3.train.files import SplitFiles, read_sample

log = logging.getLogger(__name__)

PREFETCH = 4  # rows a loader worker loads ahead (make_loader's prefetch factor)


class StreamFiles(SplitFiles):
    """The train split in stream mode: entry j is record `good[j]` of the merged split (its
    epoch-0 spool path, for messages), with what the loader needs to wait for and report it."""

    def __init__(self, spool: Spool, plan: SpoolPlan, good: list[int], ids: list[str],
                 rank: int, hidden_size: int, bad: BadRecords | None, stop: StopSignals | None,
                 give_up_s: float = 3600.0):
        super().__init__([spool.demand_path(0, i) for i in good], ids, [None] * len(good),
                         hidden_size, bad, stop)
        self.spool, self.plan, self.good = spool, plan, good
        self.reader = SpoolReader(spool, plan, rank, give_up_s=give_up_s)
        self.row_starts = plan.row_starts()

    def on_row(self, next_demand: int) -> None:
        """Main process, each row the loop takes: report how far this rank read."""
        self.reader.report(next_demand)

    def finish(self) -> None:
        """This rank's last checkpoint is on disk: 02b may stop."""
        self.reader.report(self.reader.num_demands, done=True)


class StreamRows(torch.utils.data.Dataset):
    """Item i = this rank's i-th remaining row, its files waited for, read, checked and
    deleted (the loader's workers); the row says (`stream_next`) which demand comes next."""

    def __init__(self, files: StreamFiles, plan, start_step: int, rank: int, width: int,
                 max_seq_len: int, topk: int = 0):
        self.files, self.width, self.max_seq_len, self.topk = files, width, max_seq_len, topk
        self.items = []  # (epoch, demand position of the row's first record, row of j)
        for s in range(start_step, plan.num_steps):
            epoch, j = plan.locate(s)
            for m in range(plan.grad_accum):
                r = j * plan.rows_per_step + m * plan.world + rank
                self.items.append((epoch, files.row_starts[epoch][r], plan.epochs[epoch][r]))
        first = self.items[0][1] if self.items else files.reader.num_demands
        files.on_row(first)  # a new session: 02b rewinds to here if it was further on

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        epoch, start, row = self.items[i]
        f = self.files
        samples, skipped = [], []
        # Only a loading main process (--num-workers 0) stops here on a signal: a forked worker
        # holds a copy of the stop flag whose Interrupted would reach the loop as a bare
        # RuntimeError; there the loop stops between rows instead (SkipCountingLoader)
        in_main = torch.utils.data.get_worker_info() is None
        stop_check = f.stop.check if f.stop is not None and in_main else None
        for j in row:
            while True:
                path, reason = f.reader.wait(epoch, f.good[j], stop_check)
                if path is None:
                    break
                data, skip = read_sample(_OneFile(path, f.ids[j]), 0)
                if skip is None or path.exists():
                    break
                # gone while read: 02b evicted it (a rewound 04 elsewhere); it comes again
            if path is None:
                skipped.append({"id": f.ids[j], "file": str(f.spool.demand_path(epoch, f.good[j])),
                                "reason": reason})
                continue
            remove_file(path)  # loaded: 02b's budget gets its bytes back
            if skip is None:
                samples.append(data)
            else:
                skipped.append(skip)
        out = collate_packed(samples, self.width, self.max_seq_len, self.topk, f.hidden_size)
        if skipped:
            out["skipped"] = skipped
        out["stream_next"] = start + len(row)
        return out


class _OneFile(SplitFiles):
    def __init__(self, path: Path, record_id: str):
        super().__init__([path], [record_id], [None])


def lookahead_rows(num_workers: int) -> int:
    """Rows a rank may hold loaded ahead: each worker's prefetch, the prefetcher's next batch
    and the one in training."""
    return max(num_workers, 1) * PREFETCH + 2


def merged_train(workdir: Path, vocab_size: int) -> tuple[list[int], list[str], list[int]]:
    """(merged indices, skip keys, lengths) of the good records of the merged train split,
    as 02b reads them (a bad line is 02b's to list: its slot is left out here)."""
    src = Path(workdir) / STAGE_DIRS["merge"] / "train.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        records = read_split(src, "train", vocab_size, BadRecords(Path(tmp), -1))
    good = [i for i, r in enumerate(records) if r is not None]
    return (good, [skip_key("train", records[i]["id"]) for i in good],
            [len(records[i]["input_ids"]) for i in good])


def stream_plan(cfg, lengths: list[int], eval_lengths: list[int], good: list[int],
                world: int):
    """The loop's RunPlan (the same call as the loop's) and the spool plan of its rows."""
    width = row_width(cfg.max_seq_len, cfg.pack_tokens, max(lengths + eval_lengths))
    plan = build_plan(lengths, width, cfg.max_seq_len, cfg.seed, cfg.epochs, world,
                      cfg.grad_accum)
    rows = [[[good[j] for j in row] for row in plan.epochs[e][:plan.steps_in_epoch(e)
                                                               * plan.rows_per_step]]
            for e in range(len(plan.epochs))]
    return plan, SpoolPlan(rows, world, lookahead_rows(cfg.num_workers))


def check_layout(prod: dict, capture_layers: list[int] | None, hidden_size: int,
                 vocab_sha: str, spool: Spool) -> None:
    """02b's files are the ones this 04 can train on."""
    where = spool.root / "producer.json"
    if prod.get("hidden_size") != hidden_size:
        raise InputFileError(where, f"02b streams states of width {prod.get('hidden_size')}, "
                                    f"the target's hidden size is {hidden_size}: another target")
    if capture_layers is not None and list(prod.get("capture_layers") or []) != capture_layers:
        raise InputFileError(where, f"02b captures {prod.get('capture_layers')}, the eval "
                                    f"split's files {capture_layers}")
    if prod.get("vocab_sha256") not in (None, vocab_sha):
        raise InputFileError(where, "02b's top-k teacher uses another draft vocabulary than "
                                    "03_vocab/vocab_mapping.safetensors (re-run 03 or 02b)")


def publish(spool: Spool, plan: SpoolPlan) -> None:
    """Rank 0: write plan.json unless it already holds this plan (a resume)."""
    try:
        old = spool.read_plan()
    except SpoolError:
        old = None
    if old is None or old.run != plan.run:
        if old is not None:
            log.warning("the spool held another plan (%s); 02b starts over on this one (%s)",
                        old.run, plan.run)
        spool.write_plan(plan)
