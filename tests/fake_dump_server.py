"""An in-process stand-in for a patched SGLang dump server, for the stage 02b client tests.

It answers `/generate`, `/server_info` and `/model_info` like SGLang, and schedules prefill like
SGLang does: each forward pass packs several requests up to a token budget, a prompt longer
than `chunk_size` is prefilled over several passes (interleaved with other requests, each chunk
at its prefix offset), and passes carry CUDA-graph padding rows. Every pass goes through the
real `eagle3.extract.sglang_dump.maybe_dump` with a fake `ForwardBatch`, so the dump files are the ones
the patched server writes, by the same writer thread (after the answer, as in the real server);
`dump_layout` is the server's `EAGLE3_DUMP_LAYOUT`. The states of a prompt are the tiny target's own transformers forward
of that prompt alone: aux = `output_hidden_states[i]` at the capture indices, final = the
post-norm last hidden state.

Faults, for the client's tests (`Faults`): a dump deleted or truncated after the answer, a chunk
run in a MIXED pass (so never dumped: a short file), a dump whose aux states lose a row, cached
tokens or a wrong prompt_tokens in the answer, HTTP 500, no answer (a hang), an answer cut
half-way by a closed connection, NaN in the states, a slow server, the states of other layers
than the ones announced; `restart()` takes the server down and up. And lies: the states of
another prompt of the same length under the request's rid (a server that mixed up requests),
states in an integer dtype, dumps of the older format (a server running an older dump module),
a FIFO, a directory or a bloated file at the dump's path, an answer naming another request, an
HTML page for `/server_info`, an empty body for every `/generate`. With any fault set, the
server waits for its writer before it answers, so that what a fault does to a dump happens to
the whole file, and no dump lands after the client gave up on the attempt.
"""

from __future__ import annotations

import asyncio
import enum
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from aiohttp import web

from eagle3.core import hidden_states as hs
from eagle3.extract import sglang_dump


class ForwardMode(enum.IntEnum):
    """The names SGLang's ForwardMode uses (the dump compares names)."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()


@dataclass
class Faults:
    """What goes wrong, keyed by rid (first attempt: prefix + record id)."""

    drop_dump_once: set[str] = field(default_factory=set)  # dump deleted before the answer
    truncate_dump_once: set[str] = field(default_factory=set)  # dump cut to half its bytes
    mixed_chunk_once: set[str] = field(default_factory=set)  # last chunk in a MIXED pass
    always_drop: set[str] = field(default_factory=set)  # every attempt's dump deleted
    cached_tokens: int = 0  # reported in every answer's meta_info
    pass_delay_s: float = 0.0  # sleep per forward pass (a slow server)
    # Keyed by the first attempt's rid, every request of the record counts (HTTP retries and
    # later attempts): how many more requests go wrong that way.
    http_500: dict[str, int] = field(default_factory=dict)  # HTTP 500, nothing computed
    hang: dict[str, int] = field(default_factory=dict)  # no answer for hang_s (client times out)
    close_midway: dict[str, int] = field(default_factory=dict)  # half an answer, then closed
    wrong_prompt_tokens: dict[str, int] = field(default_factory=dict)  # prompt_tokens + 1
    short_rows_dump: dict[str, int] = field(default_factory=dict)  # aux loses its last row
    truncate_dump: dict[str, int] = field(default_factory=dict)  # dump cut to half its bytes
    nan_states: dict[str, int] = field(default_factory=dict)  # NaN in that many values of the
    # second capture, on every request of the record (a bf16 overflow in the target)
    hang_s: float = 30.0
    # Lies met by every request of the record (keyed by the first attempt's rid):
    foreign_prompt: dict[str, list[int]] = field(default_factory=dict)  # computed and dumped
    # instead of the prompt sent (same length: the answer's prompt_tokens is right)
    int_states: set[str] = field(default_factory=set)  # the dump's states cast to int16
    dump_entry: dict[str, str] = field(default_factory=dict)  # at the dump's path instead of
    # the dump: "fifo" (no writer), "directory", or "bloated" (the dump followed by 1 MB)
    answer_id: set[str] = field(default_factory=set)  # meta_info.id names another request
    old_format: bool = False  # every dump rewritten as format version 1 (torch.save at
    # <rid>.pt, no input_ids), as a server running an older dump module writes it
    server_info_html: bool = False  # /server_info answers 200 with a web page
    empty_answer: bool = False  # every /generate answered HTTP 200 with an empty body


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    future: asyncio.Future
    done: int = 0  # tokens prefilled so far
    states: tuple | None = None  # (aux [T, K*H], final [T, H]) float32


class FakeDumpServer:
    """Serve on 127.0.0.1 from a background thread; `start()` returns the base URL."""

    def __init__(self, model, dump_dir: Path, capture_layers: list[int], *,
                 state_layers: list[int] | None = None, chunk_size: int = 48,
                 max_prefill_tokens: int = 128, rid_prefix: str = "eagle3-",
                 info: dict | None = None, faults: Faults | None = None,
                 dump_layout: str = "bf16"):
        self.model = model
        self.dump_config = sglang_dump.DumpConfig(Path(dump_dir), 0, rid_prefix, dump_layout)
        self.capture_layers = list(capture_layers)  # what the server announces (and dumps as)
        self.state_layers = list(state_layers or capture_layers)  # what it really captures
        self.chunk_size, self.max_prefill_tokens = chunk_size, max_prefill_tokens
        self.faults = faults or Faults()
        self.info = {"model_path": "tiny", "tp_size": 1, "pp_size": 1,
                     "disable_radix_cache": True, "chunked_prefill_size": chunk_size,
                     "max_prefill_tokens": max_prefill_tokens, "enable_mixed_chunk": False,
                     "skip_server_warmup": True, "allow_auto_truncate": False,
                     "cuda_graph_backend_prefill": "disabled", "speculative_algorithm": None,
                     **(info or {})}
        self.generate_calls: list[str] = []  # rids, in arrival order
        self.passes: list[list[tuple[str, int, int]]] = []  # (rid, prefix, rows) per pass
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = None
        self._saved_config = None

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        self._call(self._start())
        return self.url

    def stop(self) -> None:
        self._call(self._stop())

    def restart(self, down_s: float) -> None:
        """Go down (requests in flight are dropped), stay down `down_s`, come back."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeDumpServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        self.dump_config.dump_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._saved_config is None:  # the real dump module, with this server's config
            self._saved_config = sglang_dump.server_config
            sglang_dump.server_config = lambda: self.dump_config
        self._queue: list[_Request] = []
        self._wake = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/model_info", self._json(lambda: {"model_path": "tiny",
                                                              "is_generation": True}))
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._scheduler = asyncio.create_task(self._schedule())

    async def _stop(self) -> None:
        if self._runner is None:
            return
        self._scheduler.cancel()
        for req in self._queue:  # a crash: the clients see dropped connections
            req.future.cancel()
        await self._runner.cleanup()
        self._runner = None
        sglang_dump.close_writer(self.dump_config)  # a normal stop: the queue is written out
        if self._saved_config is not None:
            sglang_dump.server_config = self._saved_config
            self._saved_config = None

    async def _server_info(self, request):
        if self.faults.server_info_html:
            return web.Response(text="<!DOCTYPE html><html><body>Jupyter</body></html>",
                                content_type="text/html")
        return web.json_response(self.info)

    @staticmethod
    def _json(make):
        async def handler(request):
            return web.json_response(make())
        return handler

    # ------------------------------------------------------------ serving

    def _hit(self, table: dict[str, int], rid: str) -> bool:
        """Whether this request of `rid`'s record takes the fault of `table` (and count it)."""
        base = rid.split("+retry")[0]
        if table.get(base, 0) <= 0:
            return False
        table[base] -= 1
        return True

    async def _generate(self, request):
        body = await request.json()
        rid, ids = body["rid"], body["input_ids"]
        assert body["sampling_params"]["max_new_tokens"] == 1, body["sampling_params"]
        self.generate_calls.append(rid)
        if self.faults.empty_answer:  # a proxy or another service on the port: nothing computed
            return web.Response(status=200, body=b"", content_type="application/json")
        if self._hit(self.faults.http_500, rid):
            return web.Response(status=500, text="injected internal error")
        if self._hit(self.faults.hang, rid):
            await asyncio.sleep(self.faults.hang_s)
            return web.Response(status=504, text="injected hang")
        if self._hit(self.faults.close_midway, rid):
            return await self._close_midway(request)
        computed = self.faults.foreign_prompt.get(rid.split("+retry")[0], ids)
        req = _Request(rid, list(computed), asyncio.get_running_loop().create_future())
        t0 = time.time()
        self._queue.append(req)
        self._wake.set()
        await req.future
        if self.faults != Faults():  # what a fault does must happen to the whole dump
            sglang_dump.writer_for(self.dump_config).flush()
        self._after_answer(rid)
        extra = 1 if self._hit(self.faults.wrong_prompt_tokens, rid) else 0
        return web.json_response({
            "text": "", "output_ids": [0],
            "meta_info": {"id": rid + ("-other" if rid.split("+retry")[0] in
                                       self.faults.answer_id else ""),
                          "prompt_tokens": len(ids) + extra,
                          "cached_tokens": self.faults.cached_tokens, "completion_tokens": 1,
                          "e2e_latency": time.time() - t0,
                          "finish_reason": {"type": "length", "length": 1}}})

    @staticmethod
    async def _close_midway(request):
        """Headers and half of a JSON body, then the connection drops (a crashed worker)."""
        body = b'{"text": "", "output_ids": [0], "meta_info": {"prompt_tokens": 1, "cac'
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = 2 * len(body)
        await resp.prepare(request)
        await resp.write(body)
        request.transport.close()
        return resp

    async def _schedule(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(0.002)  # let concurrent requests join the pass
            chunks, budget = [], self.max_prefill_tokens
            for req in self._queue:  # FIFO, a chunk of each request while the budget lasts
                rows = min(self.chunk_size, len(req.input_ids) - req.done, budget)
                if rows <= 0:
                    break
                chunks.append((req, rows))
                budget -= rows
            if self.faults.pass_delay_s:
                await asyncio.sleep(self.faults.pass_delay_s)
            self._forward(chunks)
            for req, rows in chunks:
                req.done += rows
                if req.done == len(req.input_ids):
                    self._queue.remove(req)
                    if not req.future.done():
                        req.future.set_result(None)

    def _forward(self, chunks: list[tuple[_Request, int]]) -> None:
        """One prefill pass through the real dump hook (MIXED for a faulted last chunk)."""
        mixed = [(r, n) for r, n in chunks if r.rid in self.faults.mixed_chunk_once
                 and r.done + n == len(r.input_ids) and r.done > 0]
        for req, _ in mixed:
            self.faults.mixed_chunk_once.discard(req.rid)
        extend = [c for c in chunks if c not in mixed]
        for mode, part in ((ForwardMode.EXTEND, extend), (ForwardMode.MIXED, mixed)):
            if part:
                self.passes.append([(r.rid, r.done, n) for r, n in part])
                sglang_dump.maybe_dump(*self._batch(part, mode, pad_rows=len(self.passes) % 4))

    def _batch(self, chunks, mode, pad_rows):
        aux_rows, final_rows, ids, lens = [], [], [], []
        for req, rows in chunks:
            if req.states is None:
                req.states = self._states(req.input_ids, req.rid)
            aux, final = req.states
            aux_rows.append(aux[req.done:req.done + rows])
            final_rows.append(final[req.done:req.done + rows])
            ids.append(torch.tensor(req.input_ids[req.done:req.done + rows], dtype=torch.long))
            lens.append(rows)
        width = aux_rows[0].shape[-1]
        aux_rows.append(torch.full((pad_rows, width), 1e4))  # CUDA-graph padding: garbage
        final_rows.append(torch.full((pad_rows, final_rows[0].shape[-1]), 1e4))
        ids.append(torch.zeros(pad_rows, dtype=torch.long))  # padding rows' ids: 0
        batch = SimpleNamespace(
            forward_mode=mode, rids=[r.rid for r, _ in chunks], input_ids=torch.cat(ids),
            extend_start_loc=torch.tensor([sum(lens[:j]) for j in range(len(lens))]),
            extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[r.done for r, _ in chunks])
        model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=self.capture_layers))
        aux_all = torch.cat(aux_rows)
        # Alternate SGLang's two aux layouts: a list of K [rows, H] (<= 0.5.16) or packed.
        aux_out = aux_all if len(self.passes) % 2 else list(aux_all.split(
            final_rows[0].shape[-1], dim=-1))
        return model, batch, torch.cat(final_rows), aux_out

    def _states(self, input_ids: list[int], rid: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([input_ids])
        aux, final = hs.capture_hf(self.model, ids, torch.ones_like(ids), self.state_layers)
        aux_TK = torch.cat([a[0] for a in aux], dim=-1)
        n_nan = self.faults.nan_states.get(rid.split("+retry")[0], 0)
        if n_nan:  # the second capture's first n_nan values
            H = final.shape[-1]
            second = aux_TK[:, H:2 * H].clone().view(-1)
            second[:n_nan] = float("nan")
            aux_TK[:, H:2 * H] = second.view(-1, H)
        return aux_TK, final[0]

    def _after_answer(self, rid: str) -> None:
        path = sglang_dump.dump_file_path(self.dump_config.dump_dir, rid)
        base = rid.split("+retry")[0]
        if rid in self.faults.drop_dump_once or base in self.faults.always_drop:
            self.faults.drop_dump_once.discard(rid)
            path.unlink(missing_ok=True)
        truncate_once = rid in self.faults.truncate_dump_once
        if (truncate_once or self._hit(self.faults.truncate_dump, rid)) and path.exists():
            self.faults.truncate_dump_once.discard(rid)
            data = path.read_bytes()
            path.write_bytes(data[:len(data) // 2])
        if self._hit(self.faults.short_rows_dump, rid) and path.exists():
            dump = sglang_dump.load_dump(path)  # num_tokens still says T
            dump["aux_hidden_states"] = dump["aux_hidden_states"][:-1].clone()
            sglang_dump.save_dump(dump, path)
        if base in self.faults.int_states and path.exists():
            dump = sglang_dump.load_dump(path)
            for key in ("aux_hidden_states", "final_hidden_states"):
                dump[key] = (dump[key].float() * 100).to(torch.int16)
            sglang_dump.save_dump(dump, path)
        if self.faults.old_format and path.exists():
            dump = sglang_dump.load_dump(path)
            for key in ("input_ids", "layout", "aux_hidden_states_scale"):
                dump.pop(key, None)
            torch.save({**dump, "version": 1},
                       sglang_dump.legacy_dump_path(self.dump_config.dump_dir, rid))
            path.unlink()
        self._replace_dump(path, self.faults.dump_entry.get(base))

    @staticmethod
    def _replace_dump(path: Path, kind: str | None) -> None:
        """What sits at the dump's path instead of the dump (Faults.dump_entry)."""
        if kind is None or not path.exists():
            return
        if kind == "bloated":
            with open(path, "ab") as f:
                f.write(bytes(1 << 20))
            return
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
            (path / "x").write_text("not a dump")  # a directory that rmdir cannot remove
