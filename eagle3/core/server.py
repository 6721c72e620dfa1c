"""Talking to inference servers (SGLang's native API; OpenAI-compatible servers).

Shared by 01b (generation), 02b (hidden-state dump requests) and 05 (benchmarks). SGLang's
native `/generate` takes `{"input_ids", "rid", "sampling_params"}` and answers
`{"text", "output_ids", "meta_info"}`; readiness is polled with `/model_info` (older releases:
`/get_model_info`), never `/health`, which runs a real generation. Server flags come from
`/server_info` (older: `/get_server_info`). OpenAI-compatible servers answer
`/v1/chat/completions`.

Retries: a request is retried with exponential backoff (plus jitter) on HTTP 5xx, 429, timeouts
(every attempt has a deadline: `RetryPolicy.timeout_s` covers connecting, waiting and reading the
body), dropped connections (also half-way through the body), and a 200 whose body is not a JSON
object (cut, garbled, empty); other 4xx answers are not retried. After `max_retries` attempts
the last error is raised as RetriesExhausted (a ServerError) naming the URL, the request id and
the cause, and holding every attempt's error (`NoAnswer` for a deadline, `NotJSONAnswer` for a
body that is not a JSON object), so that a client tells a server that never answers the API
from one request's bad luck.

Several servers (or several SGLang routers) form a `ServerPool`: each request goes to the server
with the fewest requests outstanding (`least_outstanding`, the default) or to the next one in turn
(`round_robin`); a retry goes through the pool again, so it lands on another server when one is
down. `generate` and `chat_completion` accept a URL or a pool.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)

RETRY_STATUS = {429, 500, 502, 503, 504}
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")  # SGLang readiness (newer name first)
PROBE_TIMEOUT_S = 30.0  # how long one readiness probe waits for its answer, unless told
POOL_POLICIES = ("least_outstanding", "round_robin")


class ServerError(RuntimeError):
    """A request that failed for good; the message names the server, request and cause."""


class NotJSONError(ServerError):
    """A 200 whose body is not a JSON object: the URL serves something else (an HTML page of a
    proxy or of another service) or the body was garbled. Readiness polling stops at once on it
    (the server answers, and it is not the one asked for); a request retries it."""


class TransientError(ServerError):
    """One attempt failed in a way worth retrying (5xx, 429, timeout, dropped connection)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        # True when no connection could be opened at all: the server is down or restarting,
        # which says nothing about this request.
        self.unreachable = unreachable
        self.server: str | None = None  # set by post_pool_once: which server failed


class NoAnswer(TransientError):
    """An attempt that got no answer within its deadline (the server accepted the request, or
    not even the connection, and said nothing)."""


class NotJSONAnswer(TransientError):
    """A 200 whose body is not a JSON object (empty, cut, garbled, an HTML page)."""


class RetriesExhausted(ServerError):
    """A request whose every attempt failed; `errors` holds each attempt's TransientError, so
    that a client can tell a server that never answers, or never answers the API, from one
    record's bad luck."""

    def __init__(self, message: str, errors: list[TransientError]):
        super().__init__(message)
        self.errors = errors

    def every(self, *kinds: type) -> bool:
        """True when every attempt failed in one of `kinds`."""
        return bool(self.errors) and all(isinstance(e, kinds) for e in self.errors)


class BadAnswer(TransientError):
    """A 200 answer that contradicts itself or its request (a token count, a reply cut short, a
    body without the API's fields): possibly a glitch of this attempt, so it is retried like a
    500, and never becomes a record or a figure."""


def finish_kind(reason) -> str | None:
    """A finish reason's kind: SGLang's {"type": ...} or the OpenAI / vLLM string."""
    return reason.get("type") if isinstance(reason, dict) else reason


def check_generated(ids, completion_tokens, max_new_tokens: int, what: str = "",
                    vocab_size: int | None = None) -> int:
    """The number of generated ids, after BadAnswer unless they are token ids (non-negative
    ints, below `vocab_size` when given: the target's lm_head rows, the only ids it can emit),
    `completion_tokens` (None: not reported) is that count, and it is within the request's
    `max_new_tokens`; `what` names the request in the message. 01b's and 05's one check of
    generated ids."""
    at = f"{what}: " if what else ""
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise BadAnswer(f"{at}output ids that are not token ids: {str(ids)[:200]}")
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise BadAnswer(f"{at}output id {ids[i]} (position {i}) outside the target's "
                        f"vocabulary of {vocab_size}: not the target's answer")
    n = len(ids)
    if completion_tokens is not None and (type(completion_tokens) is not int
                                          or completion_tokens < 0):
        raise BadAnswer(f"{at}wrong token count: completion_tokens is "
                        f"{repr(completion_tokens)[:60]}, not a count")
    if completion_tokens is not None and completion_tokens != n:
        raise BadAnswer(f"{at}wrong token count: completion_tokens {completion_tokens} but {n} "
                        "token ids in the answer")
    if n > max_new_tokens:
        raise BadAnswer(f"{at}wrong token count: {n} tokens, more than max_new_tokens "
                        f"{max_new_tokens}")
    return n


def check_rid(meta: dict, rid: str, what: str = "") -> None:
    """BadAnswer when SGLang's `meta_info.id` (None: not reported) names another request than
    `rid`: the answer of another request, whatever its counts."""
    got = meta.get("id")
    if got is not None and got != rid:
        at = f"{what}: " if what else ""
        raise BadAnswer(f"{at}the answer of another request: meta_info.id is "
                        f"{str(got)[:120]!r}, the request was {rid!r}")


@dataclass
class RetryPolicy:
    # No defaults where a script has the flag (01b --retry-delay-s, --request-timeout-s): the
    # script's dataclass is the one home of those values.
    base_delay_s: float  # first backoff; doubles each attempt
    timeout_s: float  # per request
    max_retries: int = 5  # attempts after the first
    max_delay_s: float = 30.0

    def delay_s(self, attempt: int) -> float:
        """Backoff before attempt `attempt` (1 = the first retry), jittered by 0.5x-1.5x."""
        delay = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return delay * (0.5 + random.random())


class ServerPool:
    """One or several servers serving the same model; picks one per request."""

    def __init__(self, urls: list[str], policy: str = "least_outstanding"):
        if not urls:
            raise ValueError("a server pool needs at least one URL (--server-url)")
        if policy not in POOL_POLICIES:
            raise ValueError(f"unknown pool policy {policy!r}: use one of {POOL_POLICIES}")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self.outstanding = {u: 0 for u in self.urls}
        self.sent = {u: 0 for u in self.urls}  # requests sent per server (summary, tests)
        self.down: set[str] = set()  # servers found unreachable, skipped until back up
        self._turn = itertools.cycle(self.urls)

    def acquire(self) -> str:
        """The server for the next request; call `release` with it when the answer is in.

        Servers marked down are skipped while any other is up.
        """
        up = [u for u in self.urls if u not in self.down] or self.urls
        if self.policy == "round_robin":
            url = next(u for u in self._turn if u in up)
        else:  # ties go to the earliest URL: deterministic, and a single server is trivial
            url = min(up, key=self.outstanding.__getitem__)
        self.outstanding[url] += 1
        self.sent[url] += 1
        return url

    def release(self, url: str) -> None:
        self.outstanding[url] -= 1

    def all_down(self) -> bool:
        return len(self.down) == len(self.urls)


def as_pool(server: "str | ServerPool") -> ServerPool:
    return server if isinstance(server, ServerPool) else ServerPool([server])


def make_session(max_connections: int, headers: dict | None = None) -> aiohttp.ClientSession:
    """A client session allowing `max_connections` concurrent connections (aiohttp's default
    of 100 would silently cap a concurrency of 200)."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections)
    return aiohttp.ClientSession(connector=connector, headers=headers)


async def gather_or_cancel(aws) -> list:
    """The results of the awaitables `aws`, run together, in their order. The first to fail
    cancels the others (their requests in flight are dropped, those not sent are never sent)
    and its error is raised once they have ended."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def post_once(session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float,
                    what: str, headers: dict | None = None) -> dict:
    """One POST attempt: the JSON answer, TransientError (retry) or ServerError (do not)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=payload, timeout=timeout, headers=headers) as resp:
            if resp.status in RETRY_STATUS:
                raise TransientError(f"{url}: HTTP {resp.status} for {what}: "
                                     f"{(await resp.text())[:200]}")
            if resp.status != 200:
                raise ServerError(f"{url}: HTTP {resp.status} for {what} (not retried): "
                                  f"{(await resp.text())[:500]}")
            body, content_type = await resp.read(), resp.headers.get("Content-Type")
    except aiohttp.ClientConnectorError as e:  # connection refused / no route: server down
        raise TransientError(f"{url}: cannot connect for {what}: {e}", unreachable=True) from e
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        raise TransientError(f"{url}: connection dropped during {what}: {e!r}") from e
    except aiohttp.ClientError as e:  # a reply that is not HTTP (a chunk size not in hex, ...)
        raise TransientError(f"{url}: malformed HTTP answer for {what}: {e!r}"[:500]) from e
    except asyncio.TimeoutError as e:
        raise NoAnswer(f"{url}: no answer within {timeout_s:g}s for {what}") from e
    try:  # every endpoint we call answers a JSON object
        return json_object(body, content_type, url)
    except ServerError as e:  # a cut or garbled body, an HTML page: retried
        raise NotJSONAnswer(f"unparsable answer for {what}: {e}") from e


async def _with_retries(attempt_once, policy: RetryPolicy, what: str, where: str = "") -> dict:
    """Await `attempt_once()` until it succeeds, backing off after each TransientError;
    RetriesExhausted (a ServerError) holding every attempt's error when none did."""
    errors: list[TransientError] = []
    for attempt in range(policy.max_retries + 1):
        if attempt:
            await asyncio.sleep(policy.delay_s(attempt))
        try:
            return await attempt_once()
        except TransientError as e:
            errors.append(e)
            log.debug("attempt %d for %s failed: %s", attempt + 1, what, e)
    raise RetriesExhausted(f"{where}{what} failed after {policy.max_retries + 1} attempts: "
                           f"{errors[-1]}", errors)


async def post_json(session: aiohttp.ClientSession, url: str, payload: dict,
                    policy: RetryPolicy, what: str, headers: dict | None = None) -> dict:
    """POST `payload` and return the JSON answer, retrying transient failures."""
    return await _with_retries(
        lambda: post_once(session, url, payload, policy.timeout_s, what, headers), policy, what,
        f"{url}: ")


async def post_pool_once(session: aiohttp.ClientSession, pool: ServerPool, path: str,
                         payload: dict, timeout_s: float, what: str,
                         headers: dict | None = None) -> dict:
    """One attempt on the server the pool picks; a TransientError carries it as `.server`."""
    url = pool.acquire()
    try:
        return await post_once(session, url + path, payload, timeout_s, what, headers)
    except TransientError as e:
        e.server = url
        raise
    finally:
        pool.release(url)


async def post_pool(session: aiohttp.ClientSession, pool: ServerPool, path: str, payload: dict,
                    policy: RetryPolicy, what: str, headers: dict | None = None) -> dict:
    """`post_json` over a pool: every attempt picks its server anew."""
    return await _with_retries(
        lambda: post_pool_once(session, pool, path, payload, policy.timeout_s, what, headers),
        policy, what)


async def generate(session: aiohttp.ClientSession, base_url: "str | ServerPool",
                   input_ids: list[int], rid: str, sampling_params: dict,
                   policy: RetryPolicy, check=None) -> dict:
    """SGLang `/generate` with token ids in; returns `{"text", "output_ids", "meta_info"}`.
    `check(answer)`, when given, runs on each attempt's answer: its BadAnswer is retried."""
    payload = {"input_ids": input_ids, "rid": rid, "sampling_params": sampling_params}
    pool, what = as_pool(base_url), f"request {rid}"

    async def attempt() -> dict:
        answer = await post_pool_once(session, pool, "/generate", payload, policy.timeout_s,
                                      what)
        if check is not None:
            check(answer)
        return answer

    return await _with_retries(attempt, policy, what)


async def chat_completion(session: aiohttp.ClientSession, server: "str | ServerPool",
                          payload: dict, policy: RetryPolicy, what: str,
                          api_key: str | None = None) -> dict:
    """OpenAI `/v1/chat/completions` (non-streaming); returns the answer as sent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return await post_pool(session, as_pool(server), "/v1/chat/completions", payload, policy,
                           what, headers)


async def get_json(session: aiohttp.ClientSession, base_url: str, paths: tuple[str, ...],
                   timeout_s: float = 30.0, headers: dict | None = None) -> dict:
    """GET the first of `paths` the server knows (newer name first): its JSON object (`{}` for
    an empty body). A 200 that is not a JSON object (an HTML page) is a NotJSONError at once,
    naming the URL and what came back."""
    errors = []
    for path in paths:
        url = base_url.rstrip("/") + path
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                   headers=headers) as resp:
                if resp.status == 200:
                    return json_object(await resp.read(), resp.headers.get("Content-Type"), url,
                                       empty_ok=True)
                errors.append(f"{path}: HTTP {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            errors.append(f"{path}: {e!r}")
    raise ServerError(f"{base_url}: none of {paths} answered ({'; '.join(errors)})")


def json_object(body: bytes, content_type: str | None, url: str, empty_ok: bool = False) -> dict:
    """The JSON object of a 200 answer from `url`; ServerError naming the URL and what came back
    (an HTML page of a proxy or of another service, a cut body, a JSON list or string), so that
    a wrong server ends a stage in one line instead of a JSONDecodeError."""
    if empty_ok and not body.strip():  # a bare readiness answer (e.g. /health): no fields
        return {}
    try:
        answer = json.loads(body)
    except ValueError:  # bad JSON or bad UTF-8
        answer = None
    if isinstance(answer, dict):
        if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(answer):
            raise ServerError(f"{url} answered JSON holding a lone UTF-16 surrogate (an escape "
                              "such as \\ud800 that encodes no character): not text; "
                              f"{len(body):,} bytes: {body[:120]!r}")
        return answer
    text = body[:120].decode("utf-8", "replace").strip()
    what = ("an empty body" if not body.strip() else "an HTML page" if text[:1] == "<"
            else "not a JSON object")
    raise NotJSONError(f"{url} answered HTTP 200 with {what} (Content-Type "
                      f"{content_type or 'none'}, {len(body):,} bytes: {text!r}): is this the "
                      "server's URL (and port)?")


# A \\uD800-\\uDFFF escape: the only way JSON text can carry a lone surrogate, which Python's
# json accepts and no UTF-8 writer can write (the whole answer is walked only when one occurs).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(value) -> bool:
    """True when a string anywhere in `value` (keys too) is not encodable Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def served_model(models: dict, url: str) -> str:
    """The first model id of an OpenAI `/v1/models` answer; ServerError naming `url` when the
    answer lists none or is not of that shape."""
    data = models.get("data")
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
        raise ServerError(f"{url}/v1/models lists no model id ({str(models)[:200]}): is this an "
                          "OpenAI-compatible server? Pass the served model's name")
    return first["id"]


# The `/server_info` flags the stages compute with, by the type SGLang's ServerArgs gives them
# (None: not set): a value of another type is not SGLang's answer, and would pass or crash a
# check ("false" is true; "2" > 1 raises).
SERVER_INFO_TYPES = {
    int: ("tp_size", "pp_size", "max_prefill_tokens", "chunked_prefill_size",
          "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"),
    bool: ("disable_radix_cache", "enable_mixed_chunk", "enable_two_batch_overlap",
           "allow_auto_truncate", "disable_piecewise_cuda_graph", "skip_server_warmup",
           "disable_cuda_graph", "incremental_streaming_output"),
    str: ("version", "model_path", "speculative_algorithm", "speculative_draft_model_path",
          "cuda_graph_backend_prefill"),
}


async def get_server_info(session: aiohttp.ClientSession, base_url: str,
                          timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The server's flags (`/server_info`; `/get_server_info` before SGLang 0.5.10), each
    path waiting up to `timeout_s`; a ServerError naming the flag when one the stages read is
    not of SGLang's type."""
    info = await get_json(session, base_url, ("/server_info", "/get_server_info"), timeout_s)
    wrong = [f"{key} {info[key]!r}"[:80] for kind, keys in SERVER_INFO_TYPES.items()
             for key in keys if info.get(key) is not None and type(info[key]) is not kind]
    if wrong:
        raise ServerError(f"{base_url}/server_info: {', '.join(wrong)}: not of the types "
                          "SGLang's server flags have; is this the SGLang server's URL?")
    return info




class ServerExitedError(ServerError):
    """The server process being waited for exited before it answered."""


async def wait_ready(session: aiohttp.ClientSession, base_url: str,
                     paths: tuple[str, ...] = MODEL_INFO_PATHS, timeout_s: float = 1800.0,
                     poll_s: float = 5.0, *, request_timeout_s: float = PROBE_TIMEOUT_S,
                     headers: dict | None = None, process=None,
                     any_status: bool = False) -> dict:
    """Poll `paths` (SGLang: `/model_info`) every `poll_s` until the server answers.

    Returns the first 200 answer; with `any_status`, any HTTP answer on `paths[0]` counts (the
    process is up; the answer is then `{}`). `process` (a `subprocess.Popen`) is watched: its
    exit raises ServerExitedError at once instead of waiting out `timeout_s` (`math.inf`: wait
    for ever). Each attempt waits up to `request_timeout_s` for its answer: how long to wait is
    not how often to ask (`poll_s`), and a slow answer is not a dead server. Never calls
    `/health` on SGLang, which runs a real generation. A 200 that is not JSON (another
    service's page) raises NotJSONError at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    attempt_s = request_timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise ServerExitedError(f"{base_url}: the server exited with status "
                                    f"{process.returncode} before it was ready")
        try:
            if any_status:
                if await is_reachable(session, base_url, paths[0], attempt_s):
                    return {}
                raise ServerError(f"{base_url}{paths[0]}: no HTTP answer")
            return await get_json(session, base_url, paths, timeout_s=attempt_s, headers=headers)
        except NotJSONError:  # up, and not the server asked for: waiting will not change it
            raise
        except ServerError as e:
            if loop.time() > deadline:
                raise ServerError(f"{base_url} not ready after {timeout_s:.0f}s: {e}") from e
            await asyncio.sleep(poll_s)


async def is_reachable(session: aiohttp.ClientSession, base_url: str, path: str,
                       timeout_s: float = 10.0) -> bool:
    """True when the server answers HTTP at all on `path` (any status): its process is up."""
    try:
        async with session.get(base_url.rstrip("/") + path,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return True
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
