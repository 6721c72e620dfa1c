#!/usr/bin/env python3
"""Stage 01b: regenerate responses with the target -> tokenized records per dataset.

Reads `<workdir>/01_prepared/*/conversations.jsonl`; writes
`<workdir>/01b_generated/<dataset>/tokenized.jsonl` (input_ids + loss_mask per docs/PIPELINE.md),
`raw.jsonl` (every answer as received), `failures.jsonl` (records that failed, with the reason)
and `quarantine.jsonl` (conversations that cannot be rendered). Datasets whose recipe entry says
`"regenerate": false` keep their replies, rendered with the target's chat template.
Killed (even with SIGKILL) and re-run with the same command, it resumes by record id; Ctrl-C
once lets the requests in flight finish, twice abandons them. Answers are appended as they
complete; when a dataset is done its files are rewritten in the order of its conversations, so
a resumed run ends with the files of an uninterrupted one.

Backends: `sglang` (the real run: native /generate, exact output ids), `openai` (any
/v1/chat/completions server; the reply is re-rendered with the template), `hf` (in process).

Tiny target (demo):
    python 01b_generate_synthetic.py --workdir runs/demo --target runs/demo/target \\
        --backend hf --max-new-tokens 48
Real run (see train_plan_v4.md for the SGLang server; several --server-url for several servers):
    python 01b_generate_synthetic.py --workdir runs/kimi-k25 --target /models/Kimi-K2.5 \\
        --backend sglang --server-url http://127.0.0.1:30000 --max-new-tokens 8192 \\
        --concurrency 192 --long-concurrency 32
An OpenAI-compatible server with a key:
    OPENAI_API_KEY=... python 01b_generate_synthetic.py ... --backend openai \\
        --server-url https://host:8000 --api-key-env OPENAI_API_KEY --served-model NAME
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.chat import ChatRenderer, RenderError
from eagle3.core.cli import UpstreamStageFlags, arg, config_dict, parse_config, setup_logging
from eagle3.core.progress import format_summary, human_bytes, human_seconds, progress
from eagle3.core.records import JsonlAppender, read_jsonl
from eagle3.core.server import RetryPolicy, ServerError, ServerPool
from eagle3.core.stage import (
    STAGE_DIRS,
    Quarantine,
    atomic_write_json,
    open_stage,
    require_upstream,
)
from eagle3.core.target import TRUST_HELP, check_remote_code, load_hf_model, load_tokenizer
from eagle3.generate.backends import OpenAIBackend, SGLangBackend
from eagle3.generate.jobs import (
    HFGenerator,
    RecordSink,
    build_job,
    done_ids,
    run_generation,
    tokenize_kept,
    write_in_job_order,
)
from eagle3.generate.runner import Interrupted, RunnerConfig, connect, run_remote

STAGE = STAGE_DIRS["01b"]
UPSTREAM = STAGE_DIRS["01"]


@dataclass
class GenerateConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (tokenizer + chat template; weights for hf)")
    trust_remote_code: bool = arg(False, TRUST_HELP)
    backend: str = arg("hf", "who generates: sglang (native /generate, exact output ids), "
                             "openai (/v1/chat/completions, reply re-rendered), hf (in process)",
                       choices=["hf", "sglang", "openai"])
    server_url: list[str] = arg(["http://127.0.0.1:30000"], "sglang/openai: server base URLs "
                                "(several: requests are spread over them)")
    pool_policy: str = arg("least_outstanding", "how requests pick a server",
                           choices=["least_outstanding", "round_robin"])
    max_new_tokens: int = arg(2048, "generation budget per reply, tokens (also capped by the "
                                    "dataset's max_seq_len)")
    temperature: float = arg(0.0, "sampling temperature (0 = greedy)")
    thinking: bool = arg(True, "render prompts with thinking on (the served reasoning mode)")
    keep_length: bool = arg(True, "keep replies cut by the length limit (finish_reason "
                                  "'length'); --no-keep-length drops them")
    concurrency: int = arg(200, "sglang/openai: requests in flight (150-200 up to ~10K context)")
    long_concurrency: int = arg(32, "requests in flight in the second, long-context pass")
    long_context_threshold: int = arg(10240, "prompt + budget tokens above which a request "
                                             "runs in the long-context pass")
    max_attempts: int = arg(6, "attempts per record before it goes to failures.jsonl")
    request_timeout_s: float = arg(3600.0, "per-request timeout, seconds")
    retry_delay_s: float = arg(1.0, "first retry backoff, seconds (doubles per attempt, "
                                    "capped at 30s, jittered)")
    server_down_timeout_s: float = arg(1800.0, "stop when no server answers for this long, "
                                               "seconds (also the wait for readiness at start)")
    poll_s: float = arg(5.0, "how often a down or starting server is polled, seconds")
    served_model: str = arg("", "openai: model name to request ('' = first of /v1/models)")
    api_key_env: str = arg("", "openai: name of the environment variable holding the API key "
                               "('' = no key); the key itself is never a flag")
    check_prompt_tokens: bool = arg(True, "openai: fail a record whose usage.prompt_tokens "
                                          "differs from our rendered prompt")
    max_failure_fraction: float = arg(0.01, "largest share of failed records that still "
                                            "completes the stage")
    batch_size: int = arg(8, "hf backend: prompts generated together")
    dtype: str = arg("float32", "hf backend: model dtype (float32, bfloat16)")
    device: str = arg("cpu", "hf backend: torch device")

    def __post_init__(self) -> None:
        check_remote_code(self.target, self.trust_remote_code)
        for name in ("max_new_tokens", "batch_size", "concurrency", "long_concurrency",
                     "long_context_threshold", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0 (0 = greedy)")
        if not 0 <= self.max_failure_fraction <= 1:
            raise ValueError("--max-failure-fraction must be in [0, 1]")
        if self.api_key_env and self.backend != "openai":
            raise ValueError("--api-key-env is for --backend openai")


def build_generator(cfg: GenerateConfig, renderer: ChatRenderer, tokenizer,
                    api_key: str | None):
    """The hf generator or a server backend, ready to use."""
    if cfg.backend == "hf":
        model = load_hf_model(cfg.target, cfg.dtype, cfg.device, cfg.trust_remote_code)
        return HFGenerator(model, [renderer.end_of_turn_id], tokenizer.pad_token_id)
    pool = ServerPool(cfg.server_url, cfg.pool_policy)
    policy = RetryPolicy(base_delay_s=cfg.retry_delay_s, timeout_s=cfg.request_timeout_s)
    if cfg.backend == "sglang":
        backend = SGLangBackend(pool, renderer.end_of_turn_id, policy, cfg.temperature)
    else:
        backend = OpenAIBackend(pool, renderer, policy, cfg.served_model, cfg.temperature,
                                api_key, cfg.check_prompt_tokens)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    connect(backend, cfg.server_down_timeout_s, cfg.poll_s, headers)
    return backend


def regenerate(name: str, jobs: list, cfg: GenerateConfig, out_dir: Path, generator) -> dict:
    """Generate the jobs not done yet; returns the dataset's generation counts."""
    done = done_ids(out_dir)
    sink = RecordSink(out_dir, cfg.keep_length)
    try:
        if cfg.backend == "hf":
            bar = progress(total=len(jobs), desc=f"01b {name} (generate)", unit="req")
            counts = dict(run_generation(jobs, generator, sink, done, cfg.batch_size, bar))
        else:
            todo = [j for j in jobs if j.id not in done]
            bar = progress(total=len(todo), desc=f"01b {name} ({cfg.backend})", unit="req")
            runner_cfg = RunnerConfig(cfg.concurrency, cfg.long_concurrency,
                                      cfg.long_context_threshold, cfg.max_attempts,
                                      cfg.server_down_timeout_s, cfg.poll_s)
            t0 = time.monotonic()
            counts = run_remote(todo, generator, sink, runner_cfg, generator.policy, bar)
            counts.update(sink.counts, seconds=round(time.monotonic() - t0, 1),
                          servers=dict(generator.pool.sent), **generator.stats)
        bar.close()
    finally:
        sink.close()
    ids = [j.id for j in jobs]  # every job answered: the files in conversation order
    for f in ("tokenized.jsonl", "raw.jsonl", "failures.jsonl"):
        write_in_job_order(out_dir / f, ids)
    counts.update(resumed=len(done), failure_reasons=sink.failure_reasons, jobs=len(jobs))
    return counts


def process_dataset(name: str, opts: dict, cfg: GenerateConfig, stage_dir: Path,
                    renderer: ChatRenderer, generator) -> dict:
    """Tokenize or regenerate one dataset into `stage_dir/<name>/`; returns its counts."""
    src = cfg.workdir / UPSTREAM / name / "conversations.jsonl"
    out_dir = stage_dir / name
    (out_dir / "quarantine.jsonl").unlink(missing_ok=True)  # rebuilt whole on every run
    quarantine = Quarantine(out_dir / "quarantine.jsonl")
    counts = {"regenerate": opts["regenerate"]}
    if not opts["regenerate"]:
        done = done_ids(out_dir)
        with JsonlAppender(out_dir / "tokenized.jsonl") as out:
            for conv in progress(read_jsonl(src), desc=f"01b {name} (keep)", unit="conv"):
                try:
                    records = list(tokenize_kept(conv, renderer, opts["max_seq_len"]))
                except RenderError as e:
                    quarantine.add(conv["id"], str(e))
                    continue
                for rec in records:
                    if rec["id"] not in done:
                        out.write(rec)
    else:
        jobs, seen = [], set()
        for conv in read_jsonl(src):
            try:
                if conv["id"] in seen:
                    raise RenderError("duplicate id: a record with this id came earlier")
                jobs.append(build_job(conv, renderer, opts["max_seq_len"], cfg.max_new_tokens))
                seen.add(conv["id"])
            except RenderError as e:
                quarantine.add(conv["id"], str(e))
        counts.update(regenerate(name, jobs, cfg, out_dir, generator))
    quarantine.close()
    counts["records"] = len(_tokenized_ids(out_dir))
    counts["quarantined"] = quarantine.count
    atomic_write_json(out_dir / "done.json", counts)
    return counts


def _tokenized_ids(out_dir: Path) -> set[str]:
    path = out_dir / "tokenized.jsonl"
    return {r["id"] for r in read_jsonl(path)} if path.exists() else set()


def summary_rows(outputs: dict, seconds: float, disk: int) -> dict:
    rows = {}
    for n, c in outputs.items():
        rows[f"{n} records (quarantined)"] = f"{c['records']} ({c['quarantined']})"
        if c.get("regenerate"):
            s = max(c.get("seconds", 0.0), 1e-9)
            rows[f"{n} generated / failed"] = f"{c['generated']} / {c['failed']}"
            rows[f"{n} stop / length (dropped)"] = (f"{c['stop']} / {c['length']} "
                                                    f"({c['dropped_length']})")
            if "seconds" in c:
                rows[f"{n} req/s, out tok/s"] = (f"{c['generated'] / s:,.1f}, "
                                                 f"{c['output_tokens'] / s:,.0f}")
            for reason, k in c["failure_reasons"].items():
                rows[f"{n} failed: {reason[:40]}"] = k
    rows.update(time=human_seconds(seconds), disk=human_bytes(disk))
    return rows


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(GenerateConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    api_key = os.environ.get(cfg.api_key_env) or None if cfg.api_key_env else None
    if cfg.api_key_env and api_key is None:
        raise SystemExit(f"--api-key-env {cfg.api_key_env}: that environment variable is "
                             "not set or empty")
    upstream = require_upstream(cfg.workdir / UPSTREAM, cfg.allow_partial)
    stage = open_stage(cfg.workdir, STAGE, config_dict(cfg), cfg.force)
    if stage is None:
        return 0
    t0 = time.time()
    tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
    renderer = ChatRenderer(tokenizer, template_kwargs={"thinking": cfg.thinking})
    datasets = upstream["outputs"]["datasets"] if upstream else {}
    generator = None
    if any(d["regenerate"] for d in datasets.values()):
        generator = build_generator(cfg, renderer, tokenizer, api_key)
    outputs = {}
    try:
        for name, opts in datasets.items():
            stage.add_input(cfg.workdir / UPSTREAM / name / "conversations.jsonl")
            outputs[name] = process_dataset(name, opts, cfg, stage.dir, renderer, generator)
    except Interrupted as e:
        print(f"01b interrupted: {e}", file=sys.stderr)
        return 128 + e.signum
    except ServerError as e:  # every server down for too long: what was written stays
        print(f"01b stopped: {e}", file=sys.stderr)
        return 1
    failed = {n: c["failed"] for n, c in outputs.items()
              if c.get("failed", 0) > cfg.max_failure_fraction * max(c.get("jobs", 0), 1)}
    if failed:
        print(format_summary("01b generate (INCOMPLETE)", summary_rows(outputs, time.time() - t0,
                                                                        0)))
        print(f"too many failed records {failed} (> --max-failure-fraction "
              f"{cfg.max_failure_fraction}); see failures.jsonl, fix the cause and re-run the "
              "same command: only the missing records are generated", file=sys.stderr)
        return 1
    manifest = stage.finish(outputs={"datasets": outputs})
    print(format_summary("01b generate", summary_rows(outputs, time.time() - t0,
                                                      manifest["disk_bytes"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
