"""Stage 05's faults: a server that errs, hangs, cuts its answer or miscounts it, and a stop.

- `send_with_retries`: one benchmark request, each attempt bounded by `--request-timeout-s`,
  retried `--retries` times with exponential backoff (jittered) on HTTP 5xx / 429, a timeout, a
  dropped connection or a bad answer; then `RequestFailed`. The figures of a retried request
  are those of its successful attempt (its record says how many attempts it took).
- `check_answer`: every count of an answer against what is possible (`AnswerLimits`). It is
  bad (`BadAnswer`, retried) when it names another request (`meta_info.id`, as 01b checks), its
  ids are not token ids, lie outside the target's vocabulary or are more than `max_new_tokens`, a
  count is not a non-negative int (null: not reported), `completion_tokens` disagrees with the
  ids it carried, `prompt_tokens` with the ids sent, `cached_tokens` exceeds the prompt,
  `spec_verify_ct` is more than the tokens (acceptance below 1) or too few for them (more than
  `steps + 1` tokens a round after the prefill's), when it holds fewer tokens than asked
  without a finish reason (a stream cut half-way), or when the server aborted it. A bad answer
  never counts in tokens/s or acceptance.
- `FailedRequest`: what 05 keeps of a request that failed for good: one line of
  `05_benchmark/failed_requests.jsonl`, counted per level in results.json and the summary.
- `PartialRun`: a SIGTERM / SIGINT mid-benchmark, carrying what was measured before it; the
  stage writes it as a partial results.json (never a complete stage) and exits 128 + signal.
- `BenchmarkError`: a server or preflight failure as a `StageError` (one stderr line, exit 1).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from eagle3.core.faults import Interrupted, StopSignals
from eagle3.core.preflight import PreflightError
from eagle3.core.server import (
    RETRY_STATUS,
    BadAnswer,
    RetryPolicy,
    ServerError,
    TransientError,
    check_generated,
    check_rid,
    finish_kind,
)
from eagle3.core.stage import StageError

log = logging.getLogger(__name__)

FAILED_FILE = "failed_requests.jsonl"  # in 05_benchmark/: one line per request failed for good
RESUME = ("results.json holds what was measured before the stop, marked partial; re-run the "
          "same command to measure afresh")


class BenchmarkError(StageError):
    """A server that could not be started, reached or used: names it and the fix."""


class BenchmarkRefused(BenchmarkError, PreflightError):
    """A preflight refusal (the draft, a server's flags) as a stage error: still a
    PreflightError for the callers that look for one."""


class RequestFailed(ServerError):
    """A request that failed every attempt; the message is the last attempt's error."""

    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


class PartialRun(Interrupted):
    """Stopped by a signal; `partial` holds the results measured before it."""

    def __init__(self, signum: int, partial: dict):
        super().__init__(signum, RESUME)
        self.partial = partial


@dataclass
class FailedRequest:
    """A request that failed for good: not measured, listed in failed_requests.jsonl."""

    prompt_index: int
    rid: str
    attempts: int  # 0: not sent (the level was given up after failures in a row)
    reason: str


@dataclass(frozen=True)
class AnswerLimits:
    """What the answer to one request can hold."""

    max_new_tokens: int  # the budget sent
    prompt_tokens: int  # the ids sent
    # A speculative server's: the most tokens one verify round commits (steps + 1; None: no
    # bound known, or no draft).
    round_tokens: int | None = None
    vocab_size: int | None = None  # the target's (None: no --target): no output id reaches it
    rid: str | None = None  # the request's id, which SGLang's meta_info.id echoes
    fixed_length: bool = False  # ignore_eos sent: every answer holds max_new_tokens


@dataclass(frozen=True)
class AnswerCounts:
    """An answer's counts, checked (`check_answer`)."""

    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    spec_verify_ct: int | None  # None: not reported


def _count(meta: dict, key: str, what: str) -> int | None:
    """meta[key] as a count; None when absent or null (not reported)."""
    value = meta.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise BadAnswer(f"{what}: meta_info.{key} is {repr(value)[:60]}, not a count")
    return value


def check_answer(ids: list[int], meta: dict, limits: AnswerLimits, what: str) -> AnswerCounts:
    """The answer's counts; BadAnswer for one whose counts cannot be (module docstring)."""
    if not isinstance(meta, dict):
        raise BadAnswer(f"{what}: meta_info is {repr(meta)[:100]}, not an object")
    if limits.rid is not None:
        check_rid(meta, limits.rid, what)
    n = check_generated(ids, meta.get("completion_tokens"), limits.max_new_tokens, what,
                        limits.vocab_size)
    sent = limits.prompt_tokens
    prompt, cached, verify = (_count(meta, k, what) for k in (
        "prompt_tokens", "cached_tokens", "spec_verify_ct"))
    if prompt is not None and prompt != sent:
        raise BadAnswer(f"{what}: the server counted {prompt} prompt tokens, {sent} were sent")
    if cached is not None and cached > sent:
        raise BadAnswer(f"{what}: cached_tokens {cached} of a {sent}-token prompt")
    if verify and verify > n:
        raise BadAnswer(f"{what}: spec_verify_ct {verify} for {n} tokens: more verify rounds "
                        "than tokens (each commits at least one)")
    if verify and limits.round_tokens and n - 1 > verify * limits.round_tokens:
        raise BadAnswer(f"{what}: {n} tokens in {verify} verify rounds: more than "
                        f"{limits.round_tokens} (steps + 1) a round after the prefill's token")
    finish = finish_kind(meta.get("finish_reason"))
    if finish == "abort":
        raise BadAnswer(f"{what}: aborted by the server ({meta.get('finish_reason')})")
    if limits.fixed_length and n != limits.max_new_tokens:
        raise BadAnswer(f"{what}: {n} of {limits.max_new_tokens} tokens with ignore_eos sent: "
                        "a fixed-length request must generate them all")
    if finish is None and n < limits.max_new_tokens:
        raise BadAnswer(f"{what}: {n} of {limits.max_new_tokens} tokens and no finish reason: "
                        "the answer was cut")
    return AnswerCounts(n, sent, cached or 0, verify)


async def raise_for_status(resp, base_url: str, rid: str) -> None:
    """TransientError for HTTP 5xx / 429 (retried), ServerError for any other non-200."""
    if resp.status == 200:
        return
    error = TransientError if resp.status in RETRY_STATUS else ServerError
    raise error(f"{base_url}: HTTP {resp.status} for request {rid}: "
                f"{(await resp.text())[:300]}")


def is_retryable(e: BaseException) -> bool:
    """HTTP 5xx / 429, timeouts, dropped connections and bad answers; not other 4xx."""
    return isinstance(e, (TransientError, asyncio.TimeoutError))


async def with_retries(attempt: Callable[[int], Awaitable[Any]], retries: int, delay_s: float,
                       what: str) -> tuple[Any, int]:
    """(answer, attempts) of `attempt(n)` (n = 0, 1, ...), retried `retries` times with
    core/server.py's backoff (doubling from `delay_s`, jittered) on a retryable error; then
    RequestFailed naming `what` and the last error."""
    last: BaseException | None = None
    policy = RetryPolicy(base_delay_s=delay_s, timeout_s=0.0, max_retries=retries)  # backoff
    for n in range(retries + 1):
        if n:
            await asyncio.sleep(policy.delay_s(n))
        try:
            return await attempt(n), n + 1
        except (ServerError, asyncio.TimeoutError) as e:
            last = e
            log.debug("%s: attempt %d failed: %s", what, n + 1, e)
            if not is_retryable(e):
                raise RequestFailed(f"{what}: failed (not retried): {e}", n + 1) from e
    raise RequestFailed(f"{what}: failed after {retries + 1} attempts: {last}", retries + 1)


class FailureStreak:
    """Requests failed in a row on one level; past `limit` the level sends no more (a server
    that fails everything would otherwise cost every request its full retries)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def record(self, ok: bool) -> None:
        self.count = 0 if ok else self.count + 1

    @property
    def broken(self) -> bool:
        return self.count >= self.limit

    def reason(self) -> str:
        return f"not sent: {self.count} requests in a row failed on this server"


class BenchStop(StopSignals):
    """05's StopSignals: while `polled` (a level's requests, an offline prompt loop) the flag
    is checked at the next request or prompt; otherwise a signal raises Interrupted at once,
    since a server start may wait up to --ready-timeout-s."""

    polled = False

    def _handle(self, signum, frame) -> None:
        super()._handle(signum, frame)
        if not self.polled:
            self.check()


async def watch_for_stop(work: asyncio.Future, stop: StopSignals | None) -> Any:
    """Await `work`, polling `stop` (None: not watched); on a stop, abandon it (cancel the
    requests in flight) and raise Interrupted."""
    if stop is None:
        return await work
    polled, stop.polled = getattr(stop, "polled", True), True
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=0.2)
            if stop.requested and not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        stop.check()
        return work.result()
    finally:
        stop.polled = polled
