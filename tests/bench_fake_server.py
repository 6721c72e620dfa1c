"""A small fake SGLang server for the stage-05 tests: known answers, known timing.

`/generate` answers a prompt of L ids with `fake_output_ids` (L + 2 ids, capped by
`max_new_tokens`). Timing is scripted: the first token after `ttft_s`, then one decode step
every `step_s` that commits one token (no draft) or `tokens_per_verify` tokens (a speculative
server), so that `spec_verify_ct = ceil((n - 1) / tokens_per_verify)` (SGLang omits it when 0).
Streaming (`"stream": true`) sends SSE chunks `data: {...}` with cumulative `output_ids` (or
deltas with `incremental=True`) and `data: [DONE]`, like SGLang's `/generate`.

In a test: `with FakeBenchServer(info, tokens_per_verify=3) as url: ...` (a background thread).
As `sglang.launch_server` (the launcher test puts a shim on PYTHONPATH): `main(argv)` reads
`--port` and the `--speculative-*` flags and serves until killed; the stand-in's own
`--fake-tokens-per-round` (default 3 on an EAGLE3 server) and `--fake-step-s` (default 0.02)
set its acceptance and round cost, and stay out of its `/server_info`.

Several speculative settings (05 compares them, eagle3/bench/verdict.py): one server each, with
its own `speculative_*` info, `tokens_per_verify` (acceptance) and `step_s` (round cost);
`step_s_at={concurrency: seconds}` makes a round dearer at a level (on a GPU a speculative
round's cost grows with the batch, so plain can win at a high concurrency). The level a request
was sent at is read from 05's rid (`bench-<role>-<set>-c<C>-<i>-<hex>`, `level_of`): a stand-in
cannot see the client's concurrency otherwise. `batch_noise(prompt ids, concurrency) -> bool`
flips the last token of the answers it picks, as bf16's batch-dependent rounding flips near-ties
between batch sizes on a real server.

Faults on cue (the stage-05 fault tests): `faults={first prompt id: kind}` makes every request
whose prompt starts with that id misbehave (a list of kinds: its next requests in turn, then it
behaves), `once=[kind, ...]` the next requests of any prompt in turn. Kinds (`FAULTS`): "http500"; "hang" (never answers); "drop" (the connection is
closed half-way through the stream); "eof" (the stream ends half-way, cleanly, with no final
chunk); "count" (completion_tokens disagrees with the ids sent); "short" (half the tokens, no
finish reason). `metrics_fault` = "garbage" or "missing" spoils vLLM's `/metrics`.
The same server speaks vLLM's OpenAI face too: `/v1/models`, `/v1/completions` (token ids in
and out, streamed with a usage chunk) and `/metrics` with the `vllm:spec_decode_*` counters.

Lies, cued the same way (`LIES`): "overlong" (3 tokens more than max_new_tokens, counted as
such), "prompt_count" (one prompt token more than sent), "verify_excess" (more verify rounds
than tokens), "verify_few" (one verify round for the whole answer: more tokens a round than the
steps allow), "verify_negative" (-1 rounds), "foreign_rid" (meta_info.id names another request),
"out_of_vocab" (an output id past any vocabulary, counts consistent); "nulls" (a legal answer
whose optional counts are null). Server-wide: `lossy` (the last output token differs from the plain one), `html_paths`
(these GET paths answer 200 with a web page), `metrics_fault` "nan" (NaN counters) or
"inflated" (more accepted than drafted tokens), and `sse_dialect="legal"`: streams in what the
SSE standard allows and the servers do not send (CRLF line ends, comment lines, `retry` and `id`
fields, an event of another type, a JSON object over two data lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Callable

from aiohttp import web


def fake_output_ids(input_ids: list[int], max_new_tokens: int) -> list[int]:
    n = min(max_new_tokens, len(input_ids) + 2)
    return [(sum(input_ids) + 3 * i) % 500 for i in range(n)]


def verify_count(n: int, tokens_per_verify: int | None) -> int | None:
    return math.ceil((n - 1) / tokens_per_verify) if tokens_per_verify else None


def level_of(rid: str) -> int | None:
    """The concurrency a 05 request was sent at, from its rid; None for the warm-up (or a rid
    of another client)."""
    m = re.search(r"-c(\d+)-\d+-[0-9a-f]{8}(?:-retry\d+)?$", rid or "")
    return int(m.group(1)) if m else None


FAULTS = ("http500", "hang", "drop", "eof", "count", "short")
LIES = ("overlong", "prompt_count", "verify_excess", "verify_few", "verify_negative",
        "foreign_rid", "out_of_vocab")


class FakeBenchServer:
    def __init__(self, info: dict, tokens_per_verify: int | None = None, ttft_s: float = 0.03,
                 step_s: float = 0.02, incremental: bool = False, port: int = 0,
                 faults: dict[int, str | list[str]] | None = None,
                 once: list[str] | None = None,
                 metrics_fault: str | None = None, lossy: bool = False,
                 html_paths: tuple[str, ...] = (), sse_dialect: str | None = None,
                 step_s_at: dict[int, float] | None = None,
                 batch_noise: Callable[[list[int], int], bool] | None = None):
        self.info = {"version": "0.5.23", "speculative_algorithm": None, **info,
                     "incremental_streaming_output": incremental}
        self.k, self.ttft_s, self.step_s = tokens_per_verify, ttft_s, step_s
        self.incremental, self.port = incremental, port
        self.requests: list[dict] = []
        self.faults = {k: list(v) if isinstance(v, list) else v for k, v in (faults or {}).items()}
        self.once = list(once or [])
        cued = [k for v in self.faults.values() for k in ([v] if isinstance(v, str) else v)]
        assert set(cued) | set(self.once) <= set(FAULTS + LIES + ("nulls",))
        self.metrics_fault = metrics_fault
        self.lossy, self.html_paths, self.sse_dialect = lossy, html_paths, sse_dialect
        self.step_s_at, self.batch_noise = dict(step_s_at or {}), batch_noise
        self.counters = {"drafts": 0, "accepted": 0}  # vLLM's spec-decode counters
        self._loop = self._runner = self._thread = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._web_pages])
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _web_pages(self, request, handler):
        """`html_paths` answer a 200 web page, as another service on that port would."""
        if request.method == "GET" and request.path in self.html_paths:
            return web.Response(text="<!DOCTYPE html><html><title>Grafana</title></html>",
                                content_type="text/html")
        return await handler(request)

    def _fault(self, prompt: list[int]) -> str | None:
        """The fault this request is cued for, if any."""
        if self.once:
            return self.once.pop(0)
        fault = self.faults.get(prompt[0]) if prompt else None
        if isinstance(fault, list):
            return fault.pop(0) if fault else None
        return fault

    async def _model_info(self, request):
        return web.json_response({"model_path": self.info.get("model_path", "fake")})

    async def _server_info(self, request):
        return web.json_response(self.info)

    def _meta(self, prompt: list[int], ids: list[int], done: bool, max_new: int,
              fault: str | None = None) -> dict:
        meta = {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": len(ids)}
        verify = verify_count(len(ids), self.k)
        if done:
            # "stop": the reply ended (an end of turn) before max_new_tokens; "length": it did not
            meta["finish_reason"] = {"type": "length" if len(ids) >= max_new else "stop"}
            if fault == "short":
                meta["finish_reason"] = None
            if fault == "count":
                meta["completion_tokens"] = len(ids) + 3
            if verify:
                meta["spec_verify_ct"] = verify
            lied = {"verify_excess": len(ids) + 2, "verify_few": 1, "verify_negative": -1}
            if fault in lied:
                meta["spec_verify_ct"] = lied[fault]
        if fault == "prompt_count":
            meta["prompt_tokens"] += 1
        if fault == "foreign_rid":
            meta["id"] = "bench-another-request"
        if fault == "nulls":
            meta.update(prompt_tokens=None, cached_tokens=None, completion_tokens=None,
                        e2e_latency=None)
        return meta

    def _answer(self, prompt: list[int], max_new: int, fault: str | None,
                level: int | None = None):
        """(output ids, commit points): the prefill token, then 1 or k tokens per step."""
        ids = fake_output_ids(prompt, max_new + (3 if fault == "overlong" else 0))
        if fault == "overlong":
            ids += [7] * (max_new + 3 - len(ids))
        if fault == "short":
            ids = ids[:max(1, len(ids) // 2)]
        if fault == "out_of_vocab":
            ids[0] = 10 ** 7
        noisy = self.batch_noise is not None and level is not None and \
            self.batch_noise(prompt, level)
        if self.lossy or noisy:
            ids[-1] = (ids[-1] + 1) % 500
        cuts = [1] + list(range(1 + (self.k or 1), len(ids), self.k or 1)) + [len(ids)]
        return ids, sorted(set(c for c in cuts if c <= len(ids)))

    async def _misbehave(self, request, fault: str | None):
        """The answer of a request cued for "http500" or "hang"; None for the other kinds."""
        if fault == "http500":
            return web.Response(status=500, text="fake: internal server error")
        if fault == "hang":
            await asyncio.sleep(3600)
        return None

    async def _generate(self, request):
        payload = await request.json()
        self.requests.append(payload)
        prompt, max_new = payload["input_ids"], payload["sampling_params"]["max_new_tokens"]
        fault, level = self._fault(prompt), level_of(payload.get("rid", ""))
        if (bad := await self._misbehave(request, fault)) is not None:
            return bad
        ids, cuts = self._answer(prompt, max_new, fault, level)
        step_s = self.step_s_at.get(level, self.step_s)
        if not payload.get("stream"):
            await asyncio.sleep(self.ttft_s + step_s * (len(cuts) - 1))
            return web.json_response({"text": "", "output_ids": ids,
                                      "meta_info": self._meta(prompt, ids, True, max_new, fault)})

        def chunk(i: int, cut: int, sent: int) -> dict:
            chunk_ids = ids[sent:cut] if self.incremental else ids[:cut]
            return {"text": "", "output_ids": chunk_ids,
                    "meta_info": self._meta(prompt, ids[:cut], cut == len(ids), max_new, fault)}

        return await self._stream(request, cuts, chunk, fault, b"data: [DONE]\n\n", step_s)

    async def _stream(self, request, cuts: list[int], chunk, fault: str | None, tail: bytes,
                      step_s: float | None = None):
        """SSE chunks at the scripted times (a step every `step_s`, default the server's);
        "drop" / "eof" stop half-way."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft_s)
        sent = 0
        for i, cut in enumerate(cuts):
            if i:
                await asyncio.sleep(self.step_s if step_s is None else step_s)
            if fault in ("drop", "eof") and i >= max(1, len(cuts) // 2):
                if fault == "drop":
                    request.transport.close()  # mid-stream: no terminating chunk
                    return resp
                break
            await resp.write(self._event(json.dumps(chunk(i, cut, sent)), i))
            sent = cut
        else:
            await resp.write(self._dialect(tail))
        await resp.write_eof()
        return resp

    def _event(self, data: str, i: int) -> bytes:
        """One SSE event of `data` as SGLang and vLLM write it, or in the legal dialect."""
        if self.sse_dialect != "legal":
            return b"data: " + data.encode() + b"\n\n"
        head = "retry: 3000\n: stream opened\n" if i == 0 else ""
        cut = data.index(",") + 1 if "," in data else len(data)  # a JSON object on two lines
        return self._dialect((f"{head}: keep-alive\nevent: ping\ndata: {{}}\n\nid: {i}\n"
                              f"data:{data[:cut]}\ndata: {data[cut:]}\n\n").encode())

    def _dialect(self, raw: bytes) -> bytes:
        return raw.replace(b"\n", b"\r\n") if self.sse_dialect == "legal" else raw

    # ------------------------------------------------------------ vLLM's face

    async def _models(self, request):
        return web.json_response({"data": [{"id": self.info.get("model_path", "fake")}]})

    async def _completions(self, request):
        payload = await request.json()
        self.requests.append(payload)
        prompt, max_new = payload["prompt"], payload["max_tokens"]
        fault = self._fault(prompt)
        if (bad := await self._misbehave(request, fault)) is not None:
            return bad
        ids, cuts = self._answer(prompt, max_new, fault)
        finish = None if fault == "short" else ("length" if len(ids) >= max_new else "stop")
        count = len(ids) + (3 if fault == "count" else 0)
        usage = {"prompt_tokens": len(prompt) + (fault == "prompt_count"),
                 "completion_tokens": count}
        if fault == "nulls":
            usage = {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}
        if fault not in ("drop", "eof"):
            self._count_spec(len(ids))
        if not payload.get("stream"):
            await asyncio.sleep(self.ttft_s + self.step_s * (len(cuts) - 1))
            return web.json_response({"choices": [{"token_ids": ids, "finish_reason": finish}],
                                      "usage": usage})

        def chunk(i: int, cut: int, sent: int) -> dict:
            return {"choices": [{"token_ids": ids[sent:cut],
                                 "finish_reason": finish if cut == len(ids) else None}]}

        tail = (b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                + b"\n\ndata: [DONE]\n\n")
        return await self._stream(request, cuts, chunk, fault, tail)

    def _count_spec(self, n: int) -> None:
        """vLLM's counters for one reply of n tokens: a round per verify, k drafts each."""
        rounds = verify_count(n, self.k) or 0
        self.counters["drafts"] += rounds
        self.counters["accepted"] += (n - 1) - rounds if rounds else 0

    async def _metrics(self, request):
        if self.metrics_fault == "missing":
            return web.Response(status=404, text="404: Not Found")
        if self.metrics_fault == "garbage":
            return web.Response(text="<html>this is {{ not prometheus</html>\n")
        c, k = dict(self.counters), self.k or 0
        if self.metrics_fault == "nan":
            c["accepted"] = "NaN"
        if self.metrics_fault == "inflated":  # k + 1 accepted of the k drafted a round
            c["accepted"] = c["drafts"] * (k + 1)
        lines = ["# TYPE vllm:spec_decode_num_drafts counter",
                 f'vllm:spec_decode_num_drafts_total{{engine="0"}} {c["drafts"]}',
                 "# TYPE vllm:spec_decode_num_draft_tokens counter",
                 f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {c["drafts"] * k}',
                 "# TYPE vllm:spec_decode_num_accepted_tokens counter",
                 f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {c["accepted"]}']
        return web.Response(text="\n".join(lines) + "\n")

    # ------------------------------------------------------------ background thread

    def __enter__(self) -> str:
        started = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            # A client that gave up cancels its handler (a "hang" does not outlive the test).
            self._runner = web.AppRunner(self.app(), handler_cancellation=True,
                                         shutdown_timeout=1.0)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        started.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main(argv: list[str] | None = None) -> None:
    """Serve like `python -m sglang.launch_server` would (unknown flags ignored)."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="fake")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--load-seconds", type=float, default=0.5)
    p.add_argument("--crash", action="store_true", help="exit at once (a failed start)")
    p.add_argument("--fake-tokens-per-round", type=int, default=3,
                   help="tokens an EAGLE3 server commits a round (its acceptance)")
    p.add_argument("--fake-step-s", type=float, default=0.02, help="seconds a step or round")
    args, _ = p.parse_known_args(argv)
    print(f"fake sglang starting on {args.port}", flush=True)
    if args.crash:
        raise SystemExit("fake sglang: CUDA out of memory while loading weights")
    time.sleep(args.load_seconds)  # loading weights: /model_info does not answer yet
    info = {k: v for k, v in vars(args).items()
            if k not in ("load_seconds", "crash", "incremental_streaming_output")
            and not k.startswith("fake_")}
    k = args.fake_tokens_per_round if args.speculative_algorithm == "EAGLE3" else None
    server = FakeBenchServer(info, tokens_per_verify=k, step_s=args.fake_step_s,
                             incremental=args.incremental_streaming_output)
    web.run_app(server.app(), host="127.0.0.1", port=args.port, print=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
