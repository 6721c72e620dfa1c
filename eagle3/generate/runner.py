"""Driving a server backend of stage 01b over many prompts, for days, without losing a sample.

- One pool for every dataset: the jobs of all the datasets regenerated go through one set of
  workers (each dataset a `Route`: its jobs, its sink, its counts), dataset after dataset in the
  order given, so that the next dataset's requests fill the places the last long replies of the
  one before leave free (run one dataset after another, each ended with a tail of a few
  replies running almost alone on the server). Each answer goes to its own dataset's files.
- Bounded concurrency: `concurrency` requests in flight (150-200 suit SGLang up to ~10K context),
  over the whole pool. Jobs whose prompt plus generation budget exceed `long_context_threshold`
  tokens, of every dataset, run in a second pass at `long_concurrency`, so that a few long
  requests cannot exhaust the KV cache of a server full of short ones.
- Retries: a request that fails transiently (5xx, 429, timeout, dropped connection, an aborted
  generation) is retried with exponential backoff; after `max_attempts` attempts, or at once for
  an answer that cannot become a record (truncated prompt, template mismatch, 4xx), the record
  goes to the failures file with the reason.
- Outages: a refused connection says nothing about the request, so it costs no attempt; the
  server is marked down (a pool sends elsewhere), probed every `poll_s` (each probe waiting up
  to `probe_timeout_s` for its answer), and when every server has been down for
  `server_down_timeout_s` the run stops with ServerDownError (re-run resumes). A server that
  answers its probe while its generation endpoint cannot be reached (a redirect to a dead
  address, a proxy) is not down: the refusal counts as the record's failed attempt, and
  `max_attempts` such refusals in a row with no answer between stop the run (ServerDownError),
  instead of an endless "unreachable" / "reachable again" loop.
- Signals: the first SIGINT/SIGTERM stops sending new requests and lets those in flight finish;
  a second abandons them (SGLang is asked to abort them); the run then raises
  `eagle3.core.faults.Interrupted` after flushing what was written (the script ends with a line
  saying how to resume and exit code 128 + the signal). Output order follows completion, so
  resume is by record id.
- A full disk (DiskError from the sink) stops the run at once; the answers in flight are lost
  and generated again by the re-run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Iterator

import aiohttp

from eagle3.core.faults import DiskError, Interrupted
from eagle3.core.server import (
    RetryPolicy,
    ServerError,
    ServerPool,
    TransientError,
    get_json,
    is_reachable,
    make_session,
    served_model,
    wait_ready,
)
from eagle3.core.stage import StageError
from eagle3.generate.backends import RecordFailure
from eagle3.generate.jobs import GenerationJob, RecordSink

log = logging.getLogger(__name__)


# How to resume a 01b run stopped by a signal (`Interrupted`, ended by `script_main` with one
# stderr line and exit code 128 + the signal).
RESUME = "re-run the same command to resume (only the missing records are generated)"


class ServerDownError(ServerError):
    """Every server stayed unreachable longer than allowed."""


class ConnectError(StageError):
    """A server of the pool that never became usable before the first request: names its URL,
    what it answered and the fix (one line, exit 1)."""


@dataclass
class RunnerConfig:
    """01b's flags of the same names, resolved (their defaults live in 01b's GenerateConfig)."""

    concurrency: int  # requests in flight in the first pass
    long_concurrency: int  # requests in flight in the long-context pass
    long_context_threshold: int  # prompt + budget tokens above which a job is "long"
    max_attempts: int  # attempts per record before it goes to the failures file
    server_down_timeout_s: float  # how long every server may stay unreachable
    poll_s: float  # how often an unreachable server is probed
    probe_timeout_s: float  # how long one probe waits for its answer


def partition(jobs: list[GenerationJob], threshold: int):
    """(short, long) jobs by prompt + generation budget against `threshold` tokens."""
    short = [j for j in jobs if j.context_tokens <= threshold]
    long = [j for j in jobs if j.context_tokens > threshold]
    return short, long


class ServerWatch:
    """Marks unreachable servers down, probes them, and holds requests while all are down."""

    def __init__(self, session, pool: ServerPool, probe_path: str, cfg: RunnerConfig):
        self.session, self.pool, self.probe_path, self.cfg = session, pool, probe_path, cfg
        self.up = asyncio.Event()
        self.up.set()
        self.down_since: float | None = None  # when the last up server went down
        self.outages = 0
        # refusals in a row, with no answer between, of servers that answered their probe
        self.endpoint_refusals = 0
        self._probes: dict[str, asyncio.Task] = {}

    def answered(self) -> None:
        """A request got its answer: the generation endpoints are reachable."""
        self.endpoint_refusals = 0

    async def unreachable(self, url: str, error: Exception) -> bool:
        """Called when `url` refused a connection (`error`). True once some server is up again
        after an outage (the attempt costs nothing); False when `url` answers its probe, so the
        server is up and its generation endpoint is not: the attempt counts as failed, and
        `max_attempts` of those in a row raise ServerDownError."""
        if url not in self.pool.down and await is_reachable(
                self.session, url, self.probe_path, self.cfg.probe_timeout_s):
            self.endpoint_refusals += 1
            if self.endpoint_refusals >= self.cfg.max_attempts:
                raise ServerDownError(
                    f"{url} answers {self.probe_path}, but {self.endpoint_refusals} requests in "
                    f"a row could not reach its generation endpoint (last: {error}): is "
                    "--server-url the server itself, not a proxy or a redirect to another "
                    "address? Fix it, then re-run the same command to resume")
            return False
        if url not in self.pool.down:
            self.pool.down.add(url)
            self.outages += 1
            log.warning("%s is unreachable; sending elsewhere if possible and probing it every "
                        "%.0fs", url, self.cfg.poll_s)
            self._probes[url] = asyncio.create_task(self._probe(url))
        if self.pool.all_down():
            if self.up.is_set():
                self.up.clear()
                self.down_since = time.monotonic()
            left = self.cfg.server_down_timeout_s - (time.monotonic() - self.down_since)
            try:
                await asyncio.wait_for(self.up.wait(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                raise ServerDownError(
                    f"no server reachable for {self.cfg.server_down_timeout_s:.0f}s "
                    f"({', '.join(self.pool.urls)}): restart the server, then re-run the same "
                    "command to resume") from None
        return True

    async def _probe(self, url: str) -> None:
        await wait_ready(self.session, url, (self.probe_path,), math.inf, self.cfg.poll_s,
                         request_timeout_s=self.cfg.probe_timeout_s, any_status=True)
        self.pool.down.discard(url)
        self.up.set()
        log.warning("%s is reachable again", url)

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()


@dataclass
class Route:
    """One dataset's part of a pooled run: its jobs, the sink its answers go to, and what its
    requests did (filled in by the run)."""

    name: str
    jobs: list[GenerationJob]
    sink: RecordSink
    counts: dict = field(default_factory=lambda: {"requests": 0, "retries": 0, "abandoned": 0,
                                                  "max_inflight": 0})
    stats: dict = field(default_factory=dict)  # its share of the backend's counters
    seconds: float = 0.0  # from its first request sent to its last answer
    # the pool's requests per server when its last answer came (cumulative over the run)
    servers: dict = field(default_factory=dict)
    left: int = -1  # jobs without an answer yet (-1: not started)
    started: float | None = None

    def result(self) -> dict:
        """The dataset's counts, in the manifest's order: its requests, then its sink's."""
        return {**self.counts, **self.sink.counts, "seconds": round(self.seconds, 1),
                "servers": self.servers, **self.stats}


class GenerationRun:
    """The jobs of one or several datasets (`routes`) through one backend: one pool of
    requests, each answer into its own route's sink; `await run(session)` fills each route's
    counts and returns the pool's."""

    def __init__(self, backend, routes: list[Route], cfg: RunnerConfig, policy: RetryPolicy,
                 bar):
        self.backend, self.routes, self.cfg, self.policy, self.bar = (backend, routes, cfg,
                                                                     policy, bar)
        self.stopping = False
        self.signum: int | None = None
        self.fatal: BaseException | None = None
        # (dataset, record id) -> (route, job): two datasets may hold the same record id
        self.inflight: dict[tuple[str, str], tuple[Route, GenerationJob]] = {}
        self.workers: list[asyncio.Task] = []
        self._aborts: list[asyncio.Task] = []
        self.max_inflight = 0

    async def run(self, session: aiohttp.ClientSession) -> dict:
        self.watch = ServerWatch(session, self.backend.pool, self.backend.probe_path, self.cfg)
        self.session = session
        short, long = [], []
        for route in self.routes:  # dataset after dataset: the order the pool sends them in
            s, lg = partition(route.jobs, self.cfg.long_context_threshold)
            route.counts.update(short_jobs=len(s), long_jobs=len(lg))
            route.stats = {k: 0 for k in self.backend.stats}
            route.left = len(route.jobs)
            if not route.jobs:  # resumed whole: nothing to send
                route.servers = dict(self.backend.pool.sent)
            short += [(route, j) for j in s]
            long += [(route, j) for j in lg]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        ticker = asyncio.create_task(self._tick())
        t0 = time.monotonic()
        try:
            for part, conc in ((short, self.cfg.concurrency), (long, self.cfg.long_concurrency)):
                if part and not self.stopping:
                    if part is long:
                        log.info("long-context pass: %d jobs over %d tokens at concurrency %d",
                                 len(long), self.cfg.long_context_threshold, conc)
                    await self._pass(part, conc)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            ticker.cancel()
            self.watch.close()
            for route in self.routes:
                route.sink.flush()
            if self._aborts:
                await asyncio.wait(self._aborts, timeout=10.0)
        if self.fatal is not None:
            raise self.fatal
        if self.signum is not None:
            raise Interrupted(self.signum, RESUME)
        return {"requests": sum(r.counts["requests"] for r in self.routes),
                "max_inflight": self.max_inflight, "seconds": round(time.monotonic() - t0, 1)}

    async def _pass(self, jobs: list[tuple[Route, GenerationJob]], concurrency: int) -> None:
        it = iter(jobs)  # shared by the workers: each pulls the next job when it is free
        self.workers = [asyncio.create_task(self._worker(it))
                        for _ in range(min(concurrency, len(jobs)))]
        try:
            await asyncio.gather(*self.workers)
        except asyncio.CancelledError:
            if self.signum is None and self.fatal is None:  # cancelled from outside
                raise
        except BaseException:
            for w in self.workers:
                w.cancel()
            await asyncio.gather(*self.workers, return_exceptions=True)
            raise

    async def _worker(self, it: Iterator[tuple[Route, GenerationJob]]) -> None:
        while not self.stopping:
            route, job = next(it, (None, None))
            if job is None:
                return
            key = (route.name, job.id)
            self.inflight[key] = (route, job)
            self.max_inflight = max(self.max_inflight, len(self.inflight))
            route.counts["max_inflight"] = max(route.counts["max_inflight"], len(self.inflight))
            if route.started is None:
                route.started = time.monotonic()
            try:
                await self._one(route, job)
            except asyncio.CancelledError:
                route.counts["abandoned"] += 1
                raise
            except ServerDownError as e:  # the first says it; others may follow it
                self.fatal, self.stopping = self.fatal or e, True
                return
            finally:
                self.inflight.pop(key, None)
            self._answered(route)

    def _answered(self, route: Route) -> None:
        """A job of `route` ended in its sink (a record or a failure)."""
        self.bar.update(1)
        route.left -= 1
        if route.left == 0:
            route.seconds = time.monotonic() - route.started
            route.servers = dict(self.backend.pool.sent)
            if len(self.routes) > 1:
                log.info("%s: every answer in (%d jobs in %.1fs)", route.name,
                         len(route.jobs), route.seconds)

    async def _one(self, route: Route, job: GenerationJob) -> None:
        """Generate one record, retrying; it ends in its route's sink as a record or a
        failure."""
        attempt, sink = 0, route.sink
        while True:
            route.counts["requests"] += 1
            try:
                answer = await self.backend.request(self.session, job, attempt)
                self.watch.answered()
                record, raw = self._to_record(route, job, answer, attempt)
                sink.add(record, raw)
                return
            except TransientError as e:
                # a server down: wait for it, costs no attempt (unless it answers its probe)
                if e.unreachable and await self.watch.unreachable(e.server, e):
                    continue
                attempt += 1
                if attempt >= self.cfg.max_attempts:
                    sink.fail(job.id, f"gave up after {attempt} attempts", str(e), attempt)
                    return
                route.counts["retries"] += 1
                await asyncio.sleep(self.policy.delay_s(attempt))
            except RecordFailure as e:  # not retried: this answer is final
                sink.fail(job.id, str(e).split(":")[0], str(e), attempt + 1)
                return
            except ServerError as e:  # a 4xx: the server refuses this request
                sink.fail(job.id, "refused by the server", str(e), attempt + 1)
                return

    def _to_record(self, route: Route, job: GenerationJob, answer: dict,
                   attempt: int) -> tuple[dict, dict]:
        """The backend's record of an answer; what it counts on the way (its `stats`) is
        credited to `route`: the call does not yield, so no other answer is counted between."""
        before = dict(self.backend.stats)
        try:
            return self.backend.to_record(job, answer, attempt)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            # A shape of answer the backend's checks did not foresee: this record fails (never
            # written as good) and the run goes on.
            raise RecordFailure(f"malformed answer: {e!r} ({str(answer)[:200]})") from e
        finally:
            for k, v in self.backend.stats.items():
                route.stats[k] = route.stats.get(k, 0) + v - before.get(k, 0)

    def _on_signal(self, signum: int) -> None:
        if self.signum is None:
            self.signum, self.stopping = signum, True
            log.warning("%s: sending no new requests; waiting for the %d in flight (send it "
                        "again to abandon them)", signal.Signals(signum).name, len(self.inflight))
            return
        log.warning("%s again: abandoning %d requests in flight", signal.Signals(signum).name,
                    len(self.inflight))
        abort = getattr(self.backend, "abort", None)
        if abort is not None:
            for _, job in list(self.inflight.values()):
                self._aborts.append(asyncio.get_running_loop().create_task(
                    abort(self.session, job)))
        for w in self.workers:
            w.cancel()

    async def _tick(self) -> None:
        """Refresh the progress bar's figures and flush the outputs once a second."""
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            tokens = sum(r.sink.counts["output_tokens"] for r in self.routes)
            failed = sum(r.sink.counts["failed"] for r in self.routes)
            tok_s = tokens / max(time.monotonic() - t0, 1e-9)
            self.bar.set_postfix_str(f"out {tok_s:,.0f} tok/s | failed {failed} | "
                                     f"in flight {len(self.inflight)}", refresh=False)
            try:
                for r in self.routes:
                    r.sink.flush()
            except DiskError as e:  # the disk is full: stop now, the answers in flight are lost
                self.fatal, self.stopping = e, True
                for w in self.workers:
                    w.cancel()
                return


def run_pooled(routes: list[Route], backend, cfg: RunnerConfig, policy: RetryPolicy,
               bar) -> dict:
    """Run every route's jobs through a server backend in one pool (blocking); each route's
    counts are filled in, the pool's returned."""

    async def go() -> dict:
        async with make_session(max(cfg.concurrency, cfg.long_concurrency) + 8) as session:
            return await GenerationRun(backend, routes, cfg, policy, bar).run(session)

    return asyncio.run(go())


def connect(backend, timeout_s: float, poll_s: float, probe_timeout_s: float,
            headers: dict | None = None) -> None:
    """Wait until every server of the backend answers (asking every `poll_s`, each probe
    waiting up to `probe_timeout_s`); fill in the openai served model name. ConnectError when
    one does not come up, answers something else than the API (an HTML page), or lists no
    model."""

    async def go() -> None:
        async with make_session(8) as session:
            for url in backend.pool.urls:
                if backend.name == "sglang":
                    info = await wait_ready(session, url, timeout_s=timeout_s, poll_s=poll_s,
                                            request_timeout_s=probe_timeout_s)
                    log.info("%s ready: %s", url, info.get("model_path", info))
                else:
                    await wait_ready(session, url, ("/v1/models", "/health"), timeout_s, poll_s,
                                     request_timeout_s=probe_timeout_s, headers=headers)
            if backend.name == "openai" and not backend.model:
                url = backend.pool.urls[0]
                models = await get_json(session, url, ("/v1/models",), probe_timeout_s,
                                        headers=headers)
                backend.model = served_model(models, url)
                log.info("served model: %s", backend.model)

    try:
        asyncio.run(go())
    except ServerError as e:
        raise ConnectError(f"{e}. Check --server-url (and --served-model), then re-run the "
                           "same command") from None
