"""Stage 02b in stream mode (`--stream`): the train split's states go through a spool with a byte
budget to a 04 started with `--stream` at the same time (eagle3/core/spool.py has the contract).

Order of work: the other splits (eval) are written first, as offline, into
`02b_hidden_states/<split>/` (04 evaluates on them throughout: they stay); then 02b waits for 04's
`plan.json` and extracts the train split in 04's reading order, demand by demand, never holding
more than `--spool-gb` in the spool: when the next chunk would not fit it waits for 04 to read
(back-pressure, shown in its progress line). 04 deletes each file once loaded.

Epochs: each epoch reads every record again. Records are kept in `keep/` for the later epochs
while they fit in the budget beside the working window (what 04 may hold loaded ahead, plus one
chunk being written); every other record is extracted again in each epoch. The target's prefill
is therefore `1 + (epochs - 1) x (share of tokens not kept)` passes over the split; the summary
and the manifest give the share and the tokens prefilled.

Resume: either side can be killed at any moment. Files are written under a temp name and renamed;
04's ranks say which demand they read next (`consumer_r<rank>.json`, with a session id new at each
start), and a 04 restarted from its checkpoint makes 02b rewind and extract again what it had
read since (those files are gone). A restarted 02b scans the spool and continues from the
slowest rank's next demand. The chunks are a fixed function of the plan, so what is extracted
again is extracted in the same batches: the same bytes.

The hf backend batches a chunk of consecutive demands (`--max-batch-tokens` padded tokens,
`--max-batch-size` records); offline it batches length-sorted records, so the two give files
equal to the last bf16 bit only with `--max-batch-size 1` (each record's own forward pass, as
an SGLang server computes it). The sglang backend sends a chunk's records concurrently.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core import hidden_states as hs
from eagle3.core.faults import BadRecords, StopSignals
from eagle3.core.progress import human_bytes, progress
from eagle3.core.records import JsonlAppender
from eagle3.core.spool import Spool, SpoolError, SpoolPlan, remove_file
from eagle3.core.stage import atomic_write_json, sweep_temp_files
from eagle3.extract.checks import skip_key
from eagle3.extract.writer import ExtractError

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0


@dataclass
class Chunk:
    """Consecutive demands of one epoch: `extract` (pos, idx) go through the target together,
    `link` (pos, idx) are kept records linked from `keep/`."""

    epoch: int
    extract: list[tuple[int, int]] = field(default_factory=list)
    link: list[tuple[int, int]] = field(default_factory=list)

    @property
    def last(self) -> int:
        return max(p for p, _ in self.extract + self.link)


@dataclass
class StreamStats:
    extracted: int = 0  # files written by a forward pass of the target
    prefill_tokens: int = 0
    linked: int = 0  # epoch files of kept records (no prefill)
    skipped: int = 0  # tombstones: non-finite states, or listed as bad before
    failed: int = 0  # records that failed every attempt (sglang): tombstones too
    rewinds: int = 0  # 04 restarted and read again from its checkpoint
    evicted: int = 0  # files beyond a rewound 04's reach deleted to make room
    peak_bytes: int = 0
    backpressure_s: float = 0.0  # waiting for 04 to read (the spool was full)
    plan_wait_s: float = 0.0


def record_bytes(n_tokens: int, hidden_size: int, dtype: str, topk: int) -> int:
    return hs.estimate_bytes(n_tokens, 1, hidden_size, dtype, topk)


def make_chunks(plan: SpoolPlan, lengths: dict[int, int], kept: set[int], max_tokens: int,
                max_batch: int) -> list[Chunk]:
    """The fixed chunks of the plan's demands: within one epoch, consecutive demands until the
    records to extract reach `max_batch` or their padded width x count passes `max_tokens`."""
    chunks, seen, pos = [], set(), 0
    for e, rows in enumerate(plan.epochs):
        cur, width = Chunk(e), 0
        for row in rows:
            for idx in row:
                if idx in kept and idx in seen:
                    cur.link.append((pos, idx))
                else:
                    w = max(width, lengths[idx])
                    if cur.extract and (w * (len(cur.extract) + 1) > max_tokens
                                        or len(cur.extract) >= max_batch):
                        chunks.append(cur)
                        cur, w = Chunk(e), lengths[idx]
                    cur.extract.append((pos, idx))
                    width = w
                seen.add(idx)
                pos += 1
        if cur.extract or cur.link:
            chunks.append(cur)
    return chunks


def choose_kept(plan: SpoolPlan, used: list[int], nbytes: dict[int, int], budget: int,
                chunk_max: int) -> set[int]:
    """Records kept in `keep/` for the later epochs: in index order while their bytes and the
    working window of the others (a kept record's files cost nothing there: its bytes are in
    `keep/`) fit in the budget; all of them when the split fits beside one chunk."""
    if sum(nbytes[i] for i in used) + chunk_max <= budget:
        return set(used)
    kept: set[int] = set()
    for _ in range(4):  # each pass frees window room for the next (a few converge)
        window = window_bytes(plan, {i: 0 if i in kept else b for i, b in nbytes.items()})
        room = budget - window - chunk_max - sum(nbytes[i] for i in kept)
        grown = False
        for i in used:
            if i not in kept and nbytes[i] <= room:
                kept.add(i)
                room -= nbytes[i]
                grown = True
        if not grown:
            break
    return kept


def window_bytes(plan: SpoolPlan, nbytes: dict[int, int]) -> int:
    """The most bytes any `lookahead_rows x world + 1` consecutive rows hold: what 04's ranks
    may have loaded ahead (each row's files are deleted as it is loaded, but 02b cannot tell
    which were)."""
    rows = [sum(nbytes[i] for i in row) for rows in plan.epochs for row in rows]
    n = plan.lookahead_rows * plan.world + 1
    best = cur = sum(rows[:n])
    for k in range(n, len(rows)):
        cur += rows[k] - rows[k - n]
        best = max(best, cur)
    return best


class StreamSink:
    """What the backends write through (the SplitWriter interface they use): a chunk's files
    into the spool, skips as tombstones."""

    def __init__(self, producer: Producer):
        self.p = producer
        self.records = producer.records
        self.epoch = 0
        self.pos: dict[int, int] = {}  # idx -> demand position, for the chunk in flight

    @property
    def stopping(self) -> bool:
        return self.p.stop is not None and self.p.stop.requested

    def save(self, idx: int, data: dict) -> hs.SavedFile:
        """Any thread: the file of (epoch, idx); a kept record's first file goes to `keep/` and
        its epoch file is a hard link to it."""
        sp = self.p.spool
        if idx in self.p.kept:
            saved = hs.save_with_sha256(data, sp.keep_path(idx))
            link_file(sp.keep_path(idx), sp.demand_path(self.epoch, idx))
            return saved
        return hs.save_with_sha256(data, sp.demand_path(self.epoch, idx))

    def mark_written(self, idx: int, tokens: int, nbytes: int, sha256: str | None = None) -> None:
        self.p.written(self.epoch, idx, self.pos[idx], tokens, nbytes)

    def skip(self, idx: int, reason: str) -> None:
        self.p.tombstone(self.epoch, idx, reason)


class StreamFailures:
    """The sglang client's failure log in stream mode: a record that failed every attempt gets
    a tombstone (04 leaves it out) and a line in `<stage>/train_failures.jsonl`."""

    def __init__(self, producer: Producer, max_failures: int):
        self.p, self.max_failures, self.new = producer, max_failures, 0
        self.path = producer.stage_dir / "train_failures.jsonl"

    def add(self, idx: int, record_id: str, reasons: list[str]) -> None:
        self.new += 1
        self.p.stats.failed += 1
        with JsonlAppender(self.path) as out:  # a torn last line of a killed run is cut off
            out.write({"idx": idx, "id": record_id, "epoch": self.p.sink.epoch,
                       "reason": reasons[-1], "attempts": len(reasons)})
        self.p.tombstone(self.p.sink.epoch, idx, f"failed: {reasons[-1]}", bad=False)
        if 0 <= self.max_failures < self.new:
            raise ExtractError(f"{self.new} records failed (more than --max-failures "
                               f"{self.max_failures}); see {self.path}")


def link_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    remove_file(tmp)
    try:
        os.link(src, tmp)
    except OSError as e:
        raise SpoolError(f"cannot hard-link {src} to {dst} ({e}): the spool's filesystem must "
                         "support hard links for kept records; or lower --spool-gb so that "
                         "nothing is kept") from e
    os.replace(tmp, dst)


class Producer:
    """02b's side of the spool for the train split (see the module docstring)."""

    def __init__(self, spool: Spool, stage_dir: Path, records: list[dict | None],
                 layout: dict, budget_bytes: int, bad: BadRecords, stop: StopSignals | None,
                 backend, max_failures: int, poll_s: float = 0.2, give_up_s: float = 3600.0):
        self.spool, self.stage_dir, self.records = spool, stage_dir, records
        self.layout, self.budget, self.bad, self.stop = layout, budget_bytes, bad, stop
        self.backend, self.poll_s, self.give_up_s = backend, poll_s, give_up_s
        self._heard = (None, time.monotonic())  # 04's last state seen, and when it changed
        self.stats = StreamStats()
        self.live: dict[Path, tuple[int, int]] = {}  # demand file -> (pos, bytes not in keep/)
        self.keep_bytes = 0
        self.kept: set[int] = set()
        self.next = 0
        self.state = "starting"
        self.sink = StreamSink(self)
        self.failures = StreamFailures(self, max_failures)
        self._beat = 0.0
        self.plan: SpoolPlan | None = None

    # ------------------------------------------------------------ bookkeeping

    @property
    def bytes(self) -> int:
        return self.keep_bytes + sum(b for _, b in self.live.values())

    def written(self, epoch: int, idx: int, pos: int, tokens: int, nbytes: int) -> None:
        if idx in self.kept:
            self.keep_bytes += nbytes
            nbytes = 0
        self.live[self.spool.demand_path(epoch, idx)] = (pos, nbytes)
        self.stats.extracted += 1
        self.stats.prefill_tokens += tokens
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)
        self.bar.update(tokens)
        self.heartbeat()

    def tombstone(self, epoch: int, idx: int, reason: str, bad: bool = True) -> None:
        if bad:
            self.bad.add(skip_key("train", self.records[idx]["id"]), reason)
        self.stats.skipped += bad
        atomic_write_json(self.spool.tombstone_path(epoch, idx),
                          {"id": self.records[idx]["id"], "reason": reason})

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._beat < HEARTBEAT_S:
            return
        self._beat = now
        self.spool.write_producer({
            **self.layout, "pid": os.getpid(), "run": self.plan.run if self.plan else None,
            "state": self.state, "next": self.next, "bytes": self.bytes,
            "peak_bytes": self.stats.peak_bytes, "budget_bytes": self.budget,
            "kept_records": len(self.kept), "extracted": self.stats.extracted,
            "prefill_tokens": self.stats.prefill_tokens,
            "backpressure_s": round(self.stats.backpressure_s, 1)})
        if hasattr(self, "bar"):
            self.bar.set_postfix_str(
                f"spool {human_bytes(self.bytes)} / {human_bytes(self.budget)} (peak "
                f"{human_bytes(self.stats.peak_bytes)}) | {self.state} | waited for 04 "
                f"{self.stats.backpressure_s:.0f}s", refresh=False)

    # ------------------------------------------------------------ the plan

    def wait_plan(self) -> SpoolPlan:
        """04's plan.json (logs while it waits); checks it names records of this split."""
        self.state = "waiting for 04's plan"
        t0 = last = time.monotonic()
        while True:
            plan = self.spool.read_plan()
            if plan is not None:
                break
            if self.stop is not None:
                self.stop.check()
            self.heartbeat()
            if time.monotonic() - t0 > self.give_up_s:
                raise SpoolError(f"04 --stream has not written {self.spool.root / 'plan.json'} "
                                 f"in {self.give_up_s:.0f}s (--stream-wait-s): start it with "
                                 "--stream and the same --spool")
            if time.monotonic() - last >= 60:
                last = time.monotonic()
                log.warning("waiting %.0fs for 04 --stream to write %s (start 04 with --stream "
                            "and the same --spool)", last - t0, self.spool.root / "plan.json")
            time.sleep(self.poll_s)
        self.stats.plan_wait_s += time.monotonic() - t0
        for rows in plan.epochs:
            for row in rows:
                for idx in row:
                    if not (0 <= idx < len(self.records)) or self.records[idx] is None:
                        raise SpoolError(f"04's plan asks for merged train record {idx}, which "
                                         "02b does not have (a bad line, or another merged "
                                         "split): run both on the same workdir")
        return plan

    def setup(self, plan: SpoolPlan, chunk_limits: tuple[int, int]) -> list[Chunk]:
        """Sizes, the kept records, the chunks, the budget check; scans what a killed run left."""
        self.plan = plan
        H, dtype, topk = self.layout["hidden_size"], self.layout["dtype"], self.layout["topk"]
        used = sorted({i for rows in plan.epochs for row in rows for i in row})
        lengths = {i: len(self.records[i]["input_ids"]) for i in used}
        nbytes = {i: record_bytes(lengths[i], H, dtype, topk) for i in used}
        probe = make_chunks(plan, lengths, set(), *chunk_limits)
        chunk_max = max(sum(nbytes[i] for _, i in c.extract) for c in probe)
        reserve = window_bytes(plan, nbytes) + chunk_max
        if reserve > self.budget:
            raise SpoolError(
                f"--spool-gb {self.budget / 1e9:g} is below the working window: 04 may hold "
                f"{plan.lookahead_rows} rows a rank ahead ({plan.world} ranks) plus one chunk "
                f"being written = {human_bytes(reserve)} at most; raise --spool-gb, or lower "
                "04's --num-workers or 02b's --max-batch-tokens")
        if len(plan.epochs) > 1:
            self.kept = choose_kept(plan, used, nbytes, self.budget, chunk_max)
            reserve = window_bytes(plan, {i: 0 if i in self.kept else b
                                          for i, b in nbytes.items()}) + chunk_max
        self.chunks = make_chunks(plan, lengths, self.kept, *chunk_limits)
        self.lengths = lengths
        self._row_starts = [p for starts in plan.row_starts() for p in starts]
        self._scan()
        total = sum(lengths[i] for c in self.chunks for _, i in c.extract)
        self.prefill_share = total / max(sum(lengths[i] for _, i in plan.demands()), 1)
        log.info("stream: %d demands in %d chunks over %d epochs; %d of %d records kept for the "
                 "later epochs (%s); prefill %.2f passes over the split; budget %s, working "
                 "window %s", len(plan.demands()), len(self.chunks), len(plan.epochs),
                 len(self.kept), len(used), human_bytes(sum(nbytes[i] for i in self.kept)),
                 total / max(sum(lengths.values()), 1), human_bytes(self.budget),
                 human_bytes(reserve))
        return self.chunks

    def _scan(self) -> None:
        """Files a killed run left: kept ones count; demand files of this plan are live; the
        rest (another plan) go."""
        sweep_temp_files(self.spool.root)
        pos = {d: p for p, d in enumerate(self.plan.demands())}
        for path in (self.spool.root / "keep").glob("shard_*/data_*.pt"):
            idx = hs.file_index(path)
            if idx in self.kept:
                self.keep_bytes += path.stat().st_size
            else:
                remove_file(path)
        for path in (self.spool.root / "train").glob("e*/shard_*/data_*"):
            epoch, idx = int(path.parts[-3][1:]), int(path.name.split("_")[1].split(".")[0])
            if (epoch, idx) not in pos:
                remove_file(path)
            elif path.suffix == ".pt":
                st = path.stat()
                self.live[path] = (pos[(epoch, idx)], 0 if st.st_nlink > 1 else st.st_size)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)

    # ------------------------------------------------------------ the loop

    def run(self, chunk_limits: tuple[int, int]) -> StreamStats:
        plan = self.wait_plan()
        self.chunks = self.setup(plan, chunk_limits)
        self.bar = progress(total=sum(self.lengths[i] for c in self.chunks for _, i in c.extract),
                            desc="02b stream", unit="tok")
        self.bar.unit_scale = True
        k, sessions = 0, None
        try:
            while True:
                if self.stop is not None:
                    self.stop.check()
                consumers = self.spool.read_consumers(plan.world, plan.run)
                if all(c is not None and c.get("done") for c in consumers):
                    break
                self._check_heard(consumers)
                need = min((c["next"] if c else 0) for c in consumers)
                now_sessions = [c and c["session"] for c in consumers]
                if now_sessions != sessions:  # a 04 rank (re)started: rewind to its position
                    if sessions is not None and any(sessions):
                        self.stats.rewinds += 1
                        log.info("04 restarted: extracting again from demand %d", need)
                    sessions = now_sessions
                    k = next((j for j, c in enumerate(self.chunks) if c.last >= need),
                             len(self.chunks))
                self._refresh(need)
                if k == len(self.chunks):
                    self.state = "all extracted; waiting for 04 to finish"
                    self.heartbeat()
                    time.sleep(self.poll_s)
                    continue
                chunk = self.chunks[k]
                self.next = chunk.extract[0][0] if chunk.extract else chunk.link[0][0]
                todo = self._todo(chunk, need)
                # what the chunk will add: a kept record's first file too (into keep/);
                # its links add nothing
                est = sum(record_bytes(self.lengths[i], self.layout["hidden_size"],
                                       self.layout["dtype"], self.layout["topk"])
                          for _, i in todo
                          if not (i in self.kept and self.spool.keep_path(i).exists()))
                if todo and self.bytes + est > self.budget:
                    self._evict_ahead(need, self.next, self.bytes + est - self.budget)
                if todo and self.bytes + est > self.budget:
                    self.state = "spool full: waiting for 04"
                    self.heartbeat()
                    t0 = time.monotonic()
                    time.sleep(self.poll_s)
                    self.stats.backpressure_s += time.monotonic() - t0
                    continue
                self.state = "extracting"
                self._do_chunk(chunk, todo, need)
                k += 1
                self.heartbeat()
        finally:
            self.bar.close()
        self.state = "done"
        self.heartbeat(force=True)
        return self.stats

    def _check_heard(self, consumers: list) -> None:
        """SpoolError once 04's ranks have said nothing new for `give_up_s` (while this side
        waits: it cannot tell a dead 04 from a slow one sooner)."""
        seen = [c and (c["session"], c["next"], c.get("t")) for c in consumers]
        if seen != self._heard[0]:
            self._heard = (seen, time.monotonic())
        elif time.monotonic() - self._heard[1] > self.give_up_s:
            raise SpoolError(f"04 --stream has not read a row for {self.give_up_s:.0f}s "
                             f"(--stream-wait-s; state: {self.state}): start it again with the "
                             f"same --spool, or re-run this command once it runs")

    def _refresh(self, need: int) -> None:
        """Forget files 04 deleted; delete those no rank will read (below `need`)."""
        for path, (pos, _) in list(self.live.items()):
            if pos < need:
                remove_file(path)
            if pos < need or not path.exists():
                del self.live[path]

    def _evict_ahead(self, need: int, writing: int, want: int) -> None:
        """After 04 rewound: files written before for demands past the chunk now being
        written (at `writing`) and beyond what any rank may load ahead of `need` hold the room
        the demands from `need` on are waiting for; delete them, the farthest first (they are
        extracted again when their turn comes). Without a rewind every file lies below the
        chunk being written, so nothing is evicted."""
        r = bisect.bisect_right(self._row_starts, need) - 1
        end = r + self.plan.lookahead_rows * self.plan.world + 1
        horizon = max(writing + 1,
                      self._row_starts[end] if end < len(self._row_starts) else 1 << 62)
        freed = 0
        for path, (pos, b) in sorted(self.live.items(), key=lambda kv: -kv[1][0]):
            if pos < horizon or freed >= want:
                break
            remove_file(path)
            del self.live[path]
            freed += b
            self.stats.evicted += 1

    def _todo(self, chunk: Chunk, need: int) -> list[tuple[int, int]]:
        """The chunk's demands still to write: not passed by 04, without a file or tombstone."""
        sp = self.spool
        return [(p, i) for p, i in chunk.extract + chunk.link
                if p >= need and not sp.demand_path(chunk.epoch, i).exists()
                and not sp.tombstone_path(chunk.epoch, i).exists()]

    def _do_chunk(self, chunk: Chunk, todo: list[tuple[int, int]], need: int) -> None:
        sp, e = self.spool, chunk.epoch
        self.sink.epoch = e
        self.sink.pos = {i: p for p, i in chunk.extract + chunk.link}
        extract = set()
        for p, i in todo:
            if skip_key("train", self.records[i]["id"]) in self.bad.seen:
                self.tombstone(e, i, "listed as bad by an earlier epoch or run", bad=False)
            elif i in self.kept and sp.keep_path(i).exists():
                link_file(sp.keep_path(i), sp.demand_path(e, i))
                self.live[sp.demand_path(e, i)] = (p, 0)
                self.stats.linked += 1
            else:
                extract.add(i)
        if extract:
            # the whole fixed chunk runs (the same batch, the same bytes), files for `extract`
            self.backend.run_chunk(self.sink, [i for _, i in chunk.extract], extract)


def run_stream(cfg, stage_dir: Path, records: list[dict | None], layout: dict,
               bad: BadRecords, stop: StopSignals | None, backend) -> tuple[dict, dict]:
    """The train split through the spool; returns (the split's manifest outputs, extras)."""
    spool = Spool(cfg.spool_dir)
    producer = Producer(spool, stage_dir, records, layout, int(cfg.spool_gb * 1e9), bad, stop,
                        backend, cfg.max_failures, give_up_s=cfg.stream_wait_s)
    limits = backend.chunk_limits()
    try:
        stats = producer.run(limits)
    finally:
        producer.heartbeat(force=True)
    for sub in ("train", "keep"):  # 04 is done with them
        _remove_tree(spool.root / sub)
    # and with the plan: a later run's 02b must not take this one's for its own
    for path in [spool.root / "plan.json", *spool.root.glob("consumer_r*.json"),
                 spool.root / "producer.json"]:
        remove_file(path)
    out = {"samples": len(records), "stream": True, "extracted": stats.extracted,
           "linked": stats.linked, "skipped_bad": stats.skipped, "failed": stats.failed,
           "prefill_tokens": stats.prefill_tokens, "tokens": 0, "bytes": 0}
    extra = {"stream": {"spool": str(spool.root), "budget_bytes": producer.budget,
                        "peak_bytes": stats.peak_bytes, "kept_records": len(producer.kept),
                        "epochs": len(producer.plan.epochs),
                        "prefill_passes": round(producer.prefill_share * len(producer.plan.epochs),
                                                4),
                        "rewinds": stats.rewinds, "evicted": stats.evicted,
                        "backpressure_s": round(stats.backpressure_s, 1),
                        "plan_wait_s": round(stats.plan_wait_s, 1)}}
    return out, extra


def _remove_tree(root: Path) -> None:
    if not root.exists():
        return
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir():
            path.rmdir()
        else:
            remove_file(path)
    root.rmdir()


# ---------------------------------------------------------------- the backends' stream sides


class HfStream:
    """The hf backend: one model for the offline splits and the stream."""

    def __init__(self, cfg, layers: list[int]):
        from eagle3.extract import hf
        from eagle3.extract.teacher import maybe_teacher

        self.cfg, self.layers, self.hf = cfg, layers, hf
        self.model = hf.load_model(cfg)
        self.teacher = maybe_teacher(cfg, self.model)

    def chunk_limits(self) -> tuple[int, int]:
        return self.cfg.max_batch_tokens, self.cfg.max_batch_size

    def offline(self, writers: dict) -> tuple[dict, dict]:
        return self.hf.extract_hf(self.model, writers, self.layers, self.cfg.dtype,
                                  self.cfg.max_batch_tokens, self.cfg.max_batch_size,
                                  self.teacher), {}

    def run_chunk(self, sink: StreamSink, batch: list[int], todo: set[int]) -> None:
        self.hf._extract_batch(self.model, sink, batch, todo, self.layers, self.cfg.dtype,
                               _NoProgress(), self.teacher)

    def close(self) -> None:
        pass


class _NoProgress:
    """The backends' progress hook, unused: the producer's bar counts in `written`."""

    @staticmethod
    def advance(tokens: int, nbytes: int) -> None:
        pass


class SglangStream:
    """The sglang backend: one client session (its own event loop) for both parts."""

    def __init__(self, cfg, layers: list[int], info):
        from eagle3.extract import sglang
        from eagle3.extract.teacher import maybe_teacher

        self.cfg, self.sglang = cfg, sglang
        self.teacher = maybe_teacher(cfg)
        self.expected = sglang.Expected(info.hidden_size, tuple(layers), cfg.target)
        self.loop = asyncio.new_event_loop()
        self.client = sglang.SglangExtractor(cfg, self.expected, self.teacher,
                                             getattr(cfg, "_tuning", None))
        self.loop.run_until_complete(self.client.__aenter__())
        self._preflight_done = False

    def preflight(self, writers: list) -> None:
        self.loop.run_until_complete(self.client.preflight(writers))
        self._preflight_done = True

    def chunk_limits(self) -> tuple[int, int]:
        return 1 << 62, 2 * self.client.concurrency

    def offline(self, writers: dict) -> tuple[dict, dict]:
        from dataclasses import asdict

        from eagle3.extract.writer import ExtractProgress

        outputs = {}
        for split, writer in writers.items():
            prog = ExtractProgress(writer, f"02b {split}")
            try:
                counts, _ = self.loop.run_until_complete(self.client.run_split(writer, prog))
            finally:
                prog.close()
            outputs[split] = {"samples": len(writer.records), **asdict(counts)}
        return outputs, {}

    def run_chunk(self, sink: StreamSink, batch: list[int], todo: set[int]) -> None:
        self.loop.run_until_complete(self.client._run([i for i in batch if i in todo], sink,
                                                      _NoProgress(), sink.p.failures))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.__aexit__(None, None, None))
        self.loop.close()
