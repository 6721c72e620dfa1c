"""Stage 05 with the `sglang` backend: a baseline server (no draft) and a speculative server
(EAGLE3 + this draft), attached by URL or launched here from `--launch-args`, measured at each
`--concurrency` on each prompt set (eagle3/bench/measure.py says how each figure is measured).

Requests go to `/generate` with the prompt as token ids, streamed for TTFT; the acceptance
length is `sum(completion_tokens) / sum(spec_verify_ct)` over our own requests. Before measuring,
each server's flags are checked (eagle3/bench/preflight.py): e.g. EAGLE with an EAGLE-3 draft,
which serves garbage silently, is refused.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path

import aiohttp

from eagle3.bench.config import BenchmarkConfig, DraftCheck
from eagle3.bench.faults import raise_for_status
from eagle3.bench.measure import (
    ROLES,
    LoadSettings,
    attached_or_launched,
    check_lossless,
    combine,
    measure_levels,
    measure_roles,
)
from eagle3.bench.preflight import (
    check_baseline_server,
    check_server_pair,
    check_speculative_server,
    check_streaming,
)
from eagle3.bench.prompts import PromptSet
from eagle3.bench.sse import SSEError, json_chunk, message_data
from eagle3.core.launcher import sglang_command
from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.core.progress import format_summary
from eagle3.core.server import NotJSONError, TransientError, get_server_info, json_object
from eagle3.core.stage import STAGE_DIRS
from eagle3.draft.check import check_draft_for_run, read_draft_config


def default_draft(workdir: Path) -> Path:
    """04's SGLang draft folder."""
    return Path(workdir) / STAGE_DIRS["04"] / "final"


def check_draft(cfg: BenchmarkConfig, draft_dir: Path) -> DraftCheck:
    """The draft folder, its layers on the SGLang release named by --sglang-version (both rules
    when none is named)."""
    problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir,
                                           cfg.sglang_version)
    return DraftCheck(problems, layers)


def check_only(cfg: BenchmarkConfig, draft_dir: Path) -> int:
    """Preflight of the draft and of the servers given by URL; prints every problem."""
    infos = asyncio.run(_server_infos({"baseline": cfg.baseline_url, "speculative": cfg.spec_url}))
    version = (infos.get("speculative") or {}).get("version") or cfg.sglang_version
    try:
        problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir, version)
    except PreflightError as e:  # no config or no weights: nothing else can be checked
        print(f"error: {e}")
        return 1
    if "baseline" in infos:
        problems += check_baseline_server(infos["baseline"])
    if "speculative" in infos:
        problems += check_speculative_server(infos["speculative"], read_draft_config(draft_dir),
                                             draft_dir)
    for p in problems:
        print(p)
    errors = sum(p.level == "error" for p in problems)
    print(format_summary("05 preflight", {"draft": str(draft_dir), "layers": layers,
                                          "servers": ", ".join(infos) or "none given",
                                          "errors": errors, "warnings": len(problems) - errors}))
    return 1 if errors else 0


def measure(cfg: BenchmarkConfig, draft_dir: Path, sets: list[PromptSet], stage_dir: Path,
            renderer, check: DraftCheck, stop=None) -> dict:
    """Baseline, then speculative: each attached or launched, checked, then measured.

    "preflight" in the answer: the servers' warnings, for results.json."""

    def measure_role(role: str, load: LoadSettings, sinks: dict, bar) -> tuple[dict, dict]:
        with _server(cfg, role, draft_dir, stage_dir) as (url, _):
            info = asyncio.run(_server_infos({role: url}))[role]
            server = _check_server(role, info, url, cfg, draft_dir)
            load.incremental_stream = bool(info.get("incremental_streaming_output"))
            load.speculative = role == "speculative"
            load.round_tokens = round_tokens(info) if load.speculative else None
            return server, measure_server(url, role, sets, cfg.concurrency, load, bar=bar,
                                          **sinks)

    measured, servers, load = measure_roles(cfg, sets, stage_dir, measure_role, stop)
    pair = check_server_pair(*(servers[r].pop("info") for r in ROLES))
    raise_on_errors(pair, "servers")
    mismatches, lossless_notes = check_lossless(measured, cfg.temperature)
    notes = [n for role in ROLES for n in servers[role].pop("preflight")] + lossless_notes
    return {"preflight": notes + [str(p) for p in pair], "servers": servers,
            "sampling_params": load.sampling_params, "stream": cfg.stream,
            "lossless_mismatches": mismatches,
            "prompt_sets": combine(measured["baseline"], measured["speculative"])}


def round_tokens(info: dict) -> int | None:
    """The most tokens one verify round of the speculative server commits: its draft steps
    plus the target's own token (a tree of any width accepts one path); None when its
    `/server_info` does not say."""
    steps, tokens = info.get("speculative_num_steps"), info.get("speculative_num_draft_tokens")
    if type(steps) is int and steps > 0:
        return steps + 1
    return tokens if type(tokens) is int and tokens > 0 else None


def measure_server(base_url: str, role: str, prompt_sets: list[PromptSet],
                   concurrencies: list[int], load: LoadSettings, sink=None,
                   warmup_tokens: int = 16, bar=None, failed_sink=None, stop=None) -> dict:
    """{prompt set: {concurrency: summary}} of one SGLang server (eagle3/bench/measure.py)."""
    return measure_levels(base_url, role, prompt_sets, concurrencies, load, send_request, sink,
                          bar, warmup_tokens, failed_sink=failed_sink, stop=stop)


async def _server_infos(urls: dict) -> dict:
    async with aiohttp.ClientSession() as session:
        return {role: await get_server_info(session, url) for role, url in urls.items() if url}


def _check_server(role: str, info: dict, url: str, cfg: BenchmarkConfig, draft_dir: Path) -> dict:
    """The server's summary for results.json, with its warnings under "preflight"."""
    layers = None
    if role == "baseline":
        problems = check_baseline_server(info)
    else:
        problems = check_speculative_server(info, read_draft_config(draft_dir), draft_dir)
        version_problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir,
                                                       info.get("version"))
        problems += [p for p in version_problems if p.level == "error"]
    if cfg.stream:
        problems += check_streaming(info)
    raise_on_errors(problems, f"{role} server {url}")
    spec = info.get("speculative_algorithm")
    return {"url": url, "version": info.get("version"), "model_path": info.get("model_path"),
            "speculative": spec and (f"{spec}, steps {info.get('speculative_num_steps')}, topk "
                                     f"{info.get('speculative_eagle_topk')}, draft tokens "
                                     f"{info.get('speculative_num_draft_tokens')}"),
            "layers": layers if role == "speculative" else None, "info": info,
            "preflight": [f"{role} server: {p}" for p in problems]}


def _server(cfg: BenchmarkConfig, role: str, draft_dir: Path, stage_dir: Path):
    """(url, log path or None) of a running server (attached) or of one launched for the
    block."""
    # Deltas instead of the whole reply in every streamed chunk: the client stays cheap.
    extra = ["--incremental-streaming-output"] if cfg.stream else []
    if role == "speculative":
        extra += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                  str(draft_dir), *shlex.split(cfg.spec_args)]
    return attached_or_launched(
        cfg, role, lambda: sglang_command(cfg.sglang_python, cfg.launch_args, cfg.port, extra),
        stage_dir)


# ---------------------------------------------------------------- requests


def merge_stream_ids(ids: list[int], chunk_ids: list[int], completion_tokens: int | None):
    """Output ids after one streamed chunk: cumulative chunks replace, deltas extend."""
    if completion_tokens is not None and len(chunk_ids) == completion_tokens:
        return list(chunk_ids)
    return ids + list(chunk_ids)


def _answer(chunk: dict) -> tuple[list, dict]:
    """(output ids, meta_info) of a `/generate` answer or streamed chunk; SSEError when they
    are not a list and an object (a null meta_info is none)."""
    ids, meta = chunk.get("output_ids") or [], chunk.get("meta_info") or {}
    if not isinstance(ids, list) or not isinstance(meta, dict):
        raise SSEError(f"an answer whose output_ids or meta_info is not a list and an object: "
                       f"{str(chunk)[:200]}")
    return ids, meta


async def _read_stream(resp, incremental: bool, t0: float) -> tuple[list[int], dict, float | None]:
    """(output ids, last meta_info, TTFT) of an SSE answer (eagle3/bench/sse.py). Cumulative
    chunks are parsed only first and last (a long output re-sends every id in every chunk)."""
    first_at, ids, meta, last = None, [], {}, None
    async for data in message_data(resp.content):
        if first_at is None:
            first_at = time.perf_counter() - t0
        if incremental or last is None or '"error"' in data[:20]:
            chunk_ids, meta = _answer(json_chunk(data))
            completion = meta.get("completion_tokens")
            ids = merge_stream_ids(ids, chunk_ids, completion if type(completion) is int
                                   else None)
        last = data
    if not incremental and last is not None:
        ids, meta = _answer(json_chunk(last))
    return list(ids), meta, first_at


async def send_request(session: aiohttp.ClientSession, base_url: str, input_ids: list[int],
                       rid: str, load: LoadSettings) -> tuple[list[int], dict, float | None, float]:
    """One attempt of a `/generate` request: (output ids, meta_info, TTFT s, latency s).
    Raises TransientError (retried by eagle3/bench/faults.py: 5xx, 429, timeout, dropped
    connection, unparsable answer) or ServerError (other HTTP errors: not retried)."""
    payload = {"input_ids": input_ids, "rid": rid, "sampling_params": load.sampling_params,
               "stream": load.stream}
    url = base_url.rstrip("/") + "/generate"
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=payload,
                                timeout=aiohttp.ClientTimeout(total=load.timeout_s)) as resp:
            await raise_for_status(resp, base_url, rid)
            if load.stream:
                ids, meta, ttft = await _read_stream(resp, load.incremental_stream, t0)
            else:
                body = json_object(await resp.read(), resp.headers.get("Content-Type"), url)
                (ids, meta), ttft = _answer(body), None
    except (aiohttp.ClientError, TimeoutError, ValueError, NotJSONError) as e:
        raise TransientError(f"{base_url}: request {rid} failed: {e!r}") from e
    return ids, meta, ttft, time.perf_counter() - t0
