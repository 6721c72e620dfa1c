#!/usr/bin/env python3
"""The real SGLang on one GPU: the dump patch, our drafts served, the dump's cost at Kimi's width.

Runs on the lent GPU machine after `benchmarks/gpu_sglang.sh` has unpacked SGLang 0.5.17 into
`--sglang-site` (its own PYTHONPATH: it needs transformers 5.12.1, the pipeline runs on the
machine's own). Each phase writes `<out>/<phase>.json` as soon as it ends, so a call that runs
out of time still brings back what finished:

  dump   the tiny DeepSeek-V3 target at Kimi's latent width (576) served by the patched SGLang
         in bf16 with CUDA graphs and chunked prefill; 02b --backend sglang against 02b --backend
         hf on the same records, state by state (relative L2 error, beside HF bf16 against HF
         float32: the bf16 noise floor)
  serve  SmolLM2-135M-Instruct plain and with the committed chat draft (EAGLE3, chain of 3:
         --speculative-num-steps 3, topk 1, 4 draft tokens), both on the one GPU (started one after
         the other: SGLang sizes its KV cache from the memory free while it loads), CUDA graphs on; 05 --backend sglang on the held-out chat prompts at each
         --concurrency (tokens/s of both, the ratio, served acceptance, outputs against plain);
         05 --backend hf (the offline evaluator, float32) on the same prompts
  kimi   a random-weight DeepSeek-V3 target at Kimi-K2.5's width (hidden 7168, 64 heads,
         576-wide latent, vocabulary 163840, `--load-format dummy`; 8 layers, 8 experts all
         active, so each layer computes what one of Kimi's does per token) served by the patched
         SGLang twice side by side, dump on and dump off: prefill tokens/s of each (the patch's cost),
         the dump writer's counters (queue depth, seconds the server waited, bytes per token,
         time to drain its queue after the prefill), 02b's end-to-end tokens/s on the dump
         server; then the dump-on server alone with EAGLE3_DUMP_LAYOUT=fp8 (prefill, writer,
         02b --dtype fp8); then the same target with an MLA draft
         (Eagle3DeepseekV2ForCausalLM, random weights) under EAGLE3: its first answers, or the
         exact error
  pipeline        the whole pipeline on a real target, then its draft served beside plain
                  (benchmarks/gpu_pipeline.py, --pipeline-target, --pipeline-profile); in two
  pipeline-train  sessions: up to 04 (its draft goes back), then
  pipeline-serve  --pipeline-draft (that draft) served beside plain, and the offline 05

    python benchmarks/bench_sglang_gpu.py --phases dump serve kimi --out $OUT \
        --sglang-site /tmp/sglsite --smollm2 /tmp/gs/smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core.launcher import LaunchedServer  # noqa: E402
from eagle3.core.presets import draft_fields, get_preset  # noqa: E402
from eagle3.core.records import JsonlAppender  # noqa: E402
from eagle3.core.stage import open_stage  # noqa: E402
from eagle3.core.target import default_capture_layers  # noqa: E402
from eagle3.draft.export import sglang_config  # noqa: E402
from eagle3.draft.mla import mla_draft_config, read_mla_dims  # noqa: E402
from eagle3.draft.model import DraftConfig  # noqa: E402
from eagle3.tiny.archs import deepseek_v3_serving_fields  # noqa: E402

DRAFT = ROOT / "tests/fixtures/smollm2_chat_draft"
COMMON = ["--dtype", "bfloat16", "--attention-backend", "triton", "--sampling-backend",
          "pytorch", "--host", "127.0.0.1", "--skip-server-warmup", "--log-level", "info"]
DUMP_FLAGS = ["--disable-radix-cache"]  # cached prefixes would not be recomputed, nor dumped
CHAIN3 = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
# Kimi-K2.5's width (eagle3/core/presets.py) and its MLA sizes, at 8 layers (captures [2, 4, 5])
# with 8 experts all active: each layer computes per token what one of Kimi's does
_K = get_preset("kimi-k2.5")
KIMI = {"hidden_size": _K.hidden_size, "num_attention_heads": _K.num_attention_heads,
        "num_key_value_heads": _K.num_attention_heads, "vocab_size": _K.vocab_size,
        "intermediate_size": _K.intermediate_size, "num_hidden_layers": 8,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "moe_intermediate_size": 2048,
        "n_routed_experts": 8, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.827, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

log = logging.getLogger("bench_sglang_gpu")


def run(cmd: list[str], log_path: Path, check: bool = True) -> float:
    """Run a pipeline command, its output to `log_path`; returns its wall time."""
    t0 = time.time()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if check and proc.returncode != 0:
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}:\n{tail}")
    return time.time() - t0


def server(args, model: Path, port: int, flags: list[str], log_name: str,
           dump_dir: Path | None = None, dump_env: dict | None = None) -> LaunchedServer:
    """A launched SGLang server (its own site on PYTHONPATH; the dump on when `dump_dir`, with
    the dump's other variables in `dump_env`)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
           "--port", str(port), *COMMON, *flags]
    env = {"PYTHONPATH": args.sglang_site}
    if dump_dir is not None:
        env["EAGLE3_DUMP_DIR"] = str(dump_dir)
        env.update(dump_env or {})
    return LaunchedServer(cmd, args.work / "logs" / log_name, f"http://127.0.0.1:{port}",
                          ready_timeout_s=900, env=env)


def started(stack: ExitStack, *servers: LaunchedServer) -> float:
    """Start servers one after the other, each ready before the next starts (SGLang sizes its KV
    cache from the memory free while it loads, which a server loading beside it takes away);
    `stack` stops them. Returns the seconds it took."""
    t0 = time.time()
    for s in servers:
        stack.enter_context(s)
    return time.time() - t0


def write_json(args, name: str, data: dict) -> None:
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    log.info("wrote %s", path)


def write_merged(workdir: Path, lengths: list[int], vocab: int, seed: int = 0) -> int:
    """`01c_merged/{train,eval}.jsonl` of random ids (eval: 2 records); returns the tokens."""
    rng = random.Random(seed)
    stage = open_stage(workdir, "01c_merged", {})
    tokens = 0
    for split, ls in (("train", lengths), ("eval", lengths[:2])):
        with JsonlAppender(stage.dir / f"{split}.jsonl") as out:
            for i, T in enumerate(ls):
                out.write({"id": f"{split}/r{i}", "source": "random", "seq_len": T,
                           "input_ids": [rng.randrange(vocab) for _ in range(T)],
                           "loss_mask": [1] * T})
                tokens += T
    stage.finish(outputs={})
    return tokens


def compare_states(a_dir: Path, b_dir: Path) -> dict:
    """Per state, the worst and mean relative L2 error of b against a over every file."""
    files = sorted(p.relative_to(a_dir) for p in a_dir.rglob("data_*.pt"))
    worst, total, n, tokens = [0.0] * 4, [0.0] * 4, 0, 0
    for rel in files:
        a = torch.load(a_dir / rel, weights_only=True)
        b = torch.load(b_dir / rel, weights_only=True)
        assert torch.equal(a["input_ids"], b["input_ids"]), rel
        for i, (x, y) in enumerate(zip(a["hidden_states"], b["hidden_states"])):
            x, y = x.float(), y.float()
            err = ((x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12))
            worst[i] = max(worst[i], err.max().item())
            total[i] += err.sum().item()
        n += 1
        tokens += len(a["input_ids"])
    return {"files": n, "tokens": tokens, "worst_rel_l2": worst,
            "mean_rel_l2": [t / max(tokens, 1) for t in total]}


def phase_dump(args) -> None:
    w = args.work / "dump"
    tiny = w / "tiny"
    run([sys.executable, "-m", "eagle3.tiny.target", "--out", str(tiny), "--arch",
         "deepseek_v3_vllm"], w / "tiny.log")
    target = tiny  # the tiny targets carry the fields SGLang reads (deepseek_v3_serving_fields)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    lengths = [1, 7, 63, 64, 65, 300, 511, 513, 1000, 1500, 2047, 40] * 2
    runs = {}
    for name in ("hf_fp32", "hf_bf16", "sglang"):
        write_merged(w / name, lengths, vocab)
    common = ["--target", str(target), "--capture-layers", "2", "4", "5"]
    runs["hf_fp32_s"] = run([sys.executable, "02b_extract_hidden_states_sglang.py", "--workdir",
                             str(w / "hf_fp32"), "--backend", "hf", "--device", "cuda",
                             "--model-dtype", "float32", *common], w / "02b_hf.log")
    run([sys.executable, "02b_extract_hidden_states_sglang.py", "--workdir", str(w / "hf_bf16"),
         "--backend", "hf", "--device", "cuda", "--model-dtype", "bfloat16", *common],
        w / "02b_hf.log")
    dump_dir = w / "dumps"
    s = server(args, target, 30010, [*DUMP_FLAGS, "--chunked-prefill-size", "256",
                                     "--mem-fraction-static", "0.2", "--cuda-graph-max-bs", "8"],
               "dump_server.log", dump_dir)
    with ExitStack() as stack:
        started(stack, s)
        runs["sglang_s"] = run([sys.executable, "02b_extract_hidden_states_sglang.py",
                                "--workdir", str(w / "sglang"), "--backend", "sglang",
                                "--server-url", s.url, "--dump-dir", str(dump_dir),
                                "--concurrency", "8", *common], w / "02b_sglang.log")
    hook = [x for x in s.log_path.read_text(errors="replace").splitlines() if "captur" in x]
    base = w / "hf_fp32" / "02b_hidden_states"
    write_json(args, "dump", {
        "records": len(lengths) + 2, "lengths": lengths, "chunked_prefill_size": 256,
        "sglang_bf16_vs_hf_fp32": compare_states(base, w / "sglang" / "02b_hidden_states"),
        "hf_bf16_vs_hf_fp32": compare_states(base, w / "hf_bf16" / "02b_hidden_states"),
        "sglang_bf16_vs_hf_bf16": compare_states(w / "hf_bf16" / "02b_hidden_states",
                                                 w / "sglang" / "02b_hidden_states"),
        "hook_log": hook[:3], "seconds": runs})


def phase_serve(args) -> None:
    w = args.work / "serve"
    prompts = str(DRAFT / "heldout_chat.jsonl")
    mem = ["--mem-fraction-static", "0.3", "--context-length", "2048",
           "--cuda-graph-max-bs", str(max(args.concurrency))]
    plain = server(args, args.smollm2, 30020, mem, "plain.log")
    spec = server(args, args.smollm2, 30021,
                  [*mem, *CHAIN3, "--speculative-draft-model-path", str(DRAFT / "final")],
                  "spec.log")
    bench = [sys.executable, "05_benchmark.py", "--workdir", str(w / "served"), "--target",
             str(args.smollm2), "--draft", str(DRAFT / "final"), "--backend", "sglang",
             "--baseline-url", plain.url, "--spec-url", spec.url, "--prompt-sets", prompts,
             "--num-prompts", str(args.num_prompts), "--max-new-tokens",
             str(args.max_new_tokens), "--temperature", "0", "--sglang-version", "0.5.17",
             "--concurrency", *[str(c) for c in args.concurrency]]
    with ExitStack() as stack:
        start_s = started(stack, plain, spec)
        served_s = run(bench, w / "05_served.log", check=False)
    served = w / "served" / "05_benchmark" / "results.json"
    out = {"server_start_s": start_s, "served_s": served_s,
           "served": json.loads(served.read_text()) if served.exists() else None,
           "served_log_tail": (w / "05_served.log").read_text(errors="replace")[-4000:]}
    write_json(args, "serve", out)
    offline = [sys.executable, "05_benchmark.py", "--workdir", str(w / "offline"), "--target",
               str(args.smollm2), "--draft", str(DRAFT / "final"), "--backend", "hf",
               "--prompt-sets", prompts, "--num-prompts", str(args.num_prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0",
               "--steps", "3", "--device", "cuda", "--dtype", "float32"]
    out["offline_s"] = run(offline, w / "05_offline.log", check=False)
    res = w / "offline" / "05_benchmark" / "results.json"
    out["offline"] = json.loads(res.read_text()) if res.exists() else None
    write_json(args, "serve", out)
    for f in ("plain.log", "spec.log"):
        shutil.copy(args.work / "logs" / f, args.out / f"serve_{f}")


async def prefill(url: str, n: int, length: int, concurrency: int, vocab: int,
                  rid_prefix: str) -> dict:
    """`n` prompts of `length` random ids, one new token each, `concurrency` in flight."""
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(session, i):
        async with sem:
            body = {"input_ids": prompts[i], "rid": f"{rid_prefix}{i}-{time.time_ns()}",
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            async with session.post(url + "/generate", json=body) as r:
                r.raise_for_status()
                return (await r.json())["meta_info"]["prompt_tokens"]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(min(n, concurrency))))  # warm
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(n)))
        dt = time.perf_counter() - t0
    return {"requests": n, "prompt_tokens": sum(counts), "seconds": dt,
            "tokens_per_s": sum(counts) / dt}


def kimi_target(w: Path) -> Path:
    """Config + the tiny target's tokenizer (ids stay below its size): weights are dummy."""
    tiny = w / "tiny"
    run([sys.executable, "-m", "eagle3.tiny.target", "--out", str(tiny)], w / "tiny.log")
    target = w / "target"
    target.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, target / f.name)
    config = {**KIMI, **deepseek_v3_serving_fields(KIMI["max_position_embeddings"])}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def mla_draft(target: Path, out: Path) -> Path:
    """config.json of the MLA draft 04 sizes from `target` (weights: SGLang's dummy load); its
    MLP is the target's dense one."""
    base = DraftConfig(**{**draft_fields("kimi-k2.5"), "intermediate_size": _K.intermediate_size,
                          "capture_layers": default_capture_layers(KIMI["num_hidden_layers"])})
    cfg = mla_draft_config(base, read_mla_dims(target))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(sglang_config(cfg, "0.5.17"), indent=1))
    return out


def writer_stats(stats_file: Path, tokens: int, since: float, timeout_s: float = 300.0) -> dict:
    """The dump writer's counters (EAGLE3_DUMP_STATS_FILE) once its queue ran empty after
    `tokens` dumped tokens in all (or after `since`, a time.time(), when some failed); `drain_s`:
    how long that took from now. Never raises: a missing or stale file is reported as such."""
    t0, stats = time.time(), None
    while time.time() - t0 < timeout_s:
        try:
            stats = json.loads(stats_file.read_text())
        except (OSError, ValueError):  # not written yet, or read mid-replace
            stats = None
        if stats and stats["jobs_written"] + stats["jobs_failed"] == stats["jobs_submitted"] \
                and (stats["tokens"] >= tokens or stats["time"] >= since):
            return {"drain_s": time.time() - t0, "drained": True, "expected_tokens": tokens,
                    **stats}
        time.sleep(0.05)
    return {"drain_s": time.time() - t0, "drained": False, "expected_tokens": tokens,
            **(stats or {"error": f"no stats in {stats_file} after {timeout_s:.0f} s"})}


def prefill_dumped(out: dict, name: str, s: LaunchedServer, dump_dir: Path, stats_file: Path,
                   dumped: int) -> int:
    """`prefill_<name>_2048` on a dump server, then its writer's queue drained: `writer_<name>`
    (counters, drain time) and `prefill_<name>_2048_drained_tokens_per_s` (prefill tokens over
    the prefill and the drain). `dumped`: tokens this server dumped before; returns the new
    count (the 8 warm-up requests are dumped too)."""
    run = out[f"prefill_{name}_2048"] = asyncio.run(prefill(s.url, 64, 2048, 8, 1000, "eagle3-"))
    dumped += run["prompt_tokens"] + 8 * 2048
    stats = out[f"writer_{name}"] = writer_stats(stats_file, dumped, time.time())
    out[f"prefill_{name}_2048_drained_tokens_per_s"] = run["prompt_tokens"] / (
        run["seconds"] + stats["drain_s"])
    return dumped


def run_02b(w: Path, target: Path, s: LaunchedServer, dump_dir: Path, name: str,
            *extra: str) -> dict:
    """02b --backend sglang on 96 records of 2,048 tokens against `s` (`extra`: more flags),
    its work folder (and files) under `w`: its seconds, tokens/s, log tail and bytes written,
    keys prefixed `name`."""
    work = w / f"x{name}"
    tokens = write_merged(work, [2048] * 96, 1000)
    seconds = run([sys.executable, "02b_extract_hidden_states_sglang.py", "--workdir", str(work),
                   "--target", str(target), "--backend", "sglang", "--server-url", s.url,
                   "--dump-dir", str(dump_dir), "--concurrency", "16", *extra],
                  w / f"{name}.log", check=False)
    du = subprocess.run(["du", "-sb", str(work / "02b_hidden_states")],
                        capture_output=True, text=True).stdout.split()
    shutil.rmtree(work / "02b_hidden_states", ignore_errors=True)
    return {f"{name}_tokens": tokens, f"{name}_s": seconds,
            f"{name}_tokens_per_s": tokens / seconds,
            f"{name}_log_tail": (w / f"{name}.log").read_text(errors="replace")[-3000:],
            f"{name}_bytes": int(du[0]) if du else None}


KIMI_02B_RAM = Path("/dev/shm/eagle3-kimi-02b")  # kimi: 02b's work folders in RAM


def disk_write_rate(folder: Path, gib: int = 4) -> float:
    """GB/s of one sequential write of `gib` GiB into `folder`, fsync'd (then removed)."""
    block, path = os.urandom(1 << 20) * 16, folder / "disk_rate.bin"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(path, "wb") as f:
        for _ in range(gib * 64):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.time() - t0
    path.unlink()
    return gib * (1 << 30) / seconds / 1e9


def phase_kimi(args) -> None:
    w = args.work / "kimi"
    target = kimi_target(w)
    # the dumps where the plan puts them (/dev/shm by default); 02b's files on the local disk
    # (w), and again in RAM for its rate without the disk
    dump_dir = args.kimi_dumps / "dumps"
    flags = [*DUMP_FLAGS, "--load-format", "dummy", "--mem-fraction-static", "0.4",
             "--context-length", "8192", "--chunked-prefill-size", "8192",
             "--cuda-graph-max-bs", "8"]
    stats_file = w / "writer_stats.json"  # outside the dump dir, which is emptied between runs
    stats_file.unlink(missing_ok=True)
    on = server(args, target, 30030, flags, "kimi_dump_on.log", dump_dir,
                {"EAGLE3_DUMP_STATS_FILE": str(stats_file)})
    off = server(args, target, 30031, flags, "kimi_dump_off.log")
    out: dict = {"config": KIMI, "flags": flags, "dump_dir": str(dump_dir),
                 "disk_write_gb_s": disk_write_rate(w)}
    dumped = 0
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, w / "x02b" / "02b_hidden_states", ignore_errors=True)
        out["server_start_s"] = started(stack, on, off)
        # the same 64 prompts of 2,048 tokens off, on (dumped: the default rid prefix), off again
        for name, s in (("dump_off", off), ("dump_on", on), ("dump_off_again", off)):
            if s is on:  # and its writer's queue written out before the dumps are removed
                dumped = prefill_dumped(out, name, s, dump_dir, stats_file, dumped)
            else:
                out[f"prefill_{name}_2048"] = asyncio.run(prefill(s.url, 64, 2048, 8, 1000,
                                                                  "eagle3-"))
            shutil.rmtree(dump_dir, ignore_errors=True)
            dump_dir.mkdir(parents=True, exist_ok=True)
            write_json(args, "kimi", out)
        for where, name in ((w, "02b"), (KIMI_02B_RAM, "02b_ram")):
            out.update(run_02b(where, target, on, dump_dir, name))
            dumped += out[f"{name}_tokens"]
            out[f"writer_dump_on_after_{name}"] = writer_stats(stats_file, dumped, time.time())
            write_json(args, "kimi", out)
    phase_kimi_fp8(args, w, target, flags, out)
    if not args.kimi_no_mla:
        phase_kimi_mla(args, w, target, out)
    for f in ("kimi_dump_on.log", "kimi_dump_on_fp8.log", "kimi_mla_draft.log"):
        p = args.work / "logs" / f
        if p.exists():
            (args.out / f).write_text(p.read_text(errors="replace")[-20000:])


def phase_kimi_mla(args, w: Path, target: Path, out: dict) -> None:
    """An MLA draft of `target` served under EAGLE3 (`mla_draft`: served, or the error)."""
    draft = mla_draft(target, w / "mla_draft")
    spec = server(args, target, 30032, ["--load-format", "dummy", "--mem-fraction-static",
                                        "0.7", "--context-length", "8192",
                                        "--cuda-graph-max-bs", "8", *CHAIN3,
                                        "--speculative-draft-model-path", str(draft)],
                  "kimi_mla_draft.log")
    try:
        with ExitStack() as stack:
            started(stack, spec)
            out["mla_draft"] = {"served": True, "prefill": asyncio.run(
                prefill(spec.url, 8, 512, 4, 1000, "x-"))}
    except Exception as e:  # the exact error is the result
        out["mla_draft"] = {"served": False, "error": str(e)[-4000:]}
    write_json(args, "kimi", out)


def phase_kimi_fp8(args, w: Path, target: Path, flags: list[str], out: dict) -> None:
    """The dump-on server again with EAGLE3_DUMP_LAYOUT=fp8 (same flags, alone on the GPU;
    quantized where --kimi-fp8 says):
    `prefill_dump_on_fp8_2048`, `writer_dump_on_fp8`, and 02b --dtype fp8 against it
    (`02b_fp8_*`). A failure is recorded in `dump_on_fp8_error`, never raised."""
    dump_dir, stats_file = args.kimi_dumps / "dumps_fp8", w / "writer_stats_fp8.json"
    stats_file.unlink(missing_ok=True)
    shutil.rmtree(dump_dir, ignore_errors=True)
    fp8 = server(args, target, 30033, flags, "kimi_dump_on_fp8.log", dump_dir,
                 {"EAGLE3_DUMP_STATS_FILE": str(stats_file), "EAGLE3_DUMP_LAYOUT": "fp8",
                  "EAGLE3_DUMP_FP8_ON_GPU": "1" if args.kimi_fp8 == "gpu" else "0"})
    out["dump_on_fp8_quantized_on"] = args.kimi_fp8
    try:
        with ExitStack() as stack:
            out["server_fp8_start_s"] = started(stack, fp8)
            dumped = prefill_dumped(out, "dump_on_fp8", fp8, dump_dir, stats_file, 0)
            shutil.rmtree(dump_dir, ignore_errors=True)
            dump_dir.mkdir(parents=True, exist_ok=True)
            write_json(args, "kimi", out)
            for where, name in ((w, "02b_fp8"), (KIMI_02B_RAM, "02b_fp8_ram")):
                out.update(run_02b(where, target, fp8, dump_dir, name, "--dtype", "fp8"))
                dumped += out[f"{name}_tokens"]
                out[f"writer_dump_on_fp8_after_{name}"] = writer_stats(stats_file, dumped,
                                                                     time.time())
                write_json(args, "kimi", out)
    except Exception as e:  # the bf16 results stand; the error is the fp8 result
        out["dump_on_fp8_error"] = f"{type(e).__name__}: {e}"[-4000:]
    write_json(args, "kimi", out)


def pipeline_launch(args):
    """gpu_pipeline's `launch`: a server of --pipeline-target on this machine's SGLang site."""
    def launch(name: str, port: int, flags: list[str], dump_dir=None) -> LaunchedServer:
        return server(args, args.pipeline_target, port, flags, f"pipeline_{name}.log", dump_dir)
    return launch


def phase_pipeline(args, stop_after: str | None = None) -> None:
    """The whole pipeline on a real target through the patched SGLang, then its draft served
    (benchmarks/gpu_pipeline.py: its steps, profiles and record, <out>/pipeline.json)."""
    import gpu_pipeline

    gpu_pipeline.run_pipeline(gpu_pipeline.PROFILES[args.pipeline_profile],
                              args.pipeline_target, args.work / "pipeline", args.out,
                              args.deadline_at or time.time() + 3600, pipeline_launch(args),
                              stop_after=stop_after)


def phase_pipeline_train(args) -> None:
    """Session A of two: the pipeline up to 04, whose draft goes back for session B."""
    phase_pipeline(args, stop_after="04")


def phase_pipeline_serve(args) -> None:
    """Session B of two: --pipeline-draft (session A's) served beside plain, the offline 05."""
    import gpu_pipeline

    if args.pipeline_draft is None:
        raise ValueError("pipeline-serve needs --pipeline-draft DIR: session A's 04_train/final "
                         "(benchmarks/gpu_sglang.sh split ... DRAFT.tar, then start unpacks it)")
    gpu_pipeline.serve_draft(gpu_pipeline.PROFILES[args.pipeline_profile],
                             args.pipeline_target, args.pipeline_draft, args.work / "pipeline",
                             args.out, args.deadline_at or time.time() + 3600,
                             pipeline_launch(args))


PHASES = {"dump": phase_dump, "serve": phase_serve, "kimi": phase_kimi,
          "pipeline": phase_pipeline, "pipeline-train": phase_pipeline_train,
          "pipeline-serve": phase_pipeline_serve}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=["dump", "serve", "kimi"])
    p.add_argument("--out", type=Path, required=True, help="where the JSON results go")
    p.add_argument("--work", type=Path, default=Path("/tmp/gs/work"))
    p.add_argument("--sglang-site", required=True, help="folder holding sglang 0.5.17 et al.")
    p.add_argument("--smollm2", type=Path, help="SmolLM2 converted folder (serve)")
    p.add_argument("--pipeline-target", type=Path, help="pipeline: the target folder")
    p.add_argument("--pipeline-profile", default="h100-qwen-coder",
                   help="pipeline: a profile of benchmarks/gpu_pipeline.py")
    p.add_argument("--pipeline-draft", type=Path,
                   help="pipeline-serve: the draft folder to serve (session A's 04_train/final)")
    p.add_argument("--deadline-at", type=float, default=0.0,
                   help="pipeline: epoch seconds past which no step starts (0: an hour)")
    p.add_argument("--kimi-dumps", type=Path, default=Path("/dev/shm/eagle3-kimi"),
                   help="kimi: the dump directories' folder (the plan's /dev/shm by default)")
    p.add_argument("--kimi-fp8", choices=("gpu", "host"), default="gpu",
                   help="kimi: where the fp8 dump server quantizes (EAGLE3_DUMP_FP8_ON_GPU)")
    p.add_argument("--kimi-no-mla", action="store_true",
                   help="kimi: leave out the MLA draft's start under EAGLE3")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in args.phases:
        t0 = time.time()
        try:
            PHASES[name](args)
            log.info("phase %s done in %.0f s", name, time.time() - t0)
        except Exception as e:
            log.exception("phase %s failed", name)
            (args.out / f"{name}_error.txt").write_text(f"{type(e).__name__}: {e}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
