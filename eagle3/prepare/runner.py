"""Stage 01 orchestration: every dataset of a recipe, in chunks, over a pool of processes.

Chunks of all datasets go to one pool of spawned worker processes (round robin over the
datasets, so they run in parallel), at most two per worker in flight; each worker loads the
target's tokenizer once. A dataset is assembled as soon as its chunks are in (eagle3.prepare.rows)
and marked done with `done.json`, which carries a fingerprint of everything that decides its
content (recipe entry, source files, chunk size, tokenizer files, template kwargs): a re-run
skips a done dataset whose fingerprint matches and resumes the others from their finished
chunks; one whose fingerprint changed is redone from scratch (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import queue
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from eagle3.core.chat import ChatRenderer
from eagle3.core.progress import progress
from eagle3.core.stage import atomic_write_json
from eagle3.prepare.recipes import DatasetSpec
from eagle3.prepare.rows import (
    RowContext,
    assemble,
    good_ids,
    load_chunk_meta,
    process_chunk,
    remove_parts,
)
from eagle3.prepare.sources import RowSource, describe
from eagle3.prepare.validate import max_token_chars

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tiktoken.model",
                   "tokenizer.model", "vocab.json", "merges.txt")


@dataclass
class RenderSettings:
    """How every worker renders: the target's tokenizer and template kwargs."""

    target: Path
    template_kwargs: dict = field(default_factory=dict)
    end_of_turn: str | None = None
    verify_every: int = 100
    exact: bool = False
    trust_remote_code: bool = False  # --trust-remote-code: the tokenizer may be the folder's code

    def fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps([self.template_kwargs, self.end_of_turn, self.exact],
                                      sort_keys=True).encode())
        for name in TOKENIZER_FILES:
            p = Path(self.target) / name
            if p.is_file():
                h.update(name.encode() + p.read_bytes())
        return h.hexdigest()[:16]


def build_context(settings: RenderSettings, tokenizer=None) -> RowContext:
    from eagle3.core.target import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.target,
                                                                      settings.trust_remote_code)
    renderer = ChatRenderer(tokenizer, settings.template_kwargs, settings.end_of_turn)
    return RowContext(renderer, settings.verify_every, settings.exact,
                      max_token_chars(tokenizer))


_WORKER: dict = {}  # the worker process's RowContext, set once by its initializer


def _init_worker(settings: RenderSettings) -> None:
    _WORKER["ctx"] = build_context(settings)


def _run_task(spec: DatasetSpec, chunk: int, rows: list, parts: Path) -> dict:
    return process_chunk(spec, chunk, rows, parts, _WORKER["ctx"])


class _InlinePool:
    """The pool interface, run in this process (one worker: no spawn, easy to debug)."""

    def __init__(self, ctx: RowContext):
        _WORKER["ctx"] = ctx

    def apply_async(self, fn, args, callback, error_callback):
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the caller as a pool would
            error_callback(e)
        else:
            callback(result)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        _WORKER.pop("ctx", None)


@dataclass
class DatasetRun:
    """One dataset being prepared: its row order, finished chunks and count progress."""

    spec: DatasetSpec
    out_dir: Path
    source: RowSource
    chunk_size: int
    fingerprint: str
    metas: dict = field(default_factory=dict)
    next_chunk: int = 0
    in_flight: int = 0
    contiguous: int = 0  # chunks 0..contiguous-1 are finished
    records: int = 0  # distinct good ids in those chunks
    n_chunks: int | None = None  # known for random-access sources; found at the end otherwise
    enough_at: int | None = None  # chunks needed to reach `count`
    seen: set = field(default_factory=set)
    _order: np.ndarray | range | None = None
    _stream: Iterator | None = None

    def __post_init__(self) -> None:
        if self.source.random_access:
            n = len(self.source)
            self._order = (range(n) if self.spec.sample == "head"
                           else np.random.default_rng(self.spec.seed).permutation(n))
            self.n_chunks = math.ceil(n / self.chunk_size)
        else:
            self._stream = iter(self.source.stream())

    @property
    def parts(self) -> Path:
        return self.out_dir / "parts"

    def wants_more(self) -> bool:
        if self.enough_at is not None or (self.n_chunks is not None
                                          and self.next_chunk >= self.n_chunks):
            return False
        if self.spec.count is None:
            return True
        # Speculate no further than the chunks the remaining count needs, at the good-row
        # rate seen so far (all chunks are kept on disk, so overshoot only costs time).
        done_rows = sum(m["rows"] for m in self.metas.values()) or 1
        rate = max(0.05, sum(len(good_ids(m)) for m in self.metas.values()) / done_rows) \
            if self.metas else 1.0
        need = (self.spec.count - self.records) / (rate * self.chunk_size)
        return self.in_flight < max(1, math.ceil(need))

    def next_task(self) -> tuple[int, list] | None:
        """The next unfinished chunk and its rows; None when the source is exhausted."""
        while self.wants_more():
            chunk = self.next_chunk
            self.next_chunk += 1
            rows = self._rows(chunk)
            if not rows:
                self.n_chunks = chunk
                return None
            if chunk in self.metas:
                continue  # finished by an earlier run
            self.in_flight += 1
            return chunk, rows
        return None

    def _rows(self, chunk: int) -> list:
        if self._stream is not None:  # streaming: consume in order (skipped chunks too)
            return [row for _, row in zip(range(self.chunk_size), self._stream)]
        positions = self._order[chunk * self.chunk_size: (chunk + 1) * self.chunk_size]
        if chunk in self.metas:
            return [None] * len(positions)  # finished: no need to read it
        return self.source.rows([int(p) for p in positions])

    def add(self, meta: dict) -> None:
        """Record a finished chunk and advance the in-order count."""
        self.metas[meta["chunk"]] = meta
        while self.contiguous in self.metas and self.enough_at is None:
            for rid in good_ids(self.metas[self.contiguous]):
                if rid not in self.seen:
                    self.seen.add(rid)
                    self.records += 1
            self.contiguous += 1
            if self.spec.count is not None and self.records >= self.spec.count:
                self.enough_at = self.contiguous

    def finished(self) -> bool:
        if self.enough_at is not None:
            return True
        return self.n_chunks is not None and self.contiguous >= self.n_chunks


def open_run(spec: DatasetSpec, out_dir: Path, source: RowSource, chunk_size: int,
             render_fp: str) -> DatasetRun | dict:
    """A DatasetRun resuming from finished chunks, or the counts of a dataset already done."""
    key = {"spec": spec.content_key(), "source": describe(source), "chunk_size": chunk_size,
           "render": render_fp}
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    done = out_dir / "done.json"
    if done.exists():
        counts = json.loads(done.read_text())
        if counts.get("fingerprint") == fp:
            log.info("%s: already prepared (%d records), skipping", spec.name, counts["records"])
            remove_parts(out_dir)
            return counts
    plan = out_dir / "plan.json"
    if out_dir.exists() and (not plan.exists() or json.loads(plan.read_text()).get("fp") != fp):
        log.warning("%s: recipe entry, source or tokenizer changed since the last run: "
                    "preparing it again from scratch", spec.name)
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(plan, {"fp": fp, "key": key})
    run = DatasetRun(spec, out_dir, source, chunk_size, fp)
    run.parts.mkdir(exist_ok=True)
    for meta_path in sorted(run.parts.glob("c*.meta.json")):
        run.add(load_chunk_meta(run.parts, int(meta_path.name[1:7])))
    if run.metas:
        log.info("%s: resuming, %d chunks already finished", spec.name, len(run.metas))
    return run


def finish_run(run: DatasetRun) -> dict:
    n = run.enough_at if run.enough_at is not None else run.contiguous
    counts = assemble(run.spec, run.out_dir, n)
    counts["fingerprint"] = run.fingerprint
    if run.spec.count is not None and counts["records"] < run.spec.count:
        log.warning("%s: only %d usable records, the recipe asks for %d", run.spec.name,
                    counts["records"], run.spec.count)
    atomic_write_json(run.out_dir / "done.json", counts)
    if run.in_flight == 0:
        remove_parts(run.out_dir)
    return counts


def run_prepare(runs: list[DatasetRun], settings: RenderSettings, num_workers: int,
                tokenizer=None) -> dict[str, dict]:
    """Prepare every run; returns {dataset: counts} as each is assembled."""
    results: dict[str, dict] = {}
    if not runs:
        return results
    events: queue.Queue = queue.Queue()
    total = sum(_expected_rows(r) for r in runs)
    bar = progress(total=total, desc="01 prepare", unit="row")
    bar.update(sum(m["rows"] for r in runs for m in r.metas.values()))
    t0, tokens = time.perf_counter(), 0
    by_name = {r.spec.name: r for r in runs}
    with _make_pool(settings, num_workers, tokenizer) as pool:
        pending = list(runs)
        while True:
            _fill(pool, pending, runs, events, 2 * num_workers)
            pending = [r for r in pending if not _maybe_finish(r, results)]
            if not any(r.in_flight for r in runs):
                assert not pending, f"stalled datasets: {[r.spec.name for r in pending]}"
                break
            kind, name, payload = events.get()
            if kind == "error":
                raise payload
            run = by_name[name]
            run.in_flight -= 1
            bar.update(payload["rows"])
            if name in results:
                continue  # a chunk past `count`, finished after the dataset was assembled
            run.add(payload)
            tokens += sum(o[2] for o in payload["outcomes"] if o[0] is not None)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):,.0f}",
                            done=f"{len(results)}/{len(runs)}", refresh=False)
    bar.close()
    for r in runs:
        remove_parts(r.out_dir)  # chunks past `count` that were still in flight
    return results


def _maybe_finish(run: DatasetRun, results: dict) -> bool:
    if run.finished():
        results[run.spec.name] = finish_run(run)
        return True
    return False


def _fill(pool, pending: list[DatasetRun], runs: list[DatasetRun], events: queue.Queue,
          limit: int) -> None:
    """Submit chunks of pending datasets, round robin, until `limit` are in flight."""
    progressed = True
    while sum(r.in_flight for r in runs) < limit and progressed:
        progressed = False
        for run in pending:
            if sum(r.in_flight for r in runs) >= limit:
                break
            task = run.next_task()
            if task is None:
                continue
            chunk, rows = task
            name = run.spec.name
            pool.apply_async(_run_task, (run.spec, chunk, rows, run.parts),
                             callback=lambda m, n=name: events.put(("ok", n, m)),
                             error_callback=lambda e, n=name: events.put(("error", n, e)))
            progressed = True


def _make_pool(settings: RenderSettings, num_workers: int, tokenizer):
    if num_workers <= 1:
        return _InlinePool(build_context(settings, tokenizer))
    ctx = multiprocessing.get_context("spawn")  # fork would copy tokenizer threads' state
    return ctx.Pool(num_workers, initializer=_init_worker, initargs=(settings,))


def _expected_rows(run: DatasetRun) -> int:
    if run.source.random_access:
        n = len(run.source)
        return n if run.spec.count is None else min(n, run.spec.count)
    return run.spec.count or 0


def source_warnings(datasets: dict[str, dict], max_loss: float) -> list[str]:
    """A line for each dataset that gave no record, or lost more than `max_loss` of its rows."""
    out = []
    for name, c in datasets.items():
        read, bad = c["rows_read"], c["quarantined"]
        top = ", ".join(f"{k} {n}" for k, n in sorted(c["quarantine_reasons"].items(),
                                                      key=lambda kv: (-kv[1], kv[0]))[:3])
        if c["records"] == 0:
            out.append(f"{name}: no record out of {read} rows read"
                       + (f" (quarantined: {top})" if bad else " (the source holds no row)"))
        elif read and bad / read > max_loss:
            out.append(f"{name}: {bad} of {read} rows quarantined ({100 * bad / read:.0f}% > "
                       f"--max-loss {100 * max_loss:.0f}%): {top}")
    return out
