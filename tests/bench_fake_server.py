"""A small fake SGLang server for the stage-05 tests: known answers, known timing.

`/generate` answers a prompt of L ids with `fake_output_ids` (L + 2 ids, capped by
`max_new_tokens`). Timing is scripted: the first token after `ttft_s`, then one decode step
every `step_s` that commits one token (no draft) or `tokens_per_verify` tokens (a speculative
server), so that `spec_verify_ct = ceil((n - 1) / tokens_per_verify)` (SGLang omits it when 0).
Streaming (`"stream": true`) sends SSE chunks `data: {...}` with cumulative `output_ids` (or
deltas with `incremental=True`) and `data: [DONE]`, like SGLang's `/generate`.

In a test: `with FakeBenchServer(info, tokens_per_verify=3) as url: ...` (a background thread).
As `sglang.launch_server` (the launcher test puts a shim on PYTHONPATH): `main(argv)` reads
`--port` and the `--speculative-*` flags and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time

from aiohttp import web


def fake_output_ids(input_ids: list[int], max_new_tokens: int) -> list[int]:
    n = min(max_new_tokens, len(input_ids) + 2)
    return [(sum(input_ids) + 3 * i) % 500 for i in range(n)]


def verify_count(n: int, tokens_per_verify: int | None) -> int | None:
    return math.ceil((n - 1) / tokens_per_verify) if tokens_per_verify else None


class FakeBenchServer:
    def __init__(self, info: dict, tokens_per_verify: int | None = None, ttft_s: float = 0.03,
                 step_s: float = 0.02, incremental: bool = False, port: int = 0):
        self.info = {"version": "0.5.23", "speculative_algorithm": None, **info,
                     "incremental_streaming_output": incremental}
        self.k, self.ttft_s, self.step_s = tokens_per_verify, ttft_s, step_s
        self.incremental, self.port = incremental, port
        self.requests: list[dict] = []
        self._loop = self._runner = self._thread = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/generate", self._generate)
        return app

    async def _model_info(self, request):
        return web.json_response({"model_path": self.info.get("model_path", "fake")})

    async def _server_info(self, request):
        return web.json_response(self.info)

    def _meta(self, prompt: list[int], ids: list[int], done: bool) -> dict:
        meta = {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": len(ids)}
        verify = verify_count(len(ids), self.k)
        if done:
            meta["finish_reason"] = {"type": "length"}
            if verify:
                meta["spec_verify_ct"] = verify
        return meta

    async def _generate(self, request):
        payload = await request.json()
        self.requests.append(payload)
        prompt = payload["input_ids"]
        ids = fake_output_ids(prompt, payload["sampling_params"]["max_new_tokens"])
        # Commit points: the prefill token, then 1 or k tokens per step.
        cuts = [1] + list(range(1 + (self.k or 1), len(ids), self.k or 1)) + [len(ids)]
        cuts = sorted(set(c for c in cuts if c <= len(ids)))
        if not payload.get("stream"):
            await asyncio.sleep(self.ttft_s + self.step_s * (len(cuts) - 1))
            return web.json_response({"text": "", "output_ids": ids,
                                      "meta_info": self._meta(prompt, ids, True)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft_s)
        sent = 0
        for i, cut in enumerate(cuts):
            if i:
                await asyncio.sleep(self.step_s)
            chunk_ids = ids[sent:cut] if self.incremental else ids[:cut]
            chunk = {"text": "", "output_ids": chunk_ids,
                     "meta_info": self._meta(prompt, ids[:cut], cut == len(ids))}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            sent = cut
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------ background thread

    def __enter__(self) -> str:
        started = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            self._runner = web.AppRunner(self.app())
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
    args, _ = p.parse_known_args(argv)
    print(f"fake sglang starting on {args.port}", flush=True)
    if args.crash:
        raise SystemExit("fake sglang: CUDA out of memory while loading weights")
    time.sleep(args.load_seconds)  # loading weights: /model_info does not answer yet
    info = {k: v for k, v in vars(args).items()
            if k not in ("load_seconds", "crash", "incremental_streaming_output")}
    k = 3 if args.speculative_algorithm == "EAGLE3" else None
    server = FakeBenchServer(info, tokens_per_verify=k,
                             incremental=args.incremental_streaming_output)
    web.run_app(server.app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
