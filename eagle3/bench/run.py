"""Stage 05 measurements: offline (a transformers target) and against SGLang servers.

Offline (`run_offline`): plain decoding (the reference output and the baseline throughput) and
chain speculative decoding for each step count, per prompt. At temperature 0 the speculative
output must equal greedy decoding token for token; at temperature > 0 it is speculative sampling
(eagle3/bench/evaluate.py). Acceptance is aggregated the way SGLang reports it: committed tokens over
verify passes, over all prompts, plus the per-position acceptance rate (share of verify passes
that accepted at least i draft tokens). Every output's token ids are kept; next to every
acceptance length stand the loop share of the outputs and the acceptance of the rounds before
each output's first loop (eagle3/bench/loops.py).

SGLang (`measure_server`): for each prompt set and concurrency level, `max(prompts, 2 x
concurrency)` requests (prompts cycled) go to `/generate` with at most `concurrency` in flight.
How each figure is measured, on our own requests only:

- total output tok/s: sum of `completion_tokens` / wall time of the level (first request sent to
  last answer received);
- per-request output tok/s: mean over requests of `completion_tokens / latency`, latency being the
  client-side time from sending the request to its last byte;
- TTFT: client-side time from sending a request to the first streamed chunk carrying a token
  (`"stream": true`; SGLang emits a chunk as soon as the prefill produced the first token);
  None without streaming;
- acceptance length: `sum(completion_tokens) / sum(spec_verify_ct)` over the requests whose
  `meta_info` has `spec_verify_ct` (SGLang omits it for a request that never ran a verify pass);
- loop share: share of the output tokens inside repetition loops (eagle3/bench/loops.py); the
  loop-free acceptance needs per-round lengths, which SGLang does not report;
- speedup: speculative total tok/s / baseline total tok/s at the same prompt set and concurrency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass

import aiohttp
import torch

from eagle3.bench.context import acceptance_by_context
from eagle3.bench.evaluate import (Eagle3Proposer, TargetRunner, autoregressive_decode,
                             speculative_decode)
from eagle3.bench.loops import loop_stats, loop_summary
from eagle3.bench.prompts import PromptSet
from eagle3.core.server import ServerError

log = logging.getLogger(__name__)

__all__ = ["PromptSet", "run_offline", "measure_server", "summarize_level", "combine"]


# ---------------------------------------------------------------- offline


def per_position_rates(accept_lengths: list[int], steps: int) -> list[float]:
    """Share of verify passes whose accepted draft count is >= i, for i = 1..steps."""
    n = max(len(accept_lengths), 1)
    return [sum(1 for a in accept_lengths if a - 1 >= i) / n for i in range(1, steps + 1)]


def run_offline(model, draft, embed, prompt_set: PromptSet, steps_list: list[int],
                max_new_tokens: int, eos: set[int], bar=None, temperature: float = 0.0,
                seed: int = 0) -> dict:
    """Baseline + speculative runs of one prompt set; returns its results dict."""
    capture = draft.cfg.capture_layers
    proposer = Eagle3Proposer(draft, embed)
    base, spec = [], {s: [] for s in steps_list}
    for i, prompt in enumerate(prompt_set.prompts):
        gen = sampling_generator(seed, i)
        base.append(autoregressive_decode(TargetRunner(model, [0]), prompt, max_new_tokens, eos,
                                          temperature, gen))
        for s in steps_list:
            gen = sampling_generator(seed, i)
            spec[s].append(speculative_decode(model, proposer, prompt, max_new_tokens, eos, s,
                                              capture, temperature, gen))
        if bar is not None:
            bar.update(1)
    base_tokens = sum(len(r.output_ids) for r in base)
    out = {"prompts": len(prompt_set.prompts), "prompt_ids": prompt_set.ids,
           "temperature": temperature, "baseline_tokens": base_tokens,
           "baseline_tok_s": base_tokens / max(sum(r.seconds for r in base), 1e-9),
           "baseline_outputs": [r.output_ids for r in base],
           "baseline_loop_share": loop_stats([r.output_ids for r in base], eos).share,
           "steps": {}}
    for s, results in spec.items():
        out["steps"][str(s)] = _offline_steps(results, base, s, out["baseline_tok_s"],
                                              temperature, eos)
    return out


def sampling_generator(seed: int, prompt_index: int) -> torch.Generator:
    """The CPU generator (where sampling happens) of one prompt's decode: baseline and every
    step count of prompt `prompt_index` draw from the same seed, so greedy runs stay lossless
    and sampled runs are comparable."""
    return torch.Generator().manual_seed(seed + prompt_index)


def offline_summary(results, baseline_outputs: list[list[int]], steps: int,
                    baseline_tok_s: float, temperature: float,
                    eos: set[int] | None = None) -> dict:
    """Acceptance length (tokens per verify round), per-position acceptance, tok/s, speedup,
    (greedy only) outputs that differ from plain decoding, and the loop share and loop-free
    acceptance beside them (eagle3/bench/loops.py; a trailing `eos` id is not counted), for one
    step count's decode results (`speculative_decode` answers, one per prompt, in the
    baseline's order)."""
    lengths = [a for r in results for a in r.accept_lengths]
    tok_s = sum(len(r.output_ids) for r in results) / max(sum(r.seconds for r in results), 1e-9)
    mismatches = None  # sampling: outputs differ from the baseline's by design
    if temperature == 0:
        mismatches = sum(1 for r, g in zip(results, baseline_outputs) if r.output_ids != g)
        if mismatches:
            log.error("steps %d: %d of %d outputs differ from greedy decoding", steps, mismatches,
                      len(results))
    return {
        "acceptance_length": sum(lengths) / max(len(lengths), 1),
        "verify_passes": len(lengths),
        "per_position_acceptance": per_position_rates(lengths, steps),
        "tok_s": tok_s,
        "speedup": tok_s / baseline_tok_s,
        "lossless_mismatches": mismatches,
        **loop_summary([r.output_ids for r in results], [r.accept_lengths for r in results],
                       eos),
        "acceptance_by_context": acceptance_by_context([r.accept_lengths for r in results],
                                                       [r.round_contexts for r in results]),
    }


def _offline_steps(results, base, steps: int, base_tok_s: float, temperature: float,
                   eos: set[int]) -> dict:
    return {**offline_summary(results, [g.output_ids for g in base], steps, base_tok_s,
                              temperature, eos),
            "outputs": [r.output_ids for r in results],
            "accept_lengths": [r.accept_lengths for r in results]}


# ---------------------------------------------------------------- SGLang


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


@dataclass
class LoadSettings:
    """What every request of a measurement sends and how."""

    sampling_params: dict
    stream: bool = True
    incremental_stream: bool = False  # the server's --incremental-streaming-output
    timeout_s: float = 3600.0


def merge_stream_ids(ids: list[int], chunk_ids: list[int], completion_tokens: int | None):
    """Output ids after one streamed chunk: cumulative chunks replace, deltas extend."""
    if completion_tokens is not None and len(chunk_ids) == completion_tokens:
        return list(chunk_ids)
    return ids + list(chunk_ids)


async def _read_stream(resp, incremental: bool, t0: float) -> tuple[list[int], dict, float | None]:
    """(output ids, last meta_info, TTFT) of an SSE answer. Cumulative chunks are parsed only
    first and last (a long output re-sends every id in every chunk)."""
    buf, first_at, ids, meta, last_raw = b"", None, [], {}, None
    async for piece in resp.content.iter_any():
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for event in events:
            data = event.strip()[len(b"data:"):].strip() if event.strip() else b""
            if not data or data == b"[DONE]":
                continue
            if first_at is None:
                first_at = time.perf_counter() - t0
            if incremental or last_raw is None or b'"error"' in data[:20]:
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"streamed error: {chunk['error']}")
                meta = chunk.get("meta_info", {})
                ids = merge_stream_ids(ids, chunk.get("output_ids") or [],
                                       meta.get("completion_tokens"))
            last_raw = data
    if not incremental and last_raw is not None:
        chunk = json.loads(last_raw)
        meta = chunk.get("meta_info", {})
        ids = list(chunk.get("output_ids") or [])
    return ids, meta, first_at


async def send_request(session: aiohttp.ClientSession, base_url: str, input_ids: list[int],
                       rid: str, load: LoadSettings) -> tuple[list[int], dict, float | None, float]:
    """One `/generate` request: (output ids, meta_info, TTFT s, latency s). Not retried: a
    retry would hide in the timings."""
    payload = {"input_ids": input_ids, "rid": rid, "sampling_params": load.sampling_params,
               "stream": load.stream}
    t0 = time.perf_counter()
    try:
        async with session.post(base_url.rstrip("/") + "/generate", json=payload,
                                timeout=aiohttp.ClientTimeout(total=load.timeout_s)) as resp:
            if resp.status != 200:
                raise ServerError(f"{base_url}: HTTP {resp.status} for request {rid}: "
                                  f"{(await resp.text())[:300]}")
            if load.stream:
                ids, meta, ttft = await _read_stream(resp, load.incremental_stream, t0)
            else:
                body = await resp.json(content_type=None)
                ids, meta, ttft = body.get("output_ids") or [], body.get("meta_info", {}), None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ServerError(f"{base_url}: request {rid} failed: {e!r}") from e
    return ids, meta, ttft, time.perf_counter() - t0


async def run_level(base_url: str, prompts: list[list[int]], concurrency: int,
                    load: LoadSettings, tag: str, bar=None,
                    send=None) -> tuple[list[RequestRecord], float]:
    """All requests of one concurrency level; returns the records and the wall time.
    `send` has `send_request`'s signature (default: SGLang's `/generate`; vLLM: bench/vllm.py)."""
    send = send or send_request
    n = max(len(prompts), 2 * concurrency)
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t_level = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            async with limit:
                p = i % len(prompts)
                rid = f"bench-{tag}-{i}-{uuid.uuid4().hex[:8]}"
                start = time.perf_counter() - t_level
                ids, meta, ttft, latency = await send(session, base_url, prompts[p], rid, load)
                if bar is not None:
                    bar.update(1)
                return RequestRecord(p, rid, ids, int(meta.get("completion_tokens", len(ids))),
                                     int(meta.get("prompt_tokens", len(prompts[p]))),
                                     int(meta.get("cached_tokens", 0)), meta.get("spec_verify_ct"),
                                     ttft, latency, start)

        records = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t_level
    return list(records), wall


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize_level(records: list[RequestRecord], wall_s: float) -> dict:
    """The figures of one level (definitions in the module docstring)."""
    tokens = sum(r.completion_tokens for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    verified = [r for r in records if r.spec_verify_ct]
    verify_ct = sum(r.spec_verify_ct for r in verified)
    return {
        "requests": len(records),
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
                              if verify_ct else None),
        "spec_verify_ct": verify_ct,
        "requests_without_verify_ct": len(records) - len(verified),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "loop_share": loop_stats([r.output_ids for r in records]).share,
    }


def measure_server(base_url: str, role: str, prompt_sets: list[PromptSet],
                   concurrencies: list[int], load: LoadSettings, sink=None,
                   warmup_tokens: int = 16, bar=None) -> dict:
    """{prompt set: {concurrency: summary}} of one server; every request record goes to
    `sink.write(dict)` (a JsonlAppender) with its role, set and concurrency."""

    async def go() -> dict:
        warm = LoadSettings({**load.sampling_params, "max_new_tokens": warmup_tokens},
                            load.stream, load.incremental_stream, load.timeout_s)
        await run_level(base_url, prompt_sets[0].prompts[:1], 1, warm, f"{role}-warmup")
        out: dict = {}
        for ps in prompt_sets:
            out[ps.name] = {}
            for c in concurrencies:
                records, wall = await run_level(base_url, ps.prompts, c, load,
                                                f"{role}-{ps.name}-c{c}", bar)
                out[ps.name][str(c)] = summarize_level(records, wall)
                log.info("%s %s c=%d: %s", role, ps.name, c, brief_level(out[ps.name][str(c)]))
                write_level_records(sink, role, ps, c, records)
        return out

    return asyncio.run(go())


def write_level_records(sink, role: str, ps, concurrency: int, records) -> None:
    """One line per request of a level to `sink` (None: nothing), tagged with where it ran."""
    if sink is None:
        return
    for r in records:
        sink.write({"role": role, "prompt_set": ps.name, "concurrency": concurrency,
                    "prompt_id": ps.ids[r.prompt_index] if ps.ids else None, **asdict(r)})


def brief_level(s: dict) -> str:
    """One log line of a level's summary: speed, and acceptance with the loop share beside it."""
    acc = s["acceptance_length"]
    return (f"{s['total_tok_s']:.1f} tok/s total, {s['per_request_tok_s']:.1f} per request"
            + (f", acceptance {acc:.3f} (loop share {s['loop_share']:.0%})"
               if acc is not None else ""))


def combine(baseline: dict, speculative: dict) -> dict:
    """{set: {concurrency: {baseline, speculative, speedup, per_request_speedup}}}."""
    out = {}
    for name, levels in speculative.items():
        out[name] = {}
        for c, spec in levels.items():
            base = baseline.get(name, {}).get(c)
            row = {"baseline": base, "speculative": spec, "speedup": None,
                   "per_request_speedup": None}
            if base and base["total_tok_s"] > 0:
                row["speedup"] = spec["total_tok_s"] / base["total_tok_s"]
                row["per_request_speedup"] = spec["per_request_tok_s"] / base["per_request_tok_s"]
            out[name][c] = row
    return out
