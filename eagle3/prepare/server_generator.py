"""The self-written source's generator over SGLang's native `/generate`, for targets too large to
load in process (Kimi-K2.5): the interface of eagle3.generate.fast.FastGenerator, prompt ids in,
exact output ids out.

Each prompt is one request (`rid` = `sw-<batch seed>-<row>`). Every call made in one event loop
(`agenerate_ids`) shares one session and `concurrency` requests in flight, so that calls made
together (a round's batches, the rounds of several datasets: eagle3/prepare/selfwritten_run.py)
fill the places one another's last replies leave free; `generate_ids` is one call alone. A
sampled request carries its own `sampling_seed`, drawn from the call's seed and the row (never
from when it is sent), which SGLang honours only when the server runs with
`--enable-deterministic-inference`: without it, finished rounds are still kept and replayed on a
re-run, but a round redone after a kill draws other user turns than the lost one. Transient
failures (5xx, dropped connections, timeouts) are retried by eagle3.core.server, and so is an
answer that cannot be the request's (01b's checks: ids outside the vocabulary, another rid,
more ids than the budget or than `completion_tokens` says); an aborted generation, or such an
answer on every attempt, stops the stage (ServerError).
"""

from __future__ import annotations

import asyncio

import aiohttp

from eagle3.core.server import (
    BadAnswer,
    RetryPolicy,
    ServerError,
    ServerPool,
    check_generated,
    check_rid,
    gather_or_cancel,
    generate,
    make_session,
    wait_ready,
)
from eagle3.generate.jobs import seed_of

READY_TIMEOUT_S = 1800.0  # wait this long for the server to answer /model_info at start
REQUEST_TIMEOUT_S = 3600.0  # per request (a user turn or a reply of a few hundred tokens)


def request_seed(seed: int, row: int) -> int:
    """The per-request sampling seed (31 bits, which every SGLang release accepts)."""
    return seed_of(seed, row) & (2 ** 31 - 1)


def sampling_params(budget: int, temperature: float, top_p: float, stop_ids: list[int],
                    seed: int | None) -> dict:
    params = {"max_new_tokens": budget, "temperature": temperature, "top_p": top_p,
              "stop_token_ids": stop_ids}
    if temperature > 0 and seed is not None:
        params["sampling_seed"] = seed
    return params


def check_answer(answer: dict, rid: str, budget: int, vocab_size: int | None) -> None:
    """BadAnswer (retried) for an answer that cannot be request `rid`'s (01b's checks)."""
    meta, output = answer.get("meta_info"), answer.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(output, list):
        raise BadAnswer(f"request {rid}: malformed answer (no output_ids list or meta_info): "
                        f"{str(answer)[:200]}")
    check_rid(meta, rid, f"request {rid}")
    check_generated(output, meta.get("completion_tokens"), budget, f"request {rid}", vocab_size)


def output_of(answer: dict, rid: str) -> tuple[list[int], str]:
    """(output ids, 'stop'|'length') of a `/generate` answer; the matched stop token is
    appended when a release leaves it out of `output_ids`."""
    meta, output = answer.get("meta_info"), answer.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(output, list):
        raise ServerError(f"request {rid}: malformed answer (no output_ids list or meta_info): "
                          f"{str(answer)[:200]}")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length"):
        raise ServerError(f"request {rid}: generation ended with {reason!r}")
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if kind == "stop" and isinstance(matched, int) and output[-1:] != [matched]:
        output = output + [matched]
    return output, kind


class ServerGenerator:
    """`generate_ids` over one or several SGLang servers, and `agenerate_ids` for calls made
    together in one event loop (see the module doc)."""

    def __init__(self, urls: list[str], stop_ids: list[int], concurrency: int,
                 vocab_size: int | None = None):
        self.pool = ServerPool(urls)
        self.vocab_size = vocab_size  # the target's: no output id reaches it
        self.stop_ids = list(stop_ids)
        self.concurrency = concurrency  # requests in flight, over every call of a loop
        self.policy = RetryPolicy(base_delay_s=1.0, timeout_s=REQUEST_TIMEOUT_S)
        self._ready = False
        self._session: aiohttp.ClientSession | None = None  # of the running loop
        self._gate: asyncio.Semaphore | None = None
        self._ready_lock: asyncio.Lock | None = None

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: list[int] | int,
                     temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[tuple[list[int], str]]:
        """(output ids, 'stop'|'length') per prompt; blocks (a loop of its own)."""

        async def alone() -> list[tuple[list[int], str]]:
            try:
                return await self.agenerate_ids(prompts, max_new_tokens, temperature, top_p,
                                                seed)
            finally:
                await self.aclose()

        return asyncio.run(alone())

    async def agenerate_ids(self, prompts: list[list[int]], max_new_tokens: list[int] | int,
                            temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                            stop=None) -> list[tuple[list[int], str]]:
        """`generate_ids` in the running loop, sharing its requests in flight with the loop's
        other calls. `stop` (an eagle3.core.faults.StopSignals) is checked before each request
        is sent: after a signal no request starts, and the call raises Interrupted."""
        budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                   else list(max_new_tokens))
        session, gate = await self._open()

        async def one(row: int) -> tuple[list[int], str]:
            rid = f"sw-{seed:x}-{row}"
            params = sampling_params(budgets[row], temperature, top_p, self.stop_ids,
                                     request_seed(seed, row))
            async with gate:
                if stop is not None:
                    stop.check()
                answer = await generate(
                    session, self.pool, prompts[row], rid, params, self.policy,
                    lambda a: check_answer(a, rid, budgets[row], self.vocab_size))
            return output_of(answer, rid)

        return await gather_or_cancel(one(row) for row in range(len(prompts)))

    async def _open(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The running loop's session and gate; every server ready (waited for once)."""
        if self._session is None:
            self._session = make_session(self.concurrency)
            self._gate = asyncio.Semaphore(self.concurrency)
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:  # one wait for readiness, however many calls start
            if not self._ready:
                for url in self.pool.urls:
                    await wait_ready(self._session, url, timeout_s=READY_TIMEOUT_S)
                self._ready = True
        return self._session, self._gate

    async def aclose(self) -> None:
        """Close the running loop's session (the next loop opens its own)."""
        if self._session is not None:
            await self._session.close()
            self._session = self._gate = self._ready_lock = None
