"""The spool between 02b and 04 in stream mode: the two stages run at the same time, 02b writing
each record's hidden states into a folder with a byte budget, 04 training on them as they come
and deleting each file once its row is loaded (docs/PIPELINE.md, "Stream mode").

Only files and atomic renames cross between the two processes, so the same spool works on one
host and on a shared filesystem between an extraction node and a training node:

- `plan.json` (04's rank 0, once per run): the rows 04 will train on, epoch by epoch, as merged
  record indices (`epochs[e][row] = [idx, ...]`, the rows of the steps only: the remainder rows
  of an epoch are not trained and not asked for), the world size, the rows each rank loads
  ahead, and `run`, the plan's hash. The demands are the plan flattened: demand `d` is the
  d-th (epoch, idx) in that order. 02b extracts in demand order, so 04's first steps wait only
  for their own records.
- `producer.json` (02b, a heartbeat every few seconds): the layout of the files (capture layers,
  hidden size, dtype, K of a stored teacher), whether the offline splits (eval) are written, the
  demand it extracts next, the spool's bytes now and at peak, its budget, the state.
- `consumer_r<rank>.json` (each 04 rank, every row): the next demand the rank will read, a
  session id new at every start of 04 (02b rewinds to the lowest `next` when it changes: a
  resumed 04 reads again from its checkpoint), `done` once the rank's last checkpoint is on disk.
- `train/e<EEE>/shard_NNNNN/data_<idx>.pt`: the file of record idx for epoch EEE, written
  atomically (temp name, rename); `data_<idx>.skip.json` instead when 02b skipped the record
  (non-finite states, or failed every attempt): 04 leaves it out of its row and lists it.
- `keep/shard_NNNNN/data_<idx>.pt`: records kept for the later epochs within the budget; an
  epoch's file of a kept record is a hard link to it (no prefill, no extra bytes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from eagle3.core import hidden_states as hs
from eagle3.core.stage import StageError, atomic_write_json

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
PRODUCER_FILE = "producer.json"
SPOOL_DIR = "02b_spool"  # default place: <workdir>/02b_spool
TOMBSTONE_SUFFIX = ".skip.json"


class SpoolError(StageError):
    """The spool cannot be used as asked, or the other side is gone; the message names the
    file or flag."""


@dataclass
class SpoolPlan:
    """What 04 will read, in order (see the module docstring)."""

    epochs: list[list[list[int]]]  # epochs[e][row] = merged record indices
    world: int
    lookahead_rows: int  # rows a rank may hold loaded ahead of the one it trains on

    @property
    def run(self) -> str:
        blob = json.dumps([self.epochs, self.world], separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def demands(self) -> list[tuple[int, int]]:
        """(epoch, idx) of every demand, in order."""
        return [(e, idx) for e, rows in enumerate(self.epochs) for row in rows for idx in row]

    def row_starts(self) -> list[list[int]]:
        """starts[e][row]: the demand position of the row's first record."""
        starts, pos = [], 0
        for rows in self.epochs:
            mine = []
            for row in rows:
                mine.append(pos)
                pos += len(row)
            starts.append(mine)
        return starts

    def to_json(self) -> dict:
        return {"run": self.run, "world": self.world, "lookahead_rows": self.lookahead_rows,
                "epochs": self.epochs}

    @classmethod
    def from_json(cls, obj: dict) -> SpoolPlan:
        plan = cls(obj["epochs"], int(obj["world"]), int(obj["lookahead_rows"]))
        if plan.run != obj.get("run"):
            raise SpoolError("plan.json's rows do not match its run hash: edited or damaged; "
                             "re-run 04 --stream to write it again")
        return plan


class Spool:
    """Paths and the small JSON files of one spool folder."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def demand_path(self, epoch: int, idx: int) -> Path:
        return hs.file_path(self.root / "train" / f"e{epoch:03d}", idx)

    def tombstone_path(self, epoch: int, idx: int) -> Path:
        p = self.demand_path(epoch, idx)
        return p.with_name(p.stem + TOMBSTONE_SUFFIX)

    def keep_path(self, idx: int) -> Path:
        return hs.file_path(self.root / "keep", idx)

    def _read(self, name: str) -> dict | None:
        try:
            return json.loads((self.root / name).read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:  # written by atomic rename: not torn, so edited
            raise SpoolError(f"{self.root / name} is not JSON ({e}): edited or damaged; "
                             "remove it and re-run the side that writes it") from e

    def write_plan(self, plan: SpoolPlan) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / PLAN_FILE, plan.to_json())

    def read_plan(self) -> SpoolPlan | None:
        obj = self._read(PLAN_FILE)
        return None if obj is None else SpoolPlan.from_json(obj)

    def write_producer(self, state: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / PRODUCER_FILE, {**state, "t": time.time()})

    def read_producer(self) -> dict | None:
        return self._read(PRODUCER_FILE)

    def consumer_file(self, rank: int) -> str:
        return f"consumer_r{rank}.json"

    def write_consumer(self, rank: int, state: dict) -> None:
        atomic_write_json(self.root / self.consumer_file(rank), {**state, "t": time.time()})

    def read_consumers(self, world: int, run: str) -> list[dict | None]:
        """Each rank's state for plan `run` (None: that rank has not started on this plan)."""
        out = []
        for rank in range(world):
            obj = self._read(self.consumer_file(rank))
            out.append(obj if obj is not None and obj.get("run") == run else None)
        return out


class SpoolReader:
    """One 04 rank's side: waits for the files of its demands, reports how far it read."""

    def __init__(self, spool: Spool, plan: SpoolPlan, rank: int, poll_s: float = 0.2,
                 log_every_s: float = 60.0, give_up_s: float = 3600.0):
        self.spool, self.plan, self.rank = spool, plan, rank
        self.poll_s, self.log_every_s, self.give_up_s = poll_s, log_every_s, give_up_s
        self.session = uuid.uuid4().hex[:12]
        self.num_demands = sum(len(r) for rows in plan.epochs for r in rows)

    def report(self, next_demand: int, done: bool = False) -> None:
        """This rank reads no demand below `next_demand` any more (main process only)."""
        self.spool.write_consumer(self.rank, {"run": self.plan.run, "session": self.session,
                                              "rank": self.rank, "next": next_demand,
                                              "done": done})

    def wait(self, epoch: int, idx: int, stop_check=None) -> tuple[Path | None, str | None]:
        """(path, None) once the file of (epoch, idx) is there, (None, reason) once 02b
        skipped the record. Polls; logs a line every `log_every_s` while it waits."""
        path, tomb = self.spool.demand_path(epoch, idx), self.spool.tombstone_path(epoch, idx)
        t0 = last_log = time.monotonic()
        delay = 0.002
        while True:
            if path.exists():
                return path, None
            if tomb.exists():
                try:
                    return None, json.loads(tomb.read_text())["reason"]
                except (OSError, ValueError, KeyError):
                    return None, "skipped by 02b (its tombstone is unreadable)"
            if stop_check is not None:
                stop_check()
            now = time.monotonic()
            if now - last_log >= self.log_every_s:
                last_log = now
                log.warning("waiting %.0fs for 02b --stream: record %d of epoch %d (%s); %s",
                            now - t0, idx, epoch, path, self.producer_note())
                if now - t0 > self.give_up_s and self.producer_silent_s() > self.give_up_s:
                    raise SpoolError(f"02b --stream has not been heard from for "
                                     f"{self.give_up_s:.0f}s (--stream-wait-s) while this run "
                                     f"waits for {path}: start it again with the same --spool "
                                     f"({self.producer_note()})")
            time.sleep(delay)
            delay = min(delay * 2, self.poll_s)

    def producer_silent_s(self) -> float:
        """Seconds since 02b's last heartbeat (inf without one)."""
        try:
            prod = self.spool.read_producer()
        except SpoolError:
            prod = None
        return float("inf") if prod is None else time.time() - prod.get("t", 0)

    def producer_note(self) -> str:
        try:
            prod = self.spool.read_producer()
        except SpoolError as e:
            return str(e)
        if prod is None:
            return "02b has not started (no producer.json): start 02b with --stream"
        age = time.time() - prod.get("t", 0)
        return (f"02b last heard {age:.0f}s ago ({prod.get('state')}, next demand "
                f"{prod.get('next')}, spool {prod.get('bytes', 0) / 1e9:.2f} of "
                f"{prod.get('budget_bytes', 0) / 1e9:.2f} GB)")


def wait_for_producer(spool: Spool, want_key: str, stop_check=None, poll_s: float = 0.5,
                      log_every_s: float = 60.0, give_up_s: float = 3600.0) -> dict:
    """producer.json once its `want_key` is true (04 at start: 02b's layout and eval split);
    SpoolError after `give_up_s` without a heartbeat."""
    t0 = last = time.monotonic()
    while True:
        prod = spool.read_producer()
        if prod is not None and prod.get(want_key):
            return prod
        if stop_check is not None:
            stop_check()
        if time.monotonic() - last >= log_every_s:
            last = time.monotonic()
            note = ("no producer.json yet: start 02b with --stream and the same --spool"
                    if prod is None else f"02b is {prod.get('state')}")
            log.warning("waiting %.0fs for 02b --stream at %s (%s)", last - t0, spool.root, note)
            silent = last - t0 if prod is None else time.time() - prod.get("t", 0)
            if last - t0 > give_up_s and silent > give_up_s:
                raise SpoolError(f"02b --stream has not been heard from for {give_up_s:.0f}s "
                                 f"(--stream-wait-s) at {spool.root}: {note}")
        time.sleep(poll_s)


def remove_file(path: Path) -> None:
    """Unlink, ignoring a file already gone (a second reader, or 02b's cleanup)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
