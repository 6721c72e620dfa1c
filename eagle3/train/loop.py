"""EAGLE-3 training: the loop, its schedule, evaluation and checkpoints (ttt.py has the loss).

Per optimizer step, in this order: learning rate -> eval if due or last -> save if due or last
-> stop if last -> `grad_accum` micro-steps (forward + backward of one packed row each) -> clip
-> AdamW step -> zero grads -> log if due. AdamW keeps fp32 master weights (the parameters are
fp32); on CUDA the forward runs under bf16 autocast, with fused AdamW and flex attention.

No host sync per micro-step: metrics accumulate in a device tensor and are read every
`--log-every` steps; on CUDA a non-finite gradient norm makes the fused AdamW skip that update on
the device (`found_inf`), and the run stops at the next log, eval or save naming the step. On CPU
the check is immediate. Data order is a pure function of (seed, epoch); a resumed run continues
at the exact row (data.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle3.core.cli import config_dict
from eagle3.draft.mla import build_draft_model
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.train import distributed
from eagle3.train.acceptance import AcceptanceEstimate
from eagle3.train.checkpoint import (
    CheckpointWriter,
    check_data_position,
    load_latest,
    set_rng_state,
)
from eagle3.train.config import TrainConfig, build_draft_config
from eagle3.train.data import (
    DevicePrefetcher,
    PackedRows,
    RunPlan,
    build_plan,
    list_files,
    make_loader,
    pack_epoch,
    row_width,
)
from eagle3.train.distributed import DistInfo
from eagle3.train.fp8 import refresh_fp8_weights, use_fp8_gemms
from eagle3.train.fp8 import resolve_mode as resolve_fp8
from eagle3.train.guards import raise_if_gradient_missing, raise_if_nonfinite
from eagle3.train.log import MetricsLog, metrics_line
from eagle3.train.optimizer import build_optimizer, clip_gradients
from eagle3.train.stream import StreamRows
from eagle3.train.ttt import TTTModel, num_stats, stats_dict

__all__ = ["TrainConfig", "lr_at", "train", "build_draft", "build_draft_config", "list_files"]
log = logging.getLogger(__name__)


def lr_at(step: int, num_steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine down to `peak * min_ratio` at
    `num_steps` (a pure function of the step: resuming needs no scheduler object)."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    progress = min(max(progress, 0.0), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- assembly


def build_draft(dcfg: DraftConfig, seed: int, d2t, t2d) -> Eagle3Draft:
    # Every RNG from the seed (nothing else seeds Python's or numpy's): the states a checkpoint
    # saves are then the same in every run of this seed, killed or not.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    draft = build_draft_model(dcfg)
    for p in draft.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    draft.set_vocab_mapping(d2t, t2d)
    return draft


@dataclass
class Runtime:
    """What the loop needs besides the config: device, ranks, precision, attention."""

    device: torch.device
    dist: DistInfo
    bf16: bool
    attention: str
    compile: bool  # the training forward runs under torch.compile
    fp8: bool = False  # the draft's linear layers (but lm_head) run FP8 GEMMs in training

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)


COMPILE_CACHE = Path(".cache") / "torch_compile"  # under the workdir (--compile-cache)


def build_runtime(cfg: TrainConfig, device: torch.device, dist: DistInfo) -> Runtime:
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    attention = cfg.attention if cfg.attention != "auto" else (
        "flex" if device.type == "cuda" else "naive")
    # compiled is the fast path on CUDA (BENCHMARKS.md, training step); on CPU it only costs
    # compile time
    compile_forward = cfg.compile if cfg.compile is not None else device.type == "cuda"
    if cfg.gpu_memory_fraction and device.type == "cuda":  # colocated beside a target server
        torch.cuda.set_per_process_memory_fraction(cfg.gpu_memory_fraction, device)
    return Runtime(device, dist, bf16, attention, compile_forward,
                   resolve_fp8(cfg.fp8_gemm, device))


@contextlib.contextmanager
def compile_cache(cfg: TrainConfig, rt: Runtime):
    """While the run trains, torch.compile's cache (Inductor's, and Triton's below it) is
    --compile-cache, or `<workdir>/.cache/torch_compile`, unless the environment names one;
    yields the folder (None for an eager run). Inductor's default, a folder in /tmp, is lost
    with the container a failed run leaves; in the workdir, a re-run compiles from it (on CPU,
    the tiny draft's first log window took 69.7 s cold and 16.4 s from the cache:
    BENCHMARKS.md). The ranks of a run share the folder, as they share /tmp's by default."""
    if not rt.compile and rt.device.type != "cuda":  # nothing compiles
        yield None
        return
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # Inductor reads it at each lookup
    folder = Path(named or cfg.compile_cache or cfg.workdir / COMPILE_CACHE).absolute()
    if rt.dist.is_main:
        log.info("torch.compile cache: %s%s", folder, " (TORCHINDUCTOR_CACHE_DIR)" if named else "")
    if named:
        yield folder
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        yield folder
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@dataclass
class LoopState:
    """Saved whole in every checkpoint."""

    step: int = 0
    tokens: int = 0
    ema_loss: float = 0.0  # EMA of the step loss, debiased when logged
    nonfinite_step: int = -1  # first step whose update was skipped (CUDA), -1 = none
    last_eval: dict = field(default_factory=dict)  # the eval at `step` (done before the save)


def _batch_args(batch: dict) -> tuple:
    return (batch["input_ids"], batch["loss_mask"], batch["doc_ids"], batch["positions"],
            batch["aux"], batch["final"])


def _topk_arg(batch: dict) -> dict | None:
    """The stored top-k teacher of a batch (runs with fp8-topk files), else None."""
    if "teacher_ids" not in batch:
        return None
    return {k: batch[k] for k in ("teacher_ids", "teacher_logprobs", "has_final")}


EVAL_CACHE_BYTES = 16e9  # at most this many bytes of eval rows a rank keeps in host memory


def eval_batches(files: list[Path], lengths: list[int], cfg: TrainConfig, rt: Runtime,
                 width: int, topk: int = 0):
    """An iterator over this rank's eval rows (packed by loader workers)."""
    n = min(len(files), cfg.max_eval_samples)
    rows = pack_epoch(lengths[:n], width, cfg.max_seq_len, cfg.seed, 0, shuffle=False)
    mine = rows[rt.dist.rank::rt.dist.world]
    return iter(make_loader(PackedRows(files, mine, width, cfg.max_seq_len, topk),
                            min(cfg.num_workers, len(mine)), rt.device.type == "cuda"))


@torch.no_grad()
def evaluate(model: TTTModel, batches, cfg: TrainConfig, rt: Runtime,
             estimate: AcceptanceEstimate, greedy_cache: dict | None = None,
             parts: dict | None = None, keep: list | None = None) -> dict:
    """Mean per-step loss and accuracy over the eval rows `batches` (`eval_batches`, or the
    rows a previous eval kept), and the acceptance estimate (verify rounds against the
    target's full-vocabulary argmax: eagle3/train/acceptance.py).

    The rows are the same at every eval. `keep` (a list) receives them as loaded, in host
    memory, while they total at most EVAL_CACHE_BYTES (it is emptied when they do not), so
    that later evals skip the loader: on one H200 at Kimi-K2.5 size an eval of 32 samples
    waited 2.6-3.8 s of its 6-8 s for its 13 rows of 8192 tokens (BENCHMARKS.md, "Training
    stage (04), start to exit"). The target's argmax of row i is scored once and kept in
    `greedy_cache`. `parts` gets the seconds spent waiting for rows (`wait_s`) and from the
    end of the forward's launch to the end of the estimate (`estimate_s`: it ends on host
    copies, so it also holds the forward's unfinished GPU work). Eager, not through the
    compiled training forward: the compiled eval cost 95 s of compilation and then was no
    faster (the same section)."""
    greedy_cache = {} if greedy_cache is None else greedy_cache
    parts = {} if parts is None else parts
    parts.update(wait_s=0.0, estimate_s=0.0)
    kept_bytes = 0
    stats = torch.zeros(num_stats(cfg.ttt_steps), device=rt.device)
    estimate.sums.zero_()
    model.eval()
    t = time.perf_counter()
    for i, batch in enumerate(batches):
        parts["wait_s"] += time.perf_counter() - t
        if keep is not None:
            kept_bytes += sum(v.numel() * v.element_size() for v in batch.values())
            if kept_bytes <= EVAL_CACHE_BYTES:
                keep.append(batch)
            elif keep:
                keep.clear()
        batch = {k: v.to(rt.device) for k, v in batch.items()}
        masks = model.build_masks(batch["doc_ids"])
        with rt.autocast():
            _, s, steps_logits = model(*_batch_args(batch), masks=masks, topk=_topk_arg(batch),
                                       return_logits=True)
        stats += s
        t = time.perf_counter()
        greedy_cache[i] = estimate.add(model.draft, steps_logits, batch["input_ids"],
                                       batch["loss_mask"], batch["doc_ids"], batch["final"],
                                       batch.get("target_top"), greedy_cache.get(i))
        parts["estimate_s"] += time.perf_counter() - t
        t = time.perf_counter()
    model.train()
    m = stats_dict(distributed.all_reduce_sum(stats), cfg.ttt_steps)
    sums = distributed.all_reduce_sum(estimate.sums.to(rt.device)).cpu()
    return {"eval_loss": m["loss_steps"], "eval_acc": m["acc"],
            **{f"eval_{k}": v for k, v in AcceptanceEstimate.result(sums).items()}}


# ---------------------------------------------------------------- the loop


@dataclass
class TrainData:
    """Hidden-state files of both splits and their token counts."""

    train_files: list[Path]
    train_lengths: list[int]
    eval_files: list[Path]
    eval_lengths: list[int]
    teacher_topk: int = 0  # the largest K of the files' stored top-k teachers (0: none)
    stream: bool = False  # train_files is a StreamFiles: rows come through the spool


class Window:
    """Device-side sums since the last log line (saved in checkpoints so a resumed run logs the
    same values); read with one host sync per log line."""

    def __init__(self, steps: int, device: torch.device, saved: dict | None = None):
        saved = saved or {}
        self.stats = torch.tensor(saved.get("stats", [0.0] * num_stats(steps)), device=device,
                                  dtype=torch.float32)
        self.tokens = torch.tensor(saved.get("tokens", 0), device=device)
        self.rows = saved.get("rows", 0)
        self.steps = saved.get("steps", 0)

    def to_dict(self) -> dict:
        return {"stats": self.stats.tolist(), "tokens": int(self.tokens), "rows": self.rows,
                "steps": self.steps}


@dataclass
class WindowClock:
    """Wall time and data wait at the last log line, and every log record so far."""

    t: float  # time.perf_counter() at the last log line
    wait_s: float = 0.0  # the prefetcher's cumulated data wait at the last log line
    paused_s: float = 0.0  # evals and checkpoint copies since the last log line (not steps)
    history: list = field(default_factory=list)


@dataclass
class TrainRun:
    """What the loop's helpers share during one `train` call (built once, before step 0)."""

    cfg: TrainConfig
    rt: Runtime
    out_dir: Path
    data: TrainData
    plan: RunPlan
    width: int  # tokens per packed row
    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer
    model: TTTModel
    ddp: torch.nn.Module  # `model` wrapped for data parallelism (itself on one rank)
    forward: Callable  # `ddp`, under torch.compile when `rt.compile`
    feed: DevicePrefetcher
    metrics: MetricsLog
    clock: WindowClock
    estimate: AcceptanceEstimate  # the eval's acceptance estimate (holds the whole lm_head)
    writer: CheckpointWriter  # checkpoints written in the background (checkpoint.py)
    eval_s: list = field(default_factory=list)  # wall seconds of each eval
    eval_parts: list = field(default_factory=list)  # per eval: waiting for rows, the estimate
    eval_rows: list | None = None  # this rank's eval rows in host memory, kept by the 1st eval
    greedy: dict = field(default_factory=dict)  # eval row -> the target's argmax (fixed data)


def train(cfg: TrainConfig, out_dir: Path, data: TrainData, draft: Eagle3Draft,
          embed_VH: torch.Tensor, teacher_VdH: torch.Tensor, rt: Runtime,
          lm_head_VH: torch.Tensor) -> dict:
    """Train `draft` in place (checkpoints under `out_dir/checkpoints`); returns the summary.
    `lm_head_VH` (the target's whole lm_head) serves only the evaluation's acceptance estimate.
    What compiles, compiles from and into the run's compile cache (`compile_cache`)."""
    with compile_cache(cfg, rt):
        return _train(cfg, out_dir, data, draft, embed_VH, teacher_VdH, rt, lm_head_VH)


def _train(cfg: TrainConfig, out_dir: Path, data: TrainData, draft: Eagle3Draft,
           embed_VH: torch.Tensor, teacher_VdH: torch.Tensor, rt: Runtime,
           lm_head_VH: torch.Tensor) -> dict:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    width = row_width(cfg.max_seq_len, cfg.pack_tokens,
                      max(data.train_lengths + data.eval_lengths))
    plan = build_plan(data.train_lengths, width, cfg.max_seq_len, cfg.seed, cfg.epochs,
                      rt.dist.world, cfg.grad_accum)
    num_steps = plan.num_steps
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, int(0.03 * num_steps))
    compute_dtype = torch.bfloat16 if rt.bf16 else torch.float32
    model = TTTModel(draft, embed_VH, teacher_VdH, cfg.ttt_steps, cfg.step_weight, rt.attention,
                     compute_dtype, cfg.topk_teacher, cfg.ttt_unroll).to(rt.device)
    estimate = AcceptanceEstimate(lm_head_VH, draft.t2d, rt.device, compute_dtype)
    fp8_layers = use_fp8_gemms(draft) if rt.fp8 else []
    optimizer = build_optimizer(draft, cfg.lr, cfg.weight_decay, rt.device)
    state, window_saved, resumed = _maybe_resume(cfg, out_dir, draft, optimizer, plan)
    ddp = distributed.wrap(model, rt.dist, rt.device)
    forward = torch.compile(ddp) if rt.compile else ddp
    # Resumed: the file is cut back to the checkpoint's step (its eval row included, not redone);
    # started afresh: rows of a run killed before its first checkpoint go.
    metrics = MetricsLog(out_dir, rt.dist.is_main, state.step if resumed else -1,
                         cfg.tensorboard)
    rows = [r for s in range(state.step, num_steps) for r in plan.rows_for(s, rt.dist.rank)]
    if data.stream:  # the same rows, their files waited for in the spool (stream.py)
        dataset = StreamRows(data.train_files, plan, state.step, rt.dist.rank, width,
                             cfg.max_seq_len, data.teacher_topk)
    else:
        dataset = PackedRows(data.train_files, rows, width, cfg.max_seq_len, data.teacher_topk)
    feed = DevicePrefetcher(make_loader(dataset, cfg.num_workers, rt.device.type == "cuda"),
                            rt.device)
    window = Window(cfg.ttt_steps, rt.device, window_saved)
    ema = torch.tensor(state.ema_loss, device=rt.device)
    bad_step = torch.tensor(state.nonfinite_step, device=rt.device)
    run = TrainRun(cfg, rt, Path(out_dir), data, plan, width, draft, optimizer, model, ddp,
                   forward, feed, metrics, WindowClock(time.perf_counter()), estimate,
                   CheckpointWriter())
    t_loop = time.perf_counter()
    start_step, last_eval = state.step, state.last_eval
    log.info("%d steps (%d epochs, %d rows of %d tokens per step, padding %.1f%%), warmup %d, "
             "%s attention, %s, GEMMs %s", num_steps, cfg.epochs, plan.rows_per_step, width,
             100 * plan.padding_share(data.train_lengths, width, cfg.max_seq_len), warmup,
             rt.attention, "compiled" if rt.compile else "eager",
             f"fp8 in {len(fp8_layers)} layers (lm_head not)" if fp8_layers else
             ("bf16" if rt.bf16 else "fp32"))
    try:
        for step in range(state.step, num_steps + 1):
            last_step = step == num_steps
            lr = lr_at(step, num_steps, cfg.lr, warmup, cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            due = last_step or step % cfg.eval_every == 0
            if due and not (resumed and step == start_step):  # done before that save
                raise_if_nonfinite(bad_step)
                last_eval = _run_eval(run, step)
            if step > start_step and (last_step or step % cfg.save_every == 0):
                raise_if_nonfinite(bad_step)
                state.step, state.ema_loss, state.nonfinite_step = step, float(ema), int(bad_step)
                state.last_eval = last_eval
                _save(run, step, state, window)
            if last_step:
                break
            step_loss = _micro_steps(run, window)
            if step == start_step:
                raise_if_gradient_missing(draft, rt.fp8)
            grad_norm = clip_gradients(optimizer, cfg.max_grad_norm, step, bad_step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == start_step and rt.dist.is_main:  # the moments exist from here on
                run.writer.reserve({"model": draft.state_dict(),
                                    "optimizer": optimizer.state_dict()})
            if rt.dist.enabled:  # the mean over ranks (a device collective, no host sync)
                step_loss = distributed.all_reduce_sum(step_loss) / rt.dist.world
            ema.mul_(0.9).add_(0.1 * step_loss)  # debiased by the global step count when logged
            window.steps += 1
            if (step + 1) % cfg.log_every == 0 or step + 1 == num_steps:
                raise_if_nonfinite(bad_step)
                state.tokens += _log_window(run, step + 1, window, ema, grad_norm, lr)
                window = Window(cfg.ttt_steps, rt.device)
    except BaseException:  # a signal, a bad batch: the checkpoint in flight is finished first
        run.writer.wait(raise_error=False)
        raise
    run.writer.wait()  # the last checkpoint is on disk before the stage exports or ends
    metrics.close()
    history = run.clock.history
    timed = history[1:] or history  # the first window holds warm-up/compile
    return {"num_steps": num_steps, "tokens": state.tokens, **last_eval,
            "padding": plan.padding_share(data.train_lengths, width, cfg.max_seq_len),
            "tok_s": sum(r["tok_s"] for r in timed) / max(len(timed), 1),
            "data_wait": sum(r["data_wait"] for r in timed) / max(len(timed), 1),
            "fp8_gemm": rt.fp8,
            "timings": {"loop_s": time.perf_counter() - t_loop, "eval_s": run.eval_s,
                        "eval_wait_s": [x["wait_s"] for x in run.eval_parts],
                        "eval_estimate_s": [x["estimate_s"] for x in run.eval_parts],
                        "save_blocked_s": run.writer.blocked_s,
                        "save_reserve_s": run.writer.reserve_s,
                        "save_write_s": run.writer.write_s,
                        "first_window_s": history[0]["elapsed_s"] if history else None}}


def _micro_steps(run: TrainRun, window: Window) -> torch.Tensor:
    """`grad_accum` forward+backward passes, one packed row each; returns their mean loss."""
    cfg, rt, model, ddp, forward, feed = run.cfg, run.rt, run.model, run.ddp, run.forward, run.feed
    step_loss = torch.zeros((), device=rt.device)
    for micro_step in range(cfg.grad_accum):
        batch = feed.next()
        masks = model.build_masks(batch["doc_ids"], compile_mask=rt.device.type == "cuda")
        if rt.fp8 and micro_step == 0:  # the weights' e4m3 copies after the last update or
            refresh_fp8_weights(run.draft)  # load, which the compiled forward reads (fp8.py)
        no_sync = rt.dist.enabled and micro_step < cfg.grad_accum - 1  # all-reduce once
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            with rt.autocast():
                loss, stats = forward(*_batch_args(batch), masks=masks, topk=_topk_arg(batch))
            (loss / cfg.grad_accum).backward()  # each backward adds to .grad: a mean
        feed.prefetch()  # the next row's host->device copy overlaps this step's kernels
        step_loss += loss.detach() / cfg.grad_accum
        window.stats += stats.detach()
        window.tokens += batch["tokens"]
        window.rows += 1
    return step_loss


def _maybe_resume(cfg, out_dir, draft, optimizer, plan: RunPlan) -> tuple[LoopState, dict, bool]:
    saved = load_latest(out_dir / "checkpoints", _checkpoint_config(cfg, draft))
    if saved is None:
        return LoopState(), {}, False
    check_data_position(saved, plan.rows_per_step, cfg.seed, saved["folder"])
    draft.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    set_rng_state(saved["rng"])
    return LoopState(**saved["loop_state"]), saved.get("window", {}), True


def _checkpoint_config(cfg: TrainConfig, draft: Eagle3Draft) -> dict:
    return {**config_dict(cfg), **draft.cfg.to_dict()}


def _save(run: TrainRun, step: int, state: LoopState, window: Window) -> None:
    cfg, plan, draft, optimizer = run.cfg, run.plan, run.draft, run.optimizer
    if run.rt.dist.is_main:
        epoch, row = (plan.locate(step)[0], plan.locate(step)[1] * plan.rows_per_step) \
            if step < plan.num_steps else (len(plan.epochs), 0)
        run.writer.save(run.out_dir / "checkpoints", step, {
            "model": draft.state_dict(), "optimizer": optimizer.state_dict(),
            "loop_state": asdict(state), "window": window.to_dict(),
            "schedule": {"num_steps": plan.num_steps, "peak_lr": cfg.lr,
                         "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio},
            "data": {"step": step, "epoch": epoch, "row": row, "seed": cfg.seed,
                     "rows_per_step": plan.rows_per_step}},
            _checkpoint_config(cfg, draft), cfg.keep_latest)
        run.clock.paused_s += run.writer.blocked_s[-1]
    distributed.barrier()


def _run_eval(run: TrainRun, step: int) -> dict:
    data = run.data
    if not data.eval_files:
        return {}
    t0 = time.perf_counter()
    keep = None
    if run.eval_rows:
        batches = run.eval_rows
    else:
        batches = eval_batches(data.eval_files, data.eval_lengths, run.cfg, run.rt, run.width,
                               data.teacher_topk)
        keep = []
    parts = {}
    result = evaluate(run.model, batches, run.cfg, run.rt, run.estimate, run.greedy, parts,
                      keep)
    if keep:
        run.eval_rows = keep
    run.eval_parts.append(parts)
    run.eval_s.append(time.perf_counter() - t0)
    run.clock.paused_s += run.eval_s[-1]
    log.info("eval step %d | loss %s | acc %s | %s", step,
             [round(x, 3) for x in result["eval_loss"]],
             [round(a, 3) for a in result["eval_acc"]], acceptance_note(result))
    run.metrics.write({"step": step, **result})
    return result


def acceptance_note(result: dict) -> str:
    """`sim-accept 1.520 +- 0.031 (256 samples) (loop share 0%, loop-free 1.50; data greedy
    100%, greedy in draft vocab 97%)` from an evaluation's result (the standard error where
    there are two samples or more)."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    se = result.get("eval_sim_accept_se")
    spread = f" +- {se:.3f} ({result.get('eval_sim_samples')} samples)" if se is not None else ""
    return (f"sim-accept {f(result.get('eval_sim_accept'), '.3f')}{spread} (loop share "
            f"{f(result.get('eval_loop_share'), '.0%')}, loop-free "
            f"{f(result.get('eval_sim_accept_loop_free'), '.3f')}; data greedy "
            f"{f(result.get('eval_greedy_share'), '.0%')}, greedy in draft vocab "
            f"{f(result.get('eval_greedy_in_draft_vocab'), '.0%')})")


def _log_window(run: TrainRun, step: int, window: Window, ema, grad_norm, lr: float) -> int:
    """Reduce the window over ranks (one host sync), write one log line; returns its tokens."""
    cfg, rt, clock, num_steps = run.cfg, run.rt, run.clock, run.plan.num_steps
    totals = distributed.all_reduce_sum(torch.cat([window.stats,
                                                   window.tokens.float().reshape(1)]))
    m = stats_dict(totals[:-1], cfg.ttt_steps)
    tokens = int(totals[-1])
    now = time.perf_counter()
    wall = now - clock.t
    elapsed = max(wall - clock.paused_s, 1e-9)  # training time: evals and saves left out
    rows = window.rows * rt.dist.world
    rec = {"step": step, "loss": float(ema) / (1 - 0.9 ** step), "loss_steps": m["loss_steps"],
           "acc": m["acc"], "lr": lr,
           "grad_norm": float(grad_norm), "tokens": tokens,
           "dt_ms": 1000 * elapsed / max(window.steps, 1), "tok_s": tokens / elapsed,
           "elapsed_s": elapsed, "wall_s": wall,
           "data_wait": (run.feed.wait_s - clock.wait_s) / elapsed,
           "padding": 1 - tokens / max(rows * run.width, 1)}
    clock.t, clock.wait_s, clock.paused_s = now, run.feed.wait_s, 0.0
    if rt.dist.is_main:
        log.info(metrics_line(rec, num_steps, rec["dt_ms"] / 1000 * (num_steps - step)))
    run.metrics.write(rec)
    clock.history.append(rec)
    return tokens
