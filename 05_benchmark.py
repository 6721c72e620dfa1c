#!/usr/bin/env python3
"""Stage 05: measure the draft — acceptance length, and speed against no draft.

`--backend hf`: chain speculative decoding of the draft against a transformers target (greedy at
temperature 0, checked token for token against plain greedy decoding; speculative sampling
above 0), for each `--steps`. `--backend sglang`: a baseline server (no draft) and a speculative
server (EAGLE3 + this draft), attached by URL or launched here from `--launch-args`, measured at
each `--concurrency` on each prompt set: tokens/s in total and per request, TTFT, acceptance
length (sum completion_tokens / sum spec_verify_ct) and speedup. `--backend vllm`: the same
against a plain and an EAGLE-3 vLLM server (`--speculative-config`, `--steps K` draft tokens;
default draft: the folder 04 wrote for vLLM, `<workdir>/04_train/final_speculators`, or
`final/` for an MLA draft, as 04's manifest says), acceptance from vLLM's `/metrics`
counters, speculative outputs checked against plain ones at temperature 0 (eagle3/bench/vllm.py).
All write
`<workdir>/05_benchmark/results.json`, `report.md` and PNG plots (sglang: `requests.jsonl`
with every request and its output ids, and the server logs when launched here).

Before measuring, and alone with `--check-only`, the preflight reads the draft's config and
safetensors headers (names, shapes, fc width, d2t, layer ids on the SGLang release in use) and
the servers' flags, and refuses what would silently serve garbage (e.g. EAGLE with an EAGLE-3
draft). Prompt sets: `eval` (held-out split), `chat`, `code`, `math`, `tools` (prompts/), or
JSONL paths.

Tiny target (demo):
    python 05_benchmark.py --workdir runs/demo --target runs/demo/target --backend hf \
        --steps 3 7 --max-new-tokens 32 --num-prompts 8 --prompt-sets eval
Real run against SGLang servers: see train_plan_v4.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.bench.run import LoadSettings, combine, measure_server, run_offline
from eagle3.bench.report import report_markdown, summary_rows, write_plots
from eagle3.bench.vllm import check_vllm_draft, default_vllm_draft, run_vllm
from eagle3.core.chat import ChatRenderer
from eagle3.core.cli import UpstreamStageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.core.launcher import LaunchedServer, sglang_command
from eagle3.bench.preflight import (check_baseline_server, check_server_pair,
                                    check_speculative_server, check_streaming)
from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.draft.check import check_draft_for_run, read_draft_config
from eagle3.core.progress import format_summary, human_seconds, progress
from eagle3.bench.prompts import EVAL_SET, load_prompt_set
from eagle3.core.records import JsonlAppender
from eagle3.core.server import get_server_info
from eagle3.core.stage import (STAGE_DIRS, atomic_write_bytes, atomic_write_json, open_stage,
                               require_upstream)
from eagle3.core.target import TRUST_HELP, check_remote_code, load_tokenizer

STAGE = STAGE_DIRS["05"]
SPEC_DEFAULT = ("--speculative-num-steps 3 --speculative-eagle-topk 1 "
                "--speculative-num-draft-tokens 4")


@dataclass
class BenchmarkConfig(UpstreamStageFlags):
    target: Path | None = arg(None, "target model folder: tokenizer and config (weights for hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    draft: Path | None = arg(None, "draft folder (default: <workdir>/04_train/final; vllm: the "
                                   "folder 04 wrote for it, final_speculators/ or an MLA "
                                   "draft's final/)")
    backend: str = arg("hf", "hf: offline in transformers; sglang, vllm: baseline vs "
                             "speculative servers", choices=["hf", "sglang", "vllm"])
    check_only: bool = arg(False, "run the preflight checks and exit (0 ok, 1 refused)")
    prompt_sets: list[str] = arg(["eval"], "eval, chat, code, math, tools, or JSONL paths")
    num_prompts: int = arg(64, "prompts per set (the first N)")
    max_new_tokens: int = arg(256, "tokens generated per prompt")
    temperature: float = arg(0.0, "0 = greedy; > 0 = sampling (hf: speculative sampling)")
    seed: int = arg(0, "sampling seed (hf backend)")
    steps: list[int] = arg([3, 7], "hf: chain lengths (draft tokens per verify pass); vllm: "
                                   "one value, num_speculative_tokens")
    device: str = arg("cpu", "hf: torch device")
    dtype: str = arg("float32", "hf: target and draft dtype")
    baseline_url: str | None = arg(None, "sglang: running server without a draft")
    spec_url: str | None = arg(None, "sglang: running server with this draft (EAGLE3)")
    launch_args: str | None = arg(None, "sglang, vllm: launch both servers here, one after the "
                                        "other, with these flags (sglang: --model-path, "
                                        "--tp-size ...; vllm: --tensor-parallel-size ..., the "
                                        "model is --target)")
    spec_args: str = arg(SPEC_DEFAULT, "sglang: extra flags of the launched speculative server "
                                       "(05 adds --speculative-algorithm EAGLE3 and the draft)")
    port: int = arg(30000, "sglang: port of the launched servers")
    sglang_python: str = arg(sys.executable, "sglang: python that runs sglang.launch_server")
    vllm_python: str = arg(sys.executable, "vllm: python that runs vLLM's api_server (a venv "
                                           "of its own, e.g. .venv-vllm/bin/python)")
    ready_timeout_s: float = arg(3600.0, "sglang: seconds a launched server may take to load")
    concurrency: list[int] = arg([1, 4, 16, 64], "sglang: requests in flight, per level")
    stream: bool = arg(True, "sglang: stream answers (needed for TTFT)")
    sglang_version: str | None = arg(None, "release that will serve the draft, for the layer "
                                           "check without a server (default: both rules)")

    def __post_init__(self):
        if self.target is not None:
            check_remote_code(self.target, self.trust_remote_code)
        if self.backend == "hf" and self.target is None:
            raise ValueError("--backend hf needs --target (the transformers model folder)")
        attach = self.baseline_url is not None or self.spec_url is not None
        if self.backend == "vllm":
            if self.target is None:
                raise ValueError("--backend vllm needs --target (the served model folder)")
            if len(self.steps) != 1:
                raise ValueError("--backend vllm takes one --steps value (num_speculative_tokens "
                                 "of the speculative server), e.g. --steps 3")
        if self.backend in ("sglang", "vllm") and not self.check_only:
            if attach == (self.launch_args is not None):
                raise ValueError(f"--backend {self.backend} needs either --baseline-url and "
                                 "--spec-url "
                                 "(running servers) or --launch-args (start them here)")
            if attach and (self.baseline_url is None or self.spec_url is None):
                raise ValueError("give both --baseline-url and --spec-url")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(BenchmarkConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    draft_dir = cfg.draft or (default_vllm_draft(cfg.workdir) if cfg.backend == "vllm"
                              else cfg.workdir / STAGE_DIRS["04"] / "final")
    if cfg.check_only:
        return check_only(cfg, draft_dir)
    if EVAL_SET in cfg.prompt_sets:
        require_upstream(cfg.workdir / STAGE_DIRS["merge"], cfg.allow_partial)
    if cfg.draft is None:
        require_upstream(cfg.workdir / STAGE_DIRS["04"], cfg.allow_partial)
    if cfg.backend == "vllm":
        problems, layers, captures = check_vllm_draft(draft_dir, cfg.target, cfg.workdir)
    else:
        problems, layers = check_draft_for_run(draft_dir, cfg.target, cfg.workdir,
                                               cfg.sglang_version)
    raise_on_errors(problems, f"draft {draft_dir}")  # before any folder is made or server started
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    renderer = (ChatRenderer(load_tokenizer(cfg.target, cfg.trust_remote_code)) if cfg.target
                else None)
    sets = [load_prompt_set(s, cfg.workdir, renderer, cfg.num_prompts) for s in cfg.prompt_sets]
    if EVAL_SET in cfg.prompt_sets:
        stage.add_input(cfg.workdir / STAGE_DIRS["merge"] / "eval.jsonl")
    run = run_hf if cfg.backend == "hf" else run_sglang
    results = {"backend": cfg.backend, "draft": str(draft_dir), "layers": layers,
               "preflight": [str(p) for p in problems],
               "prompts": {ps.name: len(ps.prompts) for ps in sets}}
    if cfg.backend == "vllm":  # captures: the layers 02b dumped, checked in the server's log
        measured = run_vllm(cfg, draft_dir, sets, stage.dir, captures)
    else:
        measured = run(cfg, draft_dir, sets, stage.dir, renderer)
    results["preflight"] += measured.pop("preflight", [])  # the servers' own checks
    results.update(measured)
    atomic_write_json(stage.dir / "results.json", results)
    atomic_write_bytes(stage.dir / "report.md", report_markdown(results).encode())
    plots = write_plots(results, stage.dir)
    outputs, rows, ok = summary_rows(results)
    stage.finish(outputs=outputs)
    rows.update(plots=", ".join(p.name for p in plots), layers=layers,
                time=human_seconds(time.time() - t0))
    print(format_summary("05 benchmark", rows))
    return 0 if ok else 1


def check_only(cfg: BenchmarkConfig, draft_dir: Path) -> int:
    """Preflight of the draft and of the servers given by URL; prints every problem."""
    if cfg.backend == "vllm":  # vLLM's rules only: the draft folder and its layers
        problems, layers, _ = check_vllm_draft(draft_dir, cfg.target, cfg.workdir)
        for p in problems:
            print(p)
        errors = sum(p.level == "error" for p in problems)
        print(format_summary("05 preflight (vLLM)", {"draft": str(draft_dir), "layers": layers,
                                                     "errors": errors}))
        return 1 if errors else 0
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


async def _server_infos(urls: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return {role: await get_server_info(session, url) for role, url in urls.items() if url}


def run_hf(cfg, draft_dir: Path, sets, stage_dir: Path, renderer) -> dict:
    import torch

    from eagle3.draft.export import load_draft
    from eagle3.core.target import load_embedding, load_hf_model

    dtype = getattr(torch, cfg.dtype)
    model = load_hf_model(cfg.target, cfg.dtype, cfg.device, cfg.trust_remote_code)
    draft = load_draft(draft_dir, cfg.device, dtype)
    embed = load_embedding(cfg.target).to(cfg.device, dtype)
    eos = {renderer.end_of_turn_id}
    out = {}
    for ps in sets:
        bar = progress(total=len(ps.prompts), desc=f"05 {ps.name}", unit="prompt")
        out[ps.name] = run_offline(model, draft, embed, ps, cfg.steps, cfg.max_new_tokens, eos,
                                   bar, cfg.temperature, cfg.seed)
        bar.close()
    peak = (torch.cuda.max_memory_allocated(torch.device(cfg.device))
            if torch.device(cfg.device).type == "cuda" else None)
    return {"temperature": cfg.temperature, "prompt_sets": out, "peak_gpu_bytes": peak}


def run_sglang(cfg, draft_dir: Path, sets, stage_dir: Path, renderer) -> dict:
    """Baseline, then speculative: each attached or launched, checked, then measured.

    "preflight" in the answer: the servers' warnings, for results.json."""
    load = LoadSettings({"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature},
                        cfg.stream)
    n = sum(max(len(ps.prompts), 2 * c) for ps in sets for c in cfg.concurrency)
    bar = progress(total=2 * n, desc="05 requests", unit="req")
    (stage_dir / "requests.jsonl").unlink(missing_ok=True)  # a re-run measures afresh
    measured, servers = {}, {}
    with JsonlAppender(stage_dir / "requests.jsonl") as sink:
        for role in ("baseline", "speculative"):
            with _server(cfg, role, draft_dir, stage_dir) as url:
                info = asyncio.run(_server_infos({role: url}))[role]
                servers[role] = _check_server(role, info, url, cfg, draft_dir)
                load.incremental_stream = bool(info.get("incremental_streaming_output"))
                measured[role] = measure_server(url, role, sets, cfg.concurrency, load, sink,
                                                bar=bar)
    bar.close()
    pair = check_server_pair(*(servers[r].pop("info") for r in ("baseline", "speculative")))
    raise_on_errors(pair, "servers")
    notes = [n for role in ("baseline", "speculative") for n in servers[role].pop("preflight")]
    return {"preflight": notes + [str(p) for p in pair], "servers": servers,
            "sampling_params": load.sampling_params, "stream": cfg.stream,
            "prompt_sets": combine(measured["baseline"], measured["speculative"])}


def _check_server(role: str, info: dict, url: str, cfg, draft_dir: Path) -> dict:
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


@contextlib.contextmanager
def _server(cfg, role: str, draft_dir: Path, stage_dir: Path):
    """The URL of a running server (attached) or of one launched for the block."""
    if cfg.launch_args is None:
        yield cfg.baseline_url if role == "baseline" else cfg.spec_url
        return
    # Deltas instead of the whole reply in every streamed chunk: the client stays cheap.
    extra = ["--incremental-streaming-output"] if cfg.stream else []
    if role == "speculative":
        extra += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                  str(draft_dir), *shlex.split(cfg.spec_args)]
    command = sglang_command(cfg.sglang_python, cfg.launch_args, cfg.port, extra)
    url = f"http://127.0.0.1:{cfg.port}"
    with LaunchedServer(command, stage_dir / f"server_{role}.log", url, cfg.ready_timeout_s):
        yield url


if __name__ == "__main__":
    sys.exit(main())
