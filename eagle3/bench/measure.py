"""Stage 05, shared by the server backends: measuring one server and reporting its figures.

For each prompt set and concurrency level, `max(prompts, 2 x concurrency)` requests (prompts
cycled) go to the server with at most `concurrency` in flight, through the backend's `send`
(SGLang's `/generate`: eagle3/bench/sglang.py; vLLM's `/v1/completions`: eagle3/bench/vllm.py).
How each figure is measured, on our own requests only:

- total output tok/s: sum of `completion_tokens` / wall time of the level (first request sent to
  last answer received);
- per-request output tok/s: mean over requests of `completion_tokens / latency`, latency being the
  client-side time from sending the request to its last byte;
- TTFT: client-side time from sending a request to the first streamed chunk carrying a token
  (`"stream": true`; the server emits a chunk as soon as the prefill produced the first token);
  None without streaming;
- acceptance length (SGLang): `sum(completion_tokens) / sum(spec_verify_ct)` over the level's
  requests (SGLang omits `spec_verify_ct` for a request that never ran a verify pass, as a
  one-token answer). On a speculative server an answer of 2 or more tokens without it, or a
  level without any verify round, leaves the figure None with the reason in
  `acceptance_error`; vLLM's comes from its `/metrics` counters (a `LevelProbe`);
- loop share: share of the output tokens inside repetition loops (eagle3/core/loops.py); the
  loop-free acceptance needs per-round lengths, which the servers do not report;
- speedup: speculative total tok/s / baseline total tok/s at the same prompt set and concurrency;
- lossless: at temperature 0 the speculative server must answer each prompt as the baseline did,
  beside how often the baseline disagrees with itself across concurrencies (`check_lossless`,
  eagle3/bench/compare.py, with the speedups).

Faults (eagle3/bench/faults.py): each request is retried with backoff on a server error, a
timeout, a cut stream or an answer whose counts cannot be (`check_answer`: more tokens than
asked, another prompt length, impossible verify rounds); one that fails every attempt is left
out of every figure, listed in `failed_requests.jsonl` and counted in its level's
`failed_requests`. A level whose requests fail many in a row sends no more. A SIGTERM abandons the level in flight and
raises `PartialRun` with the levels measured before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from eagle3.bench.compare import combine
from eagle3.bench.config import BenchmarkConfig
from eagle3.bench.faults import (
    FAILED_FILE,
    AnswerLimits,
    FailedRequest,
    FailureStreak,
    PartialRun,
    RequestFailed,
    check_answer,
    watch_for_stop,
    with_retries,
)
from eagle3.bench.prompts import PromptSet
from eagle3.core.faults import Interrupted, disk_error, is_disk_error
from eagle3.core.launcher import LaunchedServer
from eagle3.core.loops import loop_stats
from eagle3.core.progress import progress
from eagle3.core.records import JsonlAppender
from eagle3.core.target import read_target_info

log = logging.getLogger(__name__)

ROLES = ("baseline", "speculative")  # measured in this order, one server at a time
REQUESTS_FILE = "requests.jsonl"


@dataclass
class RequestRecord:
    """One benchmark request as the client saw it."""

    prompt_index: int
    rid: str
    output_ids: list[int]
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    spec_verify_ct: int | None  # None: the server reported no verify pass
    ttft_s: float | None  # None without streaming
    latency_s: float
    start_s: float  # since the level began
    attempts: int = 1  # > 1: retried; the figures are those of the last attempt


@dataclass
class LoadSettings:
    """What every request of a measurement sends and how."""

    sampling_params: dict
    stream: bool = True
    incremental_stream: bool = False  # the server's --incremental-streaming-output
    timeout_s: float = 3600.0  # per attempt of a request
    retries: int = 3  # attempts after the first
    retry_delay_s: float = 1.0  # first backoff; doubles each retry
    # SGLang's speculative server: its answers count their verify rounds (`spec_verify_ct`),
    # each of at most `round_tokens` (steps + 1; None: not known) tokens. vLLM's are counted
    # on /metrics instead (eagle3/bench/vllm_metrics.py).
    speculative: bool = False
    round_tokens: int | None = None
    vocab_size: int | None = None  # the target's (None: no --target); output ids stay below

    def warmup(self, max_new_tokens: int) -> LoadSettings:
        return dataclasses.replace(
            self, sampling_params={**self.sampling_params, "max_new_tokens": max_new_tokens})


# (session, base url, prompt ids, rid, load) -> (output ids, meta, TTFT s, latency s)
Send = Callable[..., Awaitable[tuple[list[int], dict, float | None, float]]]


class LevelProbe(Protocol):
    """Figures a server reports about a level beside its answers (vLLM's `/metrics`)."""

    async def before(self) -> Any: ...

    async def after(self, before: Any, records: list[RequestRecord], failed: int) -> dict:
        """The level's figures; `failed`: its requests that failed for good."""


async def run_level(base_url: str, prompts: list[list[int]], concurrency: int,
                    load: LoadSettings, tag: str, bar=None, *, send: Send,
                    failed: list[FailedRequest] | None = None,
                    stop=None) -> tuple[list[RequestRecord], float]:
    """All requests of one concurrency level; returns the good records and the wall time.
    `send`: the backend's request (eagle3/bench/sglang.py, eagle3/bench/vllm.py). A request
    that fails every attempt goes to `failed` (None: RequestFailed is raised). `stop` (a
    StopSignals): a signal abandons the level (Interrupted)."""
    n = max(len(prompts), 2 * concurrency)
    limit = asyncio.Semaphore(concurrency)
    streak = FailureStreak(max(4, concurrency))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t_level = time.perf_counter()

        async def one(i: int) -> RequestRecord | FailedRequest:
            async with limit:
                p = i % len(prompts)
                rid = f"bench-{tag}-{i}-{uuid.uuid4().hex[:8]}"
                start = time.perf_counter() - t_level
                try:
                    if streak.broken:
                        return FailedRequest(p, rid, 0, streak.reason())
                    record = await _attempts(session, base_url, prompts[p], p, rid, load, send)
                    record.start_s = start
                    streak.record(True)
                    return record
                except RequestFailed as e:
                    streak.record(False)
                    if failed is None:
                        raise
                    return FailedRequest(p, rid, e.attempts, str(e))
                finally:
                    if bar is not None:
                        bar.update(1)

        done = await watch_for_stop(asyncio.gather(*(one(i) for i in range(n))), stop)
        wall = time.perf_counter() - t_level
    for bad in (r for r in done if isinstance(r, FailedRequest)):
        log.warning("%s: prompt %d failed for good: %s", tag, bad.prompt_index, bad.reason)
        if failed is not None:
            failed.append(bad)
    return [r for r in done if isinstance(r, RequestRecord)], wall


async def _attempts(session, base_url: str, prompt: list[int], p: int, rid: str,
                    load: LoadSettings, send: Send) -> RequestRecord:
    """One request with its retries (eagle3/bench/faults.py); its good answer as a record."""
    limits = AnswerLimits(load.sampling_params["max_new_tokens"], len(prompt),
                          load.round_tokens if load.speculative else None, load.vocab_size,
                          fixed_length=bool(load.sampling_params.get("ignore_eos")))

    async def attempt(n: int):
        attempt_rid = rid if n == 0 else f"{rid}-retry{n}"  # a hung first attempt keeps its rid
        ids, meta, ttft, latency = await send(session, base_url, prompt, attempt_rid, load)
        counts = check_answer(ids, meta, dataclasses.replace(limits, rid=attempt_rid),
                              f"{base_url}: request {attempt_rid}")
        return ids, counts, ttft, latency

    (ids, c, ttft, latency), attempts = await with_retries(
        attempt, load.retries, load.retry_delay_s, f"{base_url}: request {rid}")
    return RequestRecord(p, rid, ids, c.completion_tokens, c.prompt_tokens, c.cached_tokens,
                         c.spec_verify_ct, ttft, latency, 0.0, attempts)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def acceptance_error(records: list[RequestRecord]) -> str | None:
    """Why a speculative server's acceptance cannot be figured from these answers; None when it
    can (every answer of 2 or more tokens reports its verify rounds, and there are some)."""
    unverified = [r for r in records if not r.spec_verify_ct and r.completion_tokens >= 2]
    if unverified:
        return (f"{len(unverified)} of {len(records)} answers of 2 or more tokens report no "
                "spec_verify_ct, though every token after the first needs a verify round: "
                "a server that does not decode with the draft, or does not report its rounds")
    if records and not any(r.spec_verify_ct for r in records):
        return (f"no verify rounds: the {len(records)} answers hold one token each (raise "
                "--max-new-tokens)")
    return None


def summarize_level(records: list[RequestRecord], wall_s: float, failed: int = 0,
                    speculative: bool = False) -> dict:
    """The figures of one level (definitions in the module docstring), over its good records;
    `failed`: requests of the level that failed for good (in no figure); `speculative`: the
    server decodes with a draft (its acceptance, or the reason it has none)."""
    tokens = sum(r.completion_tokens for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    verified = [r for r in records if r.spec_verify_ct]
    verify_ct = sum(r.spec_verify_ct for r in verified)
    error = acceptance_error(records) if speculative else None
    return {
        "requests": len(records),
        "failed_requests": failed,
        "retried_requests": sum(1 for r in records if r.attempts > 1),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "total_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "per_request_tok_s": sum(r.completion_tokens / r.latency_s for r in records)
        / max(len(records), 1),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "latency_mean_s": sum(r.latency_s for r in records) / max(len(records), 1),
        "acceptance_length": (sum(r.completion_tokens for r in verified) / verify_ct
                              if verify_ct and error is None else None),
        "acceptance_error": error,
        "spec_verify_ct": verify_ct,
        "requests_without_verify_ct": len(records) - len(verified),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "loop_share": loop_stats([r.output_ids for r in records]).share,
        "outputs": _outputs_by_prompt(records),  # for check_lossless
    }


def _outputs_by_prompt(records: list[RequestRecord]) -> dict[int, list[list[int]]]:
    """{prompt index: the output ids of each of its requests} (a level may send a prompt more
    than once: max(prompts, 2 x concurrency) requests)."""
    out: dict[int, list[list[int]]] = {}
    for r in records:
        out.setdefault(r.prompt_index, []).append(r.output_ids)
    return out


def measure_levels(base_url: str, role: str, prompt_sets: list[PromptSet],
                   concurrencies: list[int], load: LoadSettings, send: Send, sink=None,
                   bar=None, warmup_tokens: int = 16, probe: LevelProbe | None = None, *,
                   failed_sink=None, stop=None) -> dict:
    """{prompt set: {concurrency: summary}} of one server after one warm-up request; every
    good request goes to `sink.write(dict)` (a JsonlAppender) with its role, set and
    concurrency, every failed one to `failed_sink`; `probe`'s figures join each level's
    summary. `stop` (a StopSignals): a signal abandons the level in flight and raises
    PartialRun with the levels measured before it."""
    out: dict = {}

    async def go() -> None:
        warm_failed: list[FailedRequest] = []
        await run_level(base_url, prompt_sets[0].prompts[:1], 1, load.warmup(warmup_tokens),
                        f"{role}-warmup", send=send, failed=warm_failed, stop=stop)
        for ps in prompt_sets:
            out[ps.name] = {}
            for c in concurrencies:
                before = await probe.before() if probe is not None else None
                failed: list[FailedRequest] = []
                records, wall = await run_level(base_url, ps.prompts, c, load,
                                                f"{role}-{ps.name}-c{c}", bar, send=send,
                                                failed=failed, stop=stop)
                summary = summarize_level(records, wall, len(failed), load.speculative)
                if probe is not None:
                    summary.update(await probe.after(before, records, len(failed)))
                out[ps.name][str(c)] = summary
                log.info("%s %s c=%d: %s", role, ps.name, c, brief_level(summary))
                write_level_records(sink, role, ps, c, records)
                write_level_records(failed_sink, role, ps, c, failed)

    try:
        asyncio.run(go())
    except Interrupted as e:
        raise PartialRun(e.signum, {role: {k: v for k, v in out.items() if v}}) from None
    return out


def measure_roles(cfg: BenchmarkConfig, prompt_sets: list[PromptSet], stage_dir: Path,
                  measure_role: Callable, stop=None,
                  roles: tuple[str, ...] = ROLES) -> tuple[dict, dict, LoadSettings]:
    """Baseline, then each speculative server (`roles`, in order), one server at a time:
    (measured, servers, load) by role. `measure_role(role, load, sinks, bar)` serves the role
    and returns (server summary for results.json, its `measure_levels` answer); `sinks` holds
    `measure_levels`' sink, failed_sink and stop. A stop raises PartialRun holding what every
    role measured."""
    fixed = {"ignore_eos": True} if cfg.ignore_eos else {}  # SGLang's and vLLM's name alike
    load = LoadSettings({"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                         **fixed},
                        cfg.stream, timeout_s=cfg.request_timeout_s, retries=cfg.retries,
                        retry_delay_s=cfg.retry_delay_s,
                        vocab_size=(read_target_info(cfg.target).vocab_size
                                    if cfg.target is not None else None))
    n = sum(max(len(ps.prompts), 2 * c) for ps in prompt_sets for c in cfg.concurrency)
    bar = progress(total=len(roles) * n, desc="05 requests", unit="req")
    for name in (REQUESTS_FILE, FAILED_FILE):  # a re-run measures afresh
        (stage_dir / name).unlink(missing_ok=True)
    measured, servers = {}, {}
    try:
        with JsonlAppender(stage_dir / REQUESTS_FILE) as sink, \
                JsonlAppender(stage_dir / FAILED_FILE, fsync_every=1) as failed_sink:
            for role in roles:
                sinks = {"sink": sink, "failed_sink": failed_sink, "stop": stop}
                servers[role], measured[role] = measure_role(role, load, sinks, bar)
    except Interrupted as e:
        measured.update(getattr(e, "partial", {}))
        raise PartialRun(e.signum, partial_results(measured, servers)) from None
    except OSError as e:
        if not is_disk_error(e):
            raise
        raise disk_error(e, e.filename or stage_dir / REQUESTS_FILE) from e
    finally:
        bar.close()
    if not (stage_dir / FAILED_FILE).stat().st_size:
        (stage_dir / FAILED_FILE).unlink()  # only a run with failures lists them
    return measured, servers, load


def partial_results(measured: dict, servers: dict) -> dict:
    """What a stopped run keeps: the levels the baseline and the first speculative server
    finished (compared, with what the further ones finished), and those only the baseline
    finished."""
    base, spec = measured.get("baseline", {}), measured.get("speculative", {})
    others = {role: sets for role, sets in measured.items() if role not in ROLES}
    only = {name: {c: s for c, s in levels.items() if c not in spec.get(name, {})}
            for name, levels in base.items()}
    return {"servers": servers, "prompt_sets": combine(base, spec, others or None),
            "baseline_only": {name: levels for name, levels in only.items() if levels}}


@contextlib.contextmanager
def attached_or_launched(cfg: BenchmarkConfig, role: str, command: Callable[[], list[str]],
                         stage_dir: Path, url: str | None = None,
                         **launch) -> Iterator[tuple[str, Path | None]]:
    """(url, log path or None) of the role's server: the one given by URL (attached: `url`,
    else --baseline-url or the first --spec-url), or `command()` launched on `--port` for the
    block, its log in `server_<role>.log`."""
    if cfg.launch_args is None:
        yield url or (cfg.baseline_url if role == "baseline" else cfg.spec_url[0]), None
        return
    url, log_path = f"http://127.0.0.1:{cfg.port}", stage_dir / f"server_{role}.log"
    with LaunchedServer(command(), log_path, url, cfg.ready_timeout_s, **launch):
        yield url, log_path


def write_level_records(sink, role: str, ps, concurrency: int, records) -> None:
    """One line per request (a RequestRecord or a FailedRequest) of a level to `sink` (None:
    nothing), tagged with where it ran."""
    if sink is None:
        return
    for r in records:
        sink.write({"role": role, "prompt_set": ps.name, "concurrency": concurrency,
                    "prompt_id": ps.ids[r.prompt_index] if ps.ids else None, **asdict(r)})


def brief_level(s: dict) -> str:
    """One log line of a level's summary: speed, and acceptance with the loop share beside it."""
    acc, failed = s["acceptance_length"], s.get("failed_requests")
    return (f"{s['total_tok_s']:.1f} tok/s total, {s['per_request_tok_s']:.1f} per request"
            + (f", acceptance {acc:.3f} (loop share {s['loop_share']:.0%})"
               if acc is not None else "")
            + (f", {failed} requests FAILED (not counted)" if failed else ""))
