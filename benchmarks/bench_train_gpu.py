#!/usr/bin/env python3
"""Training-step throughput of the EAGLE-3 trainer at Kimi-K2.5 draft dimensions.

The draft of `04_train.py --preset kimi-k2.5` (eagle3/core/presets.py), target vocab 163840, TTT 7,
one sequence of 4096 tokens per micro-step, synthetic weights and hidden states. Prints and
writes to `$OUT/bench_train.json` (default ./bench_out): tokens/s per GPU, step time, peak
memory, MFU (exact FLOPs, eagle3/train/flops.py), the share of the step in fwd+bwd / clip / optimizer,
host syncs per step, the data-wait share of the real loader (hidden-state files on local disk
read by worker processes), and the DDP scaling on 2 GPUs (spawned through torchrun).

Configurations (each runs on its own; a failure is recorded and the next one runs):
  flex          flex-attention kernel compiled, the rest eager (the trainer's --no-compile)
  flex+compile  the whole TTT forward under torch.compile (the trainer's default on CUDA)
  mla           `flex` with the MLA draft (04 --draft-arch mla) at Kimi-K2.5's own MLA sizes:
                kv_lora_rank 512, q_lora_rank 1536, rope 64, nope 128, v 128, 64 heads
  mla+compile   `flex+compile` with the MLA draft
  loader        the faster of the two, fed by the real loader from files (data-wait share)
  ddp2          the faster of the two on 2 GPUs (torchrun --nproc-per-node 2)
  curve         not in the default list: the loss of --curve-steps compiled steps on 4 fixed
                learnable batches, fixed seed (run it under two code versions to compare)
Suffixes, in any order after the name: `+fp8` trains with FP8 GEMMs (04's --fp8-gemm on:
eagle3/train/fp8.py), `+fp8:<recipe>` with another FP8 recipe (eagle3/train/fp8_scaling.py: `block`,
`block.e5m2`, `rowwise.w`, ...; `+fp8` is `+fp8:rowwise`); an FP8 row also checks its gradients
against the criterion of eagle3/train/fp8_check.py (`grad_check`), `+perstep` runs the per-step TTT
unroll (04's --ttt-unroll per-step; the default rows run 04's default, the shared unroll:
eagle3/train/ttt.py), `+seed1` initialises the draft from seed 1 instead of 0 (for a curve: the
seed-to-seed spread a code change's curve is set against), `@T` sets this row's tokens per
micro-step (else --seq); e.g. `flex+compile+fp8@8192`, `flex+compile+fp8:block`, `curve+perstep`.
MFU counts the FLOPs the row's unroll executes (eagle3/train/flops.py), so compare unrolls by
tokens/s.
--profile adds, for flex / flex+compile, the kernel time of 2 profiled steps by category and the
GEMMs' FLOP rate. Compiling costs ~45 s per row width and config (T = 4096, H200): budget
~90 s for a compiled row, and about 0.33 s per curve step on top.

H200 (one command, ~6-8 minutes, needs 2 GPUs for the DDP row; with 1 GPU it is skipped):
    python benchmarks/bench_train_gpu.py
CPU smoke test (toy sizes, naive attention, DDP over gloo):
    python benchmarks/bench_train_gpu.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.presets import draft_fields
from eagle3.core.stage import atomic_torch_save
from eagle3.draft.mla import build_draft_model
from eagle3.draft.model import DraftConfig
from eagle3.train import distributed
from eagle3.train.data import DevicePrefetcher, PackedRows, make_loader
from eagle3.train.flops import micro_step_flops
from eagle3.train.fp8 import Fp8Linear, refresh_fp8_weights, use_fp8_gemms
from eagle3.train.fp8_check import grad_errors, judge
from eagle3.train.fp8_scaling import parse_recipe, simulate_gemm
from eagle3.train.optimizer import build_optimizer, clip_gradients
from eagle3.train.ttt import TTTModel

ROOT = Path(__file__).resolve().parent.parent

H200_BF16_PEAK = 989e12  # dense bf16 spec; sustained power-capped GEMMs reach ~650-680e12
KIMI = draft_fields("kimi-k2.5")  # the draft 04 --preset kimi-k2.5 trains
# A CPU-sized draft with Kimi-K2.5's head size (the FP8 gradient check on CPU: --mid)
MID = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
           intermediate_size=2816, vocab_size=32768, draft_vocab_size=8192,
           target_hidden_size=1024, capture_layers=[2, 30, 58])
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
            intermediate_size=128, vocab_size=554, draft_vocab_size=256, target_hidden_size=64,
            capture_layers=[2, 4, 5])
# The MLA draft's attention sizes (the rest as above), Kimi-K2.5's config.json / toy.
KIMI_MLA = dict(arch="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, head_dim=192)
TINY_MLA = dict(arch="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, head_dim=24)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (CPU smoke test)")
    p.add_argument("--mid", action="store_true",
                   help="hidden 1024, 8 x 128 heads, intermediate 2816 (an FP8 row's gradient "
                        "check on CPU in minutes; not for speed)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per micro-step (default 4096)")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--steps", type=int, default=12, help="timed optimizer steps per config")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compile)")
    p.add_argument("--configs", nargs="+",
                   default=["flex", "mla", "loader", "ddp2", "flex+compile", "mla+compile"],
                   help="run in this order; the loader and ddp2 rows use the fastest config "
                        "timed before them")
    p.add_argument("--budget-s", type=float, default=540,
                   help="skip configs not started within this many seconds (default 540)")
    p.add_argument("--num-workers", type=int, default=4, help="loader workers (loader config)")
    p.add_argument("--curve-steps", type=int, default=120,
                   help="optimizer steps of the fixed-seed loss curve (curve config)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile 2 more (CUDA): kernel time by category, "
                        "GEMM rate against the plain-GEMM rate (flex and flex+compile rows)")
    p.add_argument("--out", default=None, help="results folder (default: $OUT or ./bench_out)")
    p.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)  # torchrun child
    return p.parse_args(argv)


# ---------------------------------------------------------------- setup


def dims_of(args) -> dict:
    return TINY if args.tiny else MID if args.mid else KIMI


def build(args, device: torch.device, compile_forward: bool, arch: str = "llama",
          fp8: str | None = None, seed: int = 0, unroll: str = "shared"):
    """(model, optimizer, forward) at the benchmark dimensions, synthetic weights; `fp8` the
    FP8 recipe of the draft's linear layers (None: plain GEMMs)."""
    mla = (TINY_MLA if args.tiny else KIMI_MLA) if arch == "mla" else {}
    cfg = DraftConfig(**{**dims_of(args), **mla})
    torch.manual_seed(seed)
    with torch.device(device):
        draft = build_draft_model(cfg)
        for p in draft.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    torch.manual_seed(0)  # the frozen tensors below are the same for every seed
    with torch.device(device):
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16) * 0.02
        teacher = torch.randn(cfg.draft_vocab_size, cfg.hidden_size, dtype=torch.bfloat16) * 0.02
    if fp8:
        use_fp8_gemms(draft, recipe=fp8)
    cuda = device.type == "cuda"
    model = TTTModel(draft, embed, teacher, args.ttt_steps, 0.8, "flex" if cuda else "naive",
                     torch.bfloat16 if cuda else torch.float32, unroll=unroll)
    optimizer = build_optimizer(draft, 1e-4, 0.0, device)  # 04's: fused AdamW on CUDA
    return model, optimizer, cfg


def synthetic_batch(cfg: DraftConfig, seq: int, device) -> dict:
    g = torch.Generator().manual_seed(1)
    Ht = cfg.target_hidden_size
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (1, seq), generator=g),
             "loss_mask": torch.ones(1, seq, dtype=torch.long),
             "doc_ids": torch.zeros(1, seq, dtype=torch.int32),
             "positions": torch.arange(seq)[None],
             "aux": torch.randn(1, seq, 3 * Ht, generator=g).to(torch.bfloat16),
             "final": torch.randn(1, seq, Ht, generator=g).to(torch.bfloat16),
             "tokens": torch.tensor(seq)}
    return {k: v.to(device) for k, v in batch.items()}


def write_files(cfg: DraftConfig, seq: int, n: int, root: Path) -> list[Path]:
    """`n` hidden-state files of `seq` tokens in the docs/PIPELINE.md layout (bf16)."""
    files = []
    for i in range(n):
        b = synthetic_batch(cfg, seq, "cpu")
        Ht = cfg.target_hidden_size
        aux = [b["aux"][0, :, j * Ht:(j + 1) * Ht] for j in range(3)]
        data = hs.pack(b["input_ids"][0], b["loss_mask"][0], aux, b["final"][0],
                       {"id": f"bench/{i}", "capture_layers": cfg.capture_layers})
        atomic_torch_save(data, hs.file_path(root, i))
        files.append(hs.file_path(root, i))
    return files


# ---------------------------------------------------------------- the timed loop


def run(args, device: torch.device, compile_forward: bool, use_loader: bool,
        dist_info: distributed.DistInfo | None = None, arch: str = "llama",
        fp8: str | None = None, unroll: str = "shared") -> dict:
    """Time `args.steps` optimizer steps (after `args.warmup`); one micro-step per step."""
    dist_info = dist_info or distributed.DistInfo()
    cuda = device.type == "cuda"
    model, optimizer, cfg = build(args, device, compile_forward, arch, fp8, unroll=unroll)
    ddp = distributed.wrap(model, dist_info, device)
    forward = torch.compile(ddp) if compile_forward else ddp
    total = args.warmup + args.steps
    tmp = None
    if use_loader:
        tmp = Path(tempfile.mkdtemp(prefix="bench_hs_"))
        files = write_files(cfg, args.seq, min(total, 16), tmp)
        rows = [[i % len(files)] for i in range(total)]
        feed = DevicePrefetcher(make_loader(PackedRows(files, rows, args.seq, args.seq),
                                            args.num_workers, cuda), device)
    else:
        fixed = synthetic_batch(cfg, args.seq, device)
    flops = micro_step_flops(cfg, args.seq, [args.seq], args.ttt_steps, unroll=unroll).train
    events, state = [], {}
    checked = grad_check(model, forward, fixed, cuda) if fp8 and not use_loader else {}

    bad_step = torch.tensor(-1, device=device)

    def one_step(timed: bool, step: int = 0) -> None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if timed else None
        batch = feed.next() if use_loader else fixed
        if ev:
            ev[0].record()
        masks = model.build_masks(batch["doc_ids"], compile_mask=cuda)
        refresh_fp8_weights(model.draft)  # as 04 does: the e4m3 weight copies, once per step
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, _ = forward(batch["input_ids"], batch["loss_mask"], batch["doc_ids"],
                              batch["positions"], batch["aux"], batch["final"], masks=masks)
        loss.backward()
        if use_loader:
            feed.prefetch()
        if ev:
            ev[1].record()
        clip_gradients(optimizer, 0.5, step, bad_step)  # as 04 does (eagle3/train/optimizer.py)
        if ev:
            ev[2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ev:
            ev[3].record()
            events.append(ev)
        state["loss"] = loss.detach()

    for step in range(total):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            wall, wait0 = time.perf_counter(), (feed.wait_s if use_loader else 0.0)
        if cuda and step == total - 1:  # the last step runs under torch's sync detector
            state["syncs"] = count_syncs(lambda: one_step(True, step))
        else:
            one_step(cuda and step >= args.warmup, step)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - wall
    if cuda and args.profile and not use_loader and dist_info.world == 1:
        state["profile"] = profile_steps(lambda: one_step(False), 2)
    out = {"step_ms": 1000 * seconds / args.steps,
           "tokens_per_s_per_gpu": args.seq * args.steps / seconds,
           "train_flops_per_step": flops,
           "mfu_vs_989T": flops * args.steps / seconds / H200_BF16_PEAK,
           "final_loss": float(state["loss"]), "attention": model.attention, "arch": arch,
           "fp8_gemm": fp8, "fp8_emulated": any(
               getattr(m, "fp8_emulate", False) for m in model.draft.modules()),
           "seq": args.seq, "unroll": unroll,
           "flops_per_token": flops / args.seq,
           "draft_params": sum(p.numel() for p in model.draft.parameters())}
    if use_loader:
        out["data_wait_share"] = (feed.wait_s - wait0) / seconds
    if events:
        phase = [[a.elapsed_time(b) for a, b in zip(ev[:-1], ev[1:])] for ev in events]
        tot = sum(sum(p) for p in phase)
        for i, name in enumerate(("fwd_bwd", "clip", "optimizer")):
            out[f"{name}_share"] = sum(p[i] for p in phase) / tot
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["host_syncs_per_step"] = state["syncs"]
    if "profile" in state:
        out["profile"] = state["profile"]
    out.update(checked)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def perturbed_batches(batch: dict) -> dict:
    """The floors' inputs: `aux_1pct` the aux states times (1 + 0.01 n), n standard normal (the
    criterion's floor, eagle3/train/fp8_check.py); `drop_1pct` / `drop_5pct` the loss mask with
    a random 1% / 5% of the tokens left out (for scale: a slightly smaller batch)."""
    aux = batch["aux"]
    g = torch.Generator(device=aux.device).manual_seed(7)
    noise = torch.randn(aux.shape, generator=g, device=aux.device, dtype=aux.dtype)
    out = {"aux_1pct": {**batch, "aux": aux * (1 + 0.01 * noise)}}
    for pct in (1, 5):
        g = torch.Generator(device=aux.device).manual_seed(3)
        keep = torch.rand(batch["loss_mask"].shape, generator=g, device=aux.device) >= pct / 100
        out[f"drop_{pct}pct"] = {**batch, "loss_mask": batch["loss_mask"] * keep}
    return out


def reference_copy(model, dtype: torch.dtype):
    """A copy of the plain-GEMM TTT model computing in `dtype` (the gradient reference), without
    the FP8 layers' weight copies."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        for name in ("fp8_w", "fp8_w_scale", "fp8_wt", "fp8_wt_scale"):
            m._buffers.pop(name, None)
    ref = ref.to(dtype)
    ref.compute_dtype = dtype
    return ref


def grad_check(model, forward, batch: dict, cuda: bool) -> dict:
    """The FP8 step's gradients (through `forward`, compiled when the row is) against the
    criterion of eagle3/train/fp8_check.py, before any update. Reference: the plain step in
    float64 (CPU) or fp32 (CUDA), eager; floor: the plain step in the row's precision (fp32 on
    CPU, bf16 on CUDA) with the aux states perturbed by 1%. Also: the plain bf16 step judged
    the same way (it must pass), the FP8 step's largest ratio against leaving 1% / 5% of the
    tokens out of the loss, and the cosines against the plain step (the earlier figure). Each
    step's errors are taken as its gradients come, so at most three gradient sets are held."""
    masks = model.build_masks(batch["doc_ids"], compile_mask=cuda)

    def grads(fn, b: dict = batch, autocast: bool = cuda) -> dict:
        with torch.autocast(b["aux"].device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, _ = fn(b["input_ids"], b["loss_mask"], b["doc_ids"], b["positions"],
                         b["aux"], b["final"], masks=masks)
        loss.backward()
        draft = fn.draft if hasattr(fn, "draft") else model.draft
        out = {n: None if p.grad is None else p.grad.detach().clone()
               for n, p in draft.named_parameters()}
        draft.zero_grad(set_to_none=True)
        return out

    fp8 = grads(forward)
    converted = [m for m in model.draft.modules() if isinstance(m, Fp8Linear)]
    for m in converted:
        m.__class__ = torch.nn.Linear
    try:
        high = torch.float32 if cuda else torch.float64
        reference = str(high).replace("torch.", "")
        try:
            ref = grads(reference_copy(model, high), autocast=False)
        except RuntimeError as e:  # out of memory or no fp32 kernel: recorded, the row goes on
            reference = f"the plain step ({reference} failed: {str(e)[:300]})"
            ref = None
        plain = grads(model)
        ref = plain if ref is None else ref
        # the plain bf16 step (CUDA: the plain step; CPU: under CPU autocast) must pass
        errors = {"fp8": grad_errors(fp8, ref), "bf16": grad_errors(
            plain if cuda else grads(model, autocast=True), ref)}
        for k, b in perturbed_batches(batch).items():
            errors[k] = grad_errors(grads(model, b), ref)
    finally:
        for m in converted:
            m.__class__ = Fp8Linear
    del ref
    verdict = judge(errors["fp8"], errors["aux_1pct"])
    plain_verdict = judge(errors["bf16"], errors["aux_1pct"])
    vs_plain = {n: 1 - e for n, e in grad_errors(fp8, plain).items()}
    return {"criterion_passed": verdict.passed, "criterion": verdict.as_dict(),
            "reference": reference,
            "grad_ratio_max": verdict.worst()[1], "grad_ratio_worst_param": verdict.worst()[0],
            "bf16_step_criterion_passed": plain_verdict.passed,
            "bf16_step_ratio_max": plain_verdict.worst()[1],
            "bf16_step_error": errors["bf16"],
            "grad_ratio_max_vs_drop_1pct": judge(errors["fp8"], errors["drop_1pct"]).worst()[1],
            "grad_ratio_max_vs_drop_5pct": judge(errors["fp8"], errors["drop_5pct"]).worst()[1],
            "drop_error": {k: errors[k] for k in ("drop_1pct", "drop_5pct")},
            "grad_cosine_min_vs_plain": min(vs_plain.values(), default=0.0),
            "grad_cosine_vs_plain": vs_plain,
            "params_without_fp8_grad": [n for n, e in verdict.error.items() if e == float("inf")],
            "op_check": op_check(model.draft, batch["aux"].device)}


def op_check(draft, device: torch.device) -> dict:
    """One FP8 layer at the draft's MLP size (4096 rows, hidden -> intermediate) with the
    draft's recipe, compiled on CUDA, against the same rounding done in float64: the relative
    error of the forward and of both gradients (tests/train/test_fp8.py checks the same on CPU;
    a GEMM the recipe keeps plain is not checked)."""
    K, N = draft.cfg.hidden_size, draft.cfg.intermediate_size
    sample = next(m for m in draft.modules() if isinstance(m, Fp8Linear))
    recipe = sample.fp8_recipe
    cuda = device.type == "cuda"
    M = 4096 if cuda else 64
    torch.manual_seed(0)
    layer = torch.nn.Linear(K, N, bias=False, device=device)
    use_fp8_gemms(layer, recipe=recipe.name)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    fn = torch.compile(layer) if cuda else layer
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        y = fn(x)
    y.backward(g)

    def rel(got, a, b, b_is_weight, a_is_grad):
        want = simulate_gemm(a.detach(), b.detach(), recipe, b_is_weight, a_is_grad)
        return float((got.detach().double() - want).norm() / want.norm())

    w = layer.weight
    checks = {"forward_rel_err": ("f", y, x, w, True, False),
              "grad_input_rel_err": ("i", x.grad, g, w.t(), True, True),
              "grad_weight_rel_err": ("w", w.grad, g.t(), x.t(), False, True)}
    out = {"rows": M, "in": K, "out": N, "recipe": recipe.name, "emulated": sample.fp8_emulate}
    for key, (gemm, got, a, b, b_is_weight, a_is_grad) in checks.items():
        out[key] = rel(got, a, b, b_is_weight, a_is_grad) if recipe.fp8(gemm) else None
    return out


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
KERNEL_CLASSES = (  # (category, substrings of the kernel name), first match wins
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("flex_attention", ("flex_attention", "triton_tem")),
    ("optimizer", ("adam",)),
    ("foreach (clip)", ("multi_tensor", "foreach")),
    ("inductor fused", ("triton_",)),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
    ("aten elementwise/reduce", ("elementwise", "reduce", "softmax", "index", "cat")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_steps(step_fn, n: int) -> dict:
    """Kernel time per step by category and the GEMMs' FLOP rate, over `n` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_flops=True) as prof:
        for _ in range(n):
            step_fn()
        torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t) / n
    by_class, kernels = {}, {}
    gemm_flops = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if e.name.startswith("## ") or e.name.startswith("Optimizer."):
                continue  # GPU-side ranges of compiled graphs / optimizer steps, not kernels
            ms = e.device_time_total / 1000 / n  # device_time_total is in microseconds
            by_class[kernel_class(e.name)] = by_class.get(kernel_class(e.name), 0.0) + ms
            kernels[e.name] = kernels.get(e.name, 0.0) + ms
        elif e.name in GEMM_OPS and e.flops:
            gemm_flops += e.flops / n
    busy = sum(by_class.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    gemm_ms = by_class.get("gemm", 0.0)
    return {"step_wall_ms": wall_ms, "kernel_ms": busy, "idle_ms": wall_ms - busy,
            "by_class_ms": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "gemm_flops_per_step": gemm_flops,
            "gemm_tflops": gemm_flops / max(gemm_ms, 1e-9) / 1e9,
            "top_kernels_ms": [[name[:160], ms, kernel_class(name)] for name, ms in top]}


def learnable_batch(cfg: DraftConfig, seq: int, seed: int, device) -> dict:
    """A synthetic batch the draft can learn: the target's final state at t+1 is the high aux
    state at t, so step 0's target distribution is a fixed function of its own input."""
    b = synthetic_batch(cfg, seq, "cpu")
    g = torch.Generator().manual_seed(100 + seed)
    Ht = cfg.target_hidden_size
    b["input_ids"] = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    b["aux"] = torch.randn(1, seq, 3 * Ht, generator=g).to(torch.bfloat16)
    b["final"] = torch.roll(b["aux"][..., 2 * Ht:], 1, dims=1).contiguous()
    return {k: v.to(device) for k, v in b.items()}


def loss_curve(args, device: torch.device, fp8: str | None = None, seed: int = 0,
               unroll: str = "shared") -> dict:
    """The loss of `--curve-steps` optimizer steps of the compiled trainer step, fixed seed,
    cycling over 4 fixed learnable batches (compare two code versions' curves step by step)."""
    from eagle3.train.ttt import stats_dict

    cuda = device.type == "cuda"
    model, optimizer, cfg = build(args, device, cuda, fp8=fp8, seed=seed, unroll=unroll)
    forward = torch.compile(model) if cuda else model
    batches = [learnable_batch(cfg, args.seq, i, device) for i in range(4)]
    masks = [model.build_masks(b["doc_ids"], compile_mask=cuda) for b in batches]
    losses, stats, bad_step = [], [], torch.tensor(-1, device=device)
    for step in range(args.curve_steps):
        b = batches[step % 4]
        refresh_fp8_weights(model.draft)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, st = forward(b["input_ids"], b["loss_mask"], b["doc_ids"], b["positions"],
                               b["aux"], b["final"], masks=masks[step % 4])
        loss.backward()
        clip_gradients(optimizer, 0.5, step, bad_step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        stats.append(st.detach())
    last = stats_dict(torch.stack(stats[-8:]).sum(0), args.ttt_steps)
    return {"losses": torch.stack(losses).tolist(), "last8_train_acc": last["acc"],
            "fp8_gemm": fp8, "seed": seed, "seq": args.seq, "unroll": unroll}


def count_syncs(fn) -> int:
    """Host-device synchronisations `fn` makes (torch's sync debug mode reports each one as a
    warning; an all-reduce or a kernel launch is not a host sync)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def gemm_tflops(device: torch.device, fp8: bool = False) -> float:
    """A plain 8192^3 GEMM's rate on this GPU, bf16 (the attainable ceiling for MFU) or e4m3
    with per-row scales (the kernel FP8 training runs)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    if fp8:
        qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(8192, 1, device=device)
        sb = torch.ones(1, 8192, device=device)

        def mm():
            return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        def mm():
            return a @ b
    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        mm()
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


# ---------------------------------------------------------------- orchestration


def ddp_child(args) -> int:
    """One torchrun rank of the DDP configuration; rank 0 writes its JSON."""
    info = distributed.env_dist_info()
    device = distributed.init(info, args.device)
    name = args.ddp_worker
    result = run(args, device, compile_forward=name.endswith("compile"), use_loader=False,
                 dist_info=info)
    if info.is_main:
        Path(args.out, "ddp.json").write_text(json.dumps(result))
    distributed.shutdown()
    return 0


def run_ddp(args, best: str, world: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           "--master-port=29517", str(Path(__file__).resolve()), "--device", args.device,
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--ttt-steps", str(args.ttt_steps), "--out", args.out, "--ddp-worker", best]
    if args.tiny or args.mid:
        cmd.append("--tiny" if args.tiny else "--mid")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(Path(args.out, "ddp.json").read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out or os.environ.get("OUT") or "bench_out"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.ddp_worker:
        return ddp_child(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "dims": dims_of(args),
               "seq": args.seq, "ttt_steps": args.ttt_steps, "steps": args.steps,
               "configs": {}}
    if cuda:
        results["gemm_bf16_tflops"] = gemm_tflops(device)
        results["gemm_fp8_rowwise_tflops"] = attempt(
            lambda: {"tflops": gemm_tflops(device, fp8=True)}, "fp8 GEMM").get("tflops")
    for name in args.configs:
        parse_row_name(name)  # a bad row name (an unknown FP8 recipe) fails before any row runs
    t0 = time.perf_counter()
    for name in args.configs:
        if time.perf_counter() - t0 > args.budget_s:
            results["configs"][name] = {"skipped": f"time budget of {args.budget_s:.0f}s spent"}
            continue
        results["configs"][name] = run_config(args, name, device, results)
    results["curve_gaps"] = curve_gaps(results["configs"])
    results["first_loss_gaps"] = first_loss_gaps(results["configs"])
    path = Path(args.out) / "bench_train.json"
    path.write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"results: {path}")
    return 0


def parse_row_name(name: str) -> tuple[str, dict]:
    """(base config, options) of a row name such as `flex+compile+fp8@8192` (module doc)."""
    name, _, seq = name.partition("@")
    parts = name.split("+")
    fp8 = [p.partition(":")[2] or "rowwise" for p in parts if p.partition(":")[0] == "fp8"]
    opts = {"fp8": parse_recipe(fp8[0]).name if fp8 else None,
            "seed": 1 if "seed1" in parts else 0, "seq": int(seq) if seq else None,
            "unroll": "per-step" if "perstep" in parts else "shared"}
    base = "+".join(p for p in parts if p not in ("seed1", "perstep")
                    and p.partition(":")[0] != "fp8")
    return base, opts


def run_config(args, name: str, device: torch.device, results: dict) -> dict:
    """One configuration, its failure recorded instead of raised."""
    base, opts = parse_row_name(name)
    if opts["seq"]:
        args = argparse.Namespace(**{**vars(args), "seq": opts["seq"]})
    fp8, unroll = opts["fp8"], opts["unroll"]
    cuda = device.type == "cuda"
    timed = {k: v for k, v in results["configs"].items()
             if "tokens_per_s_per_gpu" in v and k in ("flex", "flex+compile")}
    best = max(timed, key=lambda k: timed[k]["tokens_per_s_per_gpu"]) if timed else "flex"
    if base.endswith("+compile") and not cuda:
        return {"skipped": "torch.compile rows run on CUDA only"}
    if base in ("flex", "flex+compile"):
        return attempt(lambda: run(args, device, base == "flex+compile", False, fp8=fp8,
                                   unroll=unroll), name)
    if base == "curve":
        return attempt(lambda: loss_curve(args, device, fp8, opts["seed"], unroll), name)
    if base in ("mla", "mla+compile"):
        return attempt(lambda: run(args, device, base == "mla+compile", False, arch="mla",
                                   fp8=fp8, unroll=unroll), name)
    if base == "loader":
        out = attempt(lambda: run(args, device, best == "flex+compile", True, fp8=fp8,
                                  unroll=unroll), name)
        return {"config": best, **out}
    if base == "ddp2":
        if cuda and torch.cuda.device_count() < 2:
            return {"skipped": "fewer than 2 GPUs visible"}
        out = attempt(lambda: run_ddp(args, best, 2), name)
        if "tokens_per_s_per_gpu" in out and best in timed:
            out["scaling_efficiency"] = (out["tokens_per_s_per_gpu"]
                                         / timed[best]["tokens_per_s_per_gpu"])
        return {"config": best, **out}
    return {"error": f"unknown config {name!r}"}


def curve_gaps(configs: dict) -> dict:
    """Mean |loss difference| over the last half of the curves: a variant's curve against the
    plain `curve` (same seed) and, for scale, seed 1's against seed 0's (plain GEMMs)."""
    curves = {k: v["losses"] for k, v in configs.items() if "losses" in v}
    if "curve" not in curves:
        return {}
    ref = curves["curve"]
    half = len(ref) // 2

    def gap(other):
        n = min(len(ref), len(other))
        pairs = list(zip(ref[half:n], other[half:n]))
        return sum(abs(a - b) for a, b in pairs) / max(len(pairs), 1)

    return {f"{k} vs curve": gap(v) for k, v in curves.items() if k != "curve"}


def first_loss_gaps(configs: dict) -> dict:
    """|first loss / `curve`'s - 1| of each curve with the same seed: the same weights on the
    same batch, so this is how far apart two code paths compute one forward (bf16 rounding)."""
    curves = {k: v["losses"][0] for k, v in configs.items()
              if "losses" in v and v.get("seed", 0) == 0}
    if "curve" not in curves:
        return {}
    return {f"{k} vs curve": abs(v / curves["curve"] - 1) for k, v in curves.items()
            if k != "curve"}


def attempt(fn, name: str) -> dict:
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark row records its failure and goes on
        out = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    out["wall_s"] = time.perf_counter() - t
    print(f"[{name}] {json.dumps(out)}", flush=True)
    return out


def grad_check_lines(name: str, r: dict) -> list[str]:
    """The report's lines for one FP8 row's gradient check (grad_check)."""
    oc, crit = r["op_check"], r["criterion"]
    kinds = (("fwd", "forward_rel_err"), ("grad in", "grad_input_rel_err"),
             ("grad w", "grad_weight_rel_err"))
    errs = ", ".join(f"{label} {oc[k]:.1e}" if oc[k] is not None else f"{label} plain"
                     for label, k in kinds)
    lines = [f"{name}: criterion {'PASSED' if r['criterion_passed'] else 'FAILED'} "
             f"(1 - cos vs the {r['reference']} step, over the plain step's with aux +-1%: "
             f"max ratio "
             f"{r['grad_ratio_max']:.2f} at {r['grad_ratio_worst_param']}; the plain bf16 "
             f"step's own max ratio {r['bf16_step_ratio_max']:.2f}); max ratio against leaving 1% / 5% "
             f"of the tokens out {r['grad_ratio_max_vs_drop_1pct']:.2f} / "
             f"{r['grad_ratio_max_vs_drop_5pct']:.2f}; grad cos vs plain min "
             f"{r['grad_cosine_min_vs_plain']:.4f}",
             f"{name}: one FP8 layer ({oc['recipe']}{', emulated' if oc['emulated'] else ''}) "
             f"vs float64 rounding ({oc['rows']}x{oc['in']}->{oc['out']}): {errs}"]
    lines.append(f"  {'parameter':<44}{'1-cos fp8':>11}{'1-cos floor':>12}{'ratio':>8}")
    for param, ratio in crit["ratio"].items():
        lines.append(f"  {param:<44}{crit['error'][param]:>11.2e}{crit['floor'][param]:>12.2e}"
                     f"{ratio:>8.2f}")
    return lines


def report(results: dict) -> str:
    lines = [f"{results['device']}, torch {results['torch']}, seq {results['seq']}, "
             f"TTT {results['ttt_steps']}"]
    if "gemm_bf16_tflops" in results:
        lines.append(f"plain bf16 GEMM: {results['gemm_bf16_tflops']:.0f} TFLOP/s")
    if results.get("gemm_fp8_rowwise_tflops"):
        lines.append(f"plain e4m3 GEMM (per-row scales): "
                     f"{results['gemm_fp8_rowwise_tflops']:.0f} TFLOP/s")
    columns = [("seq", "T", "{}"), ("unroll", "unroll", "{}"),
               ("tokens_per_s_per_gpu", "tok/s/GPU", "{:,.0f}"),
               ("step_ms", "step ms", "{:.0f}"),
               ("mfu_vs_989T", "MFU", "{:.1%}"), ("peak_memory_gib", "peak GiB", "{:.1f}"),
               ("optimizer_share", "optim", "{:.1%}"), ("data_wait_share", "data-wait", "{:.1%}"),
               ("host_syncs_per_step", "syncs", "{}"),
               ("scaling_efficiency", "DDP eff.", "{:.2f}"),
               ("grad_cosine_min_vs_plain", "grad cos", "{:.4f}"),
               ("grad_ratio_max", "grad ratio", "{:.1f}"),
               ("draft_params", "params", "{:,}")]
    lines.append(f"{'config':<22}" + "".join(f"{title:>11}" for _, title, _ in columns))
    for name, r in results["configs"].items():
        if "tokens_per_s_per_gpu" not in r:
            lines.append(f"{name:<22}{r.get('error', r.get('skipped', ''))[:200]}")
            continue
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-"
                 for key, _, fmt in columns]
        lines.append(f"{name:<22}" + "".join(f"{c:>11}" for c in cells))
    for name, r in results["configs"].items():
        if "op_check" in r:
            lines += grad_check_lines(name, r)
        if r.get("params_without_fp8_grad"):
            lines.append(f"{name}: NO GRADIENT in {r['params_without_fp8_grad']}")
    for name, gap in results.get("curve_gaps", {}).items():
        lines.append(f"curve gap {name}: mean |loss difference| over the last half {gap:.4f}")
    for name, gap in results.get("first_loss_gaps", {}).items():
        lines.append(f"first loss {name}: relative difference {gap:.2e}")
    for name, r in results["configs"].items():
        if "losses" in r:
            lines.append(f"{name}: loss at steps 0/30/60/last "
                         f"{[round(r['losses'][i], 4) for i in (0, 30, 60, -1) if i < len(r['losses'])]}")
        if "profile" in r:
            prof = r["profile"]
            lines.append(f"{name} profile: wall {prof['step_wall_ms']:.1f} ms/step, kernels "
                         f"{prof['kernel_ms']:.1f}, GEMM {prof['gemm_tflops']:.0f} TFLOP/s")
            lines += [f"  {cat:<26}{ms:8.1f} ms" for cat, ms in prof["by_class_ms"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
