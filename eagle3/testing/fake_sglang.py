"""A fake SGLang server for tests and benchmarks: the `/generate` contract of docs/PIPELINE.md, plus
`/v1/chat/completions`, readiness endpoints and injectable faults.

Answers are a pure function of the request (`fake_output`), so a test knows the exact tokens a
record must hold, and a resumed run must reproduce an uninterrupted one. Faults are drawn per
request from a generator seeded with (seed, request id, its count), however they interleave:
HTTP 500s, dropped connections, requests that never answer (the client's timeout fires), slow
answers, aborted generations, and per-record faults (always 500, a truncated prompt, or
always slow). `stop()` then `start()` on the same port is a restart.

In a test (the server runs in a background thread with its own event loop):

    with FakeSGLang(faults=Faults(error_rate=0.05)) as server:
        ... requests to server.url ...
        server.requests  # one dict per answered or faulted request

As a process (benchmarks, subprocess tests):

    python -m eagle3.testing.fake_sglang --port 31000 --delay-s 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

EOS_ID = 7  # the fake end-of-turn id unless told otherwise (the tiny target's is passed in)


@dataclass
class Faults:
    """Shares of requests that fail, and how; per-record failures by record id."""

    error_rate: float = 0.0  # answered HTTP 500
    drop_rate: float = 0.0  # connection closed without an answer
    hang_rate: float = 0.0  # never answered (until `hang_s`): the client's timeout fires
    hang_s: float = 3600.0
    slow_rate: float = 0.0  # answered after `slow_s`
    slow_s: float = 1.0
    abort_rate: float = 0.0  # answered with finish_reason {"type": "abort"}
    delay_s: tuple[float, float] = (0.0, 0.0)  # uniform latency of every answer
    fail_ids: frozenset = frozenset()  # record ids always answered HTTP 500
    truncate_ids: frozenset = frozenset()  # record ids whose prompt_tokens come back one short
    slow_ids: frozenset = frozenset()  # record ids always answered after `slow_s`
    seed: int = 0


def fake_output(input_ids: list[int], max_new_tokens: int, eos_id: int = EOS_ID,
                vocab: tuple[int, int] = (10, 500), max_len: int = 40):
    """(output ids, finish reason) the fake server answers for a prompt: deterministic."""
    seed = zlib.crc32(json.dumps(input_ids).encode())
    n = 1 + seed % max_len
    rng = random.Random(seed)
    ids = [rng.randrange(*vocab) for _ in range(min(n, max_new_tokens))]
    if n <= max_new_tokens:
        ids[-1] = eos_id  # a reply that ends by itself ends with the end-of-turn token
        return ids, "stop"
    return ids, "length"


class FakeSGLang:
    """An aiohttp server on 127.0.0.1 answering like SGLang, in a background thread."""

    def __init__(self, faults: Faults | None = None, port: int = 0, eos_id: int = EOS_ID,
                 vocab: tuple[int, int] = (10, 500),
                 prompt_tokens: Callable[[dict], int] | None = None,
                 decode: Callable[[list[int]], str] | None = None,
                 answer: Callable[[dict], tuple[list[int], str]] | None = None,
                 pace: Callable[[int], Awaitable[None]] | None = None):
        self.faults = faults or Faults()
        # /generate's (output ids, "stop"|"length") for a request body; None = `fake_output`
        self.answer = answer
        # awaited with the number of output ids before /generate answers (a simulated decode:
        # benchmarks/bench_pool.py); None = no wait beyond the faults'
        self.pace = pace
        # /generate's "text": what the output ids decode to (the stop token left out, as
        # SGLang's detokenizer does); None = no "text" (SGLang with --skip-tokenizer-init)
        self.decode = decode
        self.port = port
        self.eos_id = eos_id
        self.vocab = vocab
        # openai: how many prompt tokens a chat request has (a template render); None = omit.
        self.prompt_tokens = prompt_tokens
        self.requests: list[dict] = []  # rid, kind ("ok" or the fault), start, end, sizes
        self.drawn: list[str] = []  # every fault kind as drawn, also of requests still hanging
        self.inflight = 0
        self.max_inflight = 0
        self._seen: dict[str, int] = {}  # request id -> requests with it so far
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/abort_request", self._abort)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_get("/v1/models", self._models)
        return app

    def start(self) -> "FakeSGLang":
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self._stopping = asyncio.Event()  # wakes hung and slow handlers when the server stops
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True,
                           shutdown_timeout=0.1)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port picked for port=0

    def stop(self) -> None:
        """Close the listener and drop every connection (requests in flight get no answer)."""
        if self._runner is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
            self._runner = None

    def close(self) -> None:
        self.stop()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def __enter__(self) -> "FakeSGLang":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ handlers

    async def _fault(self, request: web.Request, rid: str,
                     entry: dict) -> tuple[str, web.Response | None]:
        """Apply a fault drawn for this request; (kind, response to send instead or None).

        The kind is recorded in `entry` as soon as it is drawn, so a request still hanging when
        a test inspects `requests` shows up as "hang"."""
        f = self.faults
        base = rid.split("~")[0]
        # drawn from (seed, request id, how often that id came): the same faults however the
        # requests interleave; a retry draws afresh
        seen = self._seen[rid] = self._seen.get(rid, 0) + 1
        rng = random.Random(f"{f.seed}/{rid}/{seen}")
        lo, hi = f.delay_s
        if hi > 0:
            await asyncio.sleep(rng.uniform(lo, hi))
        if base in f.fail_ids:
            entry["kind"] = "fail_id"
            self.drawn.append("fail_id")
            return "fail_id", web.Response(status=500, text=f"injected failure for {base}")
        r, kind = rng.random(), "ok"
        for k, rate in (("error", f.error_rate), ("drop", f.drop_rate),
                        ("hang", f.hang_rate), ("slow", f.slow_rate),
                        ("abort", f.abort_rate)):
            if r < rate:
                kind = k
                break
            r -= rate
        if base in f.slow_ids:
            kind = "slow"
        entry["kind"] = kind
        self.drawn.append(kind)
        if kind == "ok":
            return "ok", None
        if kind == "error":
            return kind, web.Response(status=500, text="injected internal error")
        if kind == "drop":
            if request.transport is not None:
                request.transport.abort()  # the client sees the connection reset, no answer
            return kind, web.Response(status=500)
        if kind in ("hang", "slow"):
            try:
                await asyncio.wait_for(self._stopping.wait(),
                                       f.hang_s if kind == "hang" else f.slow_s)
            except asyncio.TimeoutError:
                pass
            if self._stopping.is_set():  # the server went down under this request
                if request.transport is not None:
                    request.transport.abort()
                return kind, web.Response(status=500)
        return kind, None

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, ids = body.get("rid", ""), body["input_ids"]
        budget = body.get("sampling_params", {}).get("max_new_tokens", 128)
        entry = {"rid": rid, "prompt_len": len(ids), "max_new_tokens": budget,
                 "start": time.monotonic(), "path": "/generate"}
        self._enter(entry)
        try:
            kind, resp = await self._fault(request, rid, entry)
            entry["kind"] = kind
            if resp is not None:
                return resp
            out, reason = (fake_output(ids, budget, self.eos_id, self.vocab)
                           if self.answer is None else self.answer(body))
            if self.pace is not None:
                await self.pace(len(out))
            n_prompt = len(ids) - (rid.split("~")[0] in self.faults.truncate_ids)
            finish = ({"type": "stop", "matched": self.eos_id} if reason == "stop"
                      else {"type": "length", "length": budget})
            if kind == "abort":
                finish = {"type": "abort", "message": "injected abort"}
            meta = {"id": rid, "prompt_tokens": n_prompt, "completion_tokens": len(out),
                    "cached_tokens": 0, "finish_reason": finish, "e2e_latency": 0.0}
            answer = {"output_ids": out, "meta_info": meta}
            if self.decode is not None:
                answer["text"] = self.decode(out[:-1] if reason == "stop" else out)
            return web.json_response(answer)
        finally:
            self._leave(entry)

    async def _chat(self, request: web.Request) -> web.Response:
        """A chat reply with reasoning, content and (when tools are offered) one tool call."""
        body = await request.json()
        user = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "user"),
                    "")
        entry = {"rid": "", "start": time.monotonic(), "path": "/v1/chat/completions",
                 "body": body, "authorization": request.headers.get("Authorization")}
        self._enter(entry)
        try:
            kind, resp = await self._fault(request, "", entry)
            entry["kind"] = kind
            if resp is not None:
                return resp
            message = {"role": "assistant", "content": f"About {user[:24]}: it depends.",
                       "reasoning_content": f"The user asks: {user[:24]}. Answer briefly."}
            finish = "stop"
            tools = body.get("tools") or []
            if tools:
                name = tools[0]["function"]["name"]
                message["tool_calls"] = [{"id": f"functions.{name}:0", "type": "function",
                                          "function": {"name": name, "arguments": '{"x": 1}'}}]
                finish = "tool_calls"
            usage = {"completion_tokens": 0}
            if self.prompt_tokens is not None:
                usage["prompt_tokens"] = self.prompt_tokens(body)
            return web.json_response({"id": "chatcmpl-fake", "object": "chat.completion",
                                      "model": body.get("model"), "usage": usage,
                                      "choices": [{"index": 0, "message": message,
                                                   "finish_reason": finish}]})
        finally:
            self._leave(entry)

    def _enter(self, entry: dict) -> None:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        entry["inflight_at_start"] = self.inflight

    def _leave(self, entry: dict) -> None:
        self.inflight -= 1
        entry["end"] = time.monotonic()
        self.requests.append(entry)

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"rid": body.get("rid"), "path": "/abort_request", "kind": "abort"})
        return web.json_response({"success": True})

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "is_generation": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "disable_radix_cache": True})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve the fake SGLang API on 127.0.0.1.")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--eos-id", type=int, default=EOS_ID)
    p.add_argument("--delay-s", type=float, default=0.0, help="latency of every answer")
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    server = FakeSGLang(Faults(error_rate=args.error_rate, delay_s=(args.delay_s, args.delay_s),
                               seed=args.seed), port=args.port, eos_id=args.eos_id)
    server.requests = _Discard()  # a long-running server keeps no per-request log
    web.run_app(server.app(), host="127.0.0.1", port=args.port, access_log=None,
                print=None, handle_signals=True)
    return 0


class _Discard(list):
    def append(self, item) -> None:  # noqa: D102 - drops the per-request log
        pass


if __name__ == "__main__":
    raise SystemExit(main())
