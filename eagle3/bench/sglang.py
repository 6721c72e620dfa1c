"""Stage 05 with the `sglang` backend: a baseline server (no draft) and one or more speculative
servers (EAGLE3 + this draft, one setting each: eagle3/bench/settings.py), attached by URL or
launched here from `--launch-args`, one after the other, measured at each `--concurrency` on each
prompt set (eagle3/bench/measure.py says how each figure is measured, eagle3/bench/compare.py
how the servers are compared); then the verdict, which setting to serve at each level
(eagle3/bench/verdict.py).

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

from eagle3.bench.compare import check_lossless, combine
from eagle3.bench.config import BenchmarkConfig, DraftCheck
from eagle3.bench.faults import raise_for_status
from eagle3.bench.measure import (
    LoadSettings,
    attached_or_launched,
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
from eagle3.bench.settings import (
    SeenSettings,
    SpecServer,
    label,
    served_setting,
    spec_servers,
)
from eagle3.bench.sse import SSEError, json_chunk, message_data
from eagle3.bench.verdict import RESULTS_VERSION, verdict
from eagle3.core.launcher import sglang_command
from eagle3.core.preflight import PreflightError, Problem, raise_on_errors
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
    specs = spec_servers(cfg.spec_url, cfg.spec_args, attached=True)
    infos = asyncio.run(_server_infos({"baseline": cfg.baseline_url,
                                       **{s.role: s.url for s in specs}}))
    version = (infos.get("speculative") or {}).get("version") or cfg.sglang_version
    try:
        problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir, version)
    except PreflightError as e:  # no config or no weights: nothing else can be checked
        print(f"error: {e}")
        return 1
    if "baseline" in infos:
        problems += check_baseline_server(infos["baseline"])
    draft_config, seen = read_draft_config(draft_dir), SeenSettings()
    for s in specs:
        found = check_speculative_server(infos[s.role], draft_config, draft_dir)
        problems += [Problem(p.level, f"{s.source}: {p.message}") if len(specs) > 1 else p
                     for p in found]
        try:
            seen.add(infos[s.role], f"{s.url} ({s.source})")
        except PreflightError as e:
            problems.append(Problem("error", str(e)))
    for p in problems:
        print(p)
    errors = sum(p.level == "error" for p in problems)
    print(format_summary("05 preflight", {"draft": str(draft_dir), "layers": layers,
                                          "servers": ", ".join(infos) or "none given",
                                          "errors": errors, "warnings": len(problems) - errors}))
    return 1 if errors else 0


def measure(cfg: BenchmarkConfig, draft_dir: Path, sets: list[PromptSet], stage_dir: Path,
            renderer, check: DraftCheck, stop=None) -> dict:
    """The baseline, then each speculative server: each attached or launched, checked, then
    measured; attached servers are all checked before any is measured.

    "preflight" in the answer: the servers' warnings, for results.json."""
    specs = spec_servers(cfg.spec_url, cfg.spec_args, cfg.launch_args is None)
    by_role = {s.role: s for s in specs}
    inspect = Inspector(cfg, draft_dir)
    if cfg.launch_args is None:  # every URL is known: refuse a bad one before measuring
        inspect.attached(cfg.baseline_url, specs)

    def measure_role(role: str, load: LoadSettings, sinks: dict, bar) -> tuple[dict, dict]:
        spec = by_role.get(role)
        with _server(cfg, role, spec, draft_dir, stage_dir) as (url, _):
            server = inspect(role, url, spec)
            info = server["info"]
            load.incremental_stream = bool(info.get("incremental_streaming_output"))
            load.speculative = spec is not None
            load.round_tokens = round_tokens(info) if load.speculative else None
            return server, measure_server(url, role, sets, cfg.concurrency, load, bar=bar,
                                          **sinks)

    roles = ("baseline", *by_role)
    measured, servers, load = measure_roles(cfg, sets, stage_dir, measure_role, stop, roles)
    settings = [served_setting(s, servers[s.role]["info"], servers[s.role]["url"], draft_dir)
                for s in specs]
    pair = server_pair_problems({r: servers[r].pop("info") for r in roles}, settings)
    raise_on_errors(pair, "servers")
    mismatches, lossless_notes = check_lossless(measured, cfg.temperature)
    notes = [n for role in roles for n in servers[role].pop("preflight")] + lossless_notes
    prompt_sets = combine(measured["baseline"], measured["speculative"],
                          {s.role: measured[s.role] for s in specs[1:]})
    return {"results_version": RESULTS_VERSION, "preflight": notes + [str(p) for p in pair],
            "servers": servers, "settings": settings, "sampling_params": load.sampling_params,
            "stream": cfg.stream, "lossless_mismatches": mismatches, "prompt_sets": prompt_sets,
            "verdict": verdict(prompt_sets, settings)}


def server_pair_problems(infos: dict, settings: list[dict]) -> list[Problem]:
    """Each speculative server against the baseline (eagle3/bench/preflight.py), named by its
    label when there are several."""
    problems = []
    for s in settings:
        for p in check_server_pair(infos["baseline"], infos[s["role"]]):
            problems.append(p if len(settings) == 1 else
                            Problem(p.level, f"{s['label']} ({s['source']}): {p.message}"))
    return problems


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


class Inspector:
    """Each server's flags checked once (`/server_info`): its summary for results.json, with
    its warnings under "preflight" and its flags under "info"; a speculative server of a
    setting seen already is refused (eagle3/bench/settings.py)."""

    def __init__(self, cfg: BenchmarkConfig, draft_dir: Path):
        self.cfg, self.draft_dir = cfg, draft_dir
        self.draft_config = read_draft_config(draft_dir)
        self.seen, self.done = SeenSettings(), {}

    def attached(self, baseline_url: str, specs: list[SpecServer]) -> None:
        """Every attached server, before any is measured."""
        self("baseline", baseline_url, None)
        for s in specs:
            self(s.role, s.url, s)

    def __call__(self, role: str, url: str, spec: SpecServer | None) -> dict:
        if role not in self.done:
            info = asyncio.run(_server_infos({role: url}))[role]
            self.done[role] = self._check(role, info, url, spec)
        return dict(self.done[role])

    def _check(self, role: str, info: dict, url: str, spec: SpecServer | None) -> dict:
        cfg, draft_dir, layers = self.cfg, self.draft_dir, None
        where = f"{role} server {url}" + (f" ({spec.source})" if spec else "")
        if spec is None:
            problems = check_baseline_server(info)
        else:
            problems = check_speculative_server(info, self.draft_config, draft_dir)
            version_problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir,
                                                           info.get("version"))
            problems += [p for p in version_problems if p.level == "error"]
        if cfg.stream:
            problems += check_streaming(info)
        raise_on_errors(problems, where)
        if spec is not None:
            self.seen.add(info, where)
        algo = info.get("speculative_algorithm")
        return {"url": url, "version": info.get("version"), "model_path": info.get("model_path"),
                "speculative": algo and (f"{algo}, steps {info.get('speculative_num_steps')}, "
                                         f"topk {info.get('speculative_eagle_topk')}, draft "
                                         f"tokens {info.get('speculative_num_draft_tokens')}"),
                "label": label(info) if spec else None, "layers": layers, "info": info,
                "preflight": [f"{role} server: {p}" for p in problems]}


def _server(cfg: BenchmarkConfig, role: str, spec: SpecServer | None, draft_dir: Path,
            stage_dir: Path):
    """(url, log path or None) of a running server (attached) or of one launched for the
    block."""
    # Deltas instead of the whole reply in every streamed chunk: the client stays cheap.
    extra = ["--incremental-streaming-output"] if cfg.stream else []
    if spec is not None:
        extra += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                  str(draft_dir), *shlex.split(spec.spec_args or "")]
    return attached_or_launched(
        cfg, role, lambda: sglang_command(cfg.sglang_python, cfg.launch_args, cfg.port, extra),
        stage_dir, url=spec.url if spec else None)


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
