"""Talking to inference servers (SGLang's native API; OpenAI-compatible servers).

Shared by 01b (generation), 02b (hidden-state dump requests) and 05 (benchmarks). SGLang's
native `/generate` takes `{"input_ids", "rid", "sampling_params"}` and answers
`{"text", "output_ids", "meta_info"}`; readiness is polled with `/model_info` (older releases:
`/get_model_info`), never `/health`, which runs a real generation. Server flags come from
`/server_info` (older: `/get_server_info`).

Retries: a request is retried with exponential backoff (plus jitter) on HTTP 5xx, 429, timeouts
and dropped connections; other 4xx answers are not retried. After `max_retries` attempts the
last error is raised as ServerError naming the URL, the request id and the cause.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)

RETRY_STATUS = {429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """A request that failed for good; the message names the server, request and cause."""


@dataclass
class RetryPolicy:
    max_retries: int = 5  # attempts after the first
    base_delay_s: float = 0.5  # first backoff; doubles each attempt
    max_delay_s: float = 30.0
    timeout_s: float = 3600.0  # per request (long generations are legitimate)


async def post_json(session: aiohttp.ClientSession, url: str, payload: dict,
                    policy: RetryPolicy, what: str, headers: dict | None = None) -> dict:
    """POST `payload` and return the JSON answer, retrying transient failures."""
    last: Exception | None = None
    for attempt in range(policy.max_retries + 1):
        if attempt:
            delay = min(policy.max_delay_s, policy.base_delay_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + random.random()))
        try:
            timeout = aiohttp.ClientTimeout(total=policy.timeout_s)
            async with session.post(url, json=payload, timeout=timeout, headers=headers) as resp:
                if resp.status in RETRY_STATUS:
                    last = ServerError(f"{url}: HTTP {resp.status} for {what}: "
                                       f"{(await resp.text())[:200]}")
                    continue
                if resp.status != 200:
                    raise ServerError(f"{url}: HTTP {resp.status} for {what} (not retried): "
                                      f"{(await resp.text())[:500]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.TimeoutError) as e:
            last = e
            log.debug("%s: attempt %d for %s failed: %r", url, attempt + 1, what, e)
    raise ServerError(f"{url}: {what} failed after {policy.max_retries + 1} attempts: {last!r}")


async def generate(session: aiohttp.ClientSession, base_url: str, input_ids: list[int],
                   rid: str, sampling_params: dict, policy: RetryPolicy) -> dict:
    """SGLang `/generate` with token ids in; returns `{"text", "output_ids", "meta_info"}`."""
    payload = {"input_ids": input_ids, "rid": rid, "sampling_params": sampling_params}
    return await post_json(session, base_url.rstrip("/") + "/generate", payload, policy,
                           f"request {rid}")


async def get_json(session: aiohttp.ClientSession, base_url: str, paths: tuple[str, ...],
                   timeout_s: float = 30.0) -> dict:
    """GET the first of `paths` the server knows (newer name first)."""
    errors = []
    for path in paths:
        url = base_url.rstrip("/") + path
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status == 200:
                    return await resp.json(content_type=None)
                errors.append(f"{path}: HTTP {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            errors.append(f"{path}: {e!r}")
    raise ServerError(f"{base_url}: none of {paths} answered ({'; '.join(errors)})")


async def get_server_info(session: aiohttp.ClientSession, base_url: str) -> dict:
    """The server's flags (`/server_info`; `/get_server_info` before SGLang 0.5.10)."""
    return await get_json(session, base_url, ("/server_info", "/get_server_info"))


async def wait_ready(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 1800.0,
                     poll_s: float = 5.0) -> dict:
    """Poll `/model_info` until the server answers; returns it. Never calls `/health`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await get_json(session, base_url, ("/model_info", "/get_model_info"),
                                  timeout_s=poll_s)
        except ServerError as e:
            if loop.time() > deadline:
                raise ServerError(f"{base_url} not ready after {timeout_s:.0f}s: {e}") from e
            await asyncio.sleep(poll_s)
