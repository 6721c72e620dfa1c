"""EAGLE-3 training with the training-time-test (TTT) unroll.

Loss at anchor t of step k (k = 0..ttt_steps-1): the draft reads token t+1+k and, as hidden,
fc(aux_t) for k = 0 or its own step k-1 output; its prediction is compared (soft cross-entropy)
with the target's distribution at position t+1+k, which is `softmax(lm_head_hot @ final_{t+1+k})`
over the draft vocabulary (the stored final state is post-norm: no second norm here). The weight
of that term is `loss_mask[t+1+k]`: the loss mask moves with the targets, so the last prompt
position (the first the draft serves) is trained. Step k's loss is scaled by `step_weight ** k`.

Data order is a pure function of (seed, epoch); a resumed run continues at the exact batch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3 import hidden_states as hs
from eagle3.cli import arg
from eagle3.draft_model import DraftConfig, Eagle3Draft, StepCache

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    target: Path = arg(help="target model folder (config.json, embedding and lm_head tensors)")
    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    ttt_steps: int = arg(7, "training-time-test unroll length (draft steps per anchor)")
    step_weight: float = arg(0.8, "loss weight of step k is step_weight**k")
    epochs: int = arg(1, "passes over the train split")
    batch_size: int = arg(1, "sequences per micro-step")
    grad_accum: int = arg(1, "micro-steps per optimizer step")
    lr: float = arg(1e-4, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final learning rate as a share of --lr (cosine floor)")
    warmup_steps: int = arg(-1, "linear warmup steps (-1 = 3%% of all steps)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(0.5, "gradient clipping norm")
    max_seq_len: int = arg(8192, "truncate samples to this many tokens")
    num_attention_heads: int = arg(0, "draft heads (0 = the target's)")
    num_key_value_heads: int = arg(0, "draft kv heads (0 = same as heads)")
    head_dim: int = arg(0, "draft head dim (0 = hidden / heads)")
    intermediate_size: int = arg(0, "draft MLP width (0 = the target's intermediate_size)")
    eval_every: int = arg(100, "evaluate the eval split every N steps (and at the end)")
    max_eval_samples: int = arg(256, "eval samples per evaluation")
    save_every: int = arg(500, "checkpoint every N steps (and at the end)")
    keep_latest: int = arg(2, "checkpoints kept")
    log_every: int = arg(10, "log a line every N steps")
    num_workers: int = arg(2, "background data-loading processes (0 = in the main process)")
    seed: int = arg(0, "seed of the init and the data order")
    device: str = arg("cpu", "torch device (cuda on GPUs)")
    precision: str = arg("auto", "bf16 autocast (cuda) or fp32; auto = bf16 on cuda, fp32 on cpu",
                         choices=["auto", "bf16", "fp32"])
    sglang_version: str | None = arg(None, "SGLang release serving the draft (only needed for "
                                           "capture layers whose first index is not 2)")
    allow_partial: bool = arg(False, "accept incomplete upstream folders")
    force: bool = arg(False, "restart training from scratch")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError("--ttt-steps must be >= 1")
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("--batch-size and --grad-accum must be >= 1")


# ---------------------------------------------------------------- schedule


def lr_at(step: int, num_steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine down to `peak * min_ratio` at `num_steps`."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    progress = min(max(progress, 0.0), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- data


def list_files(root: Path) -> list[Path]:
    """Hidden-state files of a split, ordered by their record index."""
    files = list(Path(root).glob("shard_*/data_*.pt"))
    return sorted(files, key=lambda p: int(p.stem.split("_")[1]))


def epoch_batches(num_files: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a seeded permutation cut into full batches."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(num_files, generator=g).tolist()
    return [perm[i : i + batch_size] for i in range(0, num_files - batch_size + 1, batch_size)]


def collate(samples: list[dict], max_seq_len: int) -> dict:
    """Right-padded batch: ids/mask `[B, T]`, aux `[B, T, 3Ht]`, final `[B, T, Ht]`."""
    rows = []
    for data in samples:
        aux, final = hs.unpack(data, torch.bfloat16)
        n = min(data["input_ids"].shape[0], max_seq_len)
        rows.append((data["input_ids"][:n], data["loss_mask"][:n],
                     torch.cat(aux, dim=-1)[:n], final[:n]))
    T = max(r[0].shape[0] for r in rows)
    B, Ht = len(rows), rows[0][3].shape[-1]
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
             "loss_mask": torch.zeros(B, T, dtype=torch.long),
             "aux": torch.zeros(B, T, 3 * Ht, dtype=torch.bfloat16),
             "final": torch.zeros(B, T, Ht, dtype=torch.bfloat16)}
    for b, (ids, mask, aux, final) in enumerate(rows):
        n = ids.shape[0]
        batch["input_ids"][b, :n], batch["loss_mask"][b, :n] = ids, mask
        batch["aux"][b, :n], batch["final"][b, :n] = aux, final
    batch["tokens"] = sum(r[0].shape[0] for r in rows)
    batch["padded_tokens"] = B * T
    return batch


class BatchDataset(torch.utils.data.Dataset):
    """Item i = the collated batch `batches[i]` (loaded by DataLoader workers ahead of use)."""

    def __init__(self, files: list[Path], batches: list[list[int]], max_seq_len: int):
        self.files, self.batches, self.max_seq_len = files, batches, max_seq_len

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return collate([hs.load(self.files[j]) for j in self.batches[i]], self.max_seq_len)


def iterate_batches(files, cfg: TrainConfig, start_micro: int):
    """Yield batches from global micro-batch index `start_micro` on, epoch after epoch."""
    per_epoch = len(epoch_batches(len(files), cfg.batch_size, cfg.seed, 0))
    epoch, offset = divmod(start_micro, per_epoch)
    while True:
        batches = epoch_batches(len(files), cfg.batch_size, cfg.seed, epoch)[offset:]
        loader = torch.utils.data.DataLoader(
            BatchDataset(files, batches, cfg.max_seq_len), batch_size=None, shuffle=False,
            num_workers=cfg.num_workers, prefetch_factor=4 if cfg.num_workers else None,
            persistent_workers=False)
        yield from loader
        epoch, offset = epoch + 1, 0


# ---------------------------------------------------------------- the TTT loss


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end to the same length (dim 1)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_loss(draft: Eagle3Draft, batch: dict, embed_VH: torch.Tensor, teacher_VdH: torch.Tensor,
             steps: int, step_weight: float) -> tuple[torch.Tensor, list[float], list[float]]:
    """(weighted loss, per-step loss, per-step accuracy) of one batch."""
    ids_BT, mask_BT = batch["input_ids"], batch["loss_mask"]
    B, T = ids_BT.shape
    # The target's distribution over the draft vocabulary at every position (teacher).
    with torch.no_grad():
        teacher_logits = batch["final"].to(teacher_VdH.dtype) @ teacher_VdH.T
        teacher_p = torch.softmax(teacher_logits.float(), dim=-1)  # [B, T, Vd]
    hidden = draft.fc(batch["aux"].to(draft.fc.weight.dtype))  # once per batch, not per step
    positions = torch.arange(T, device=ids_BT.device).expand(B, T)
    cache = StepCache()
    total = torch.zeros((), device=ids_BT.device)
    losses, accs = [], []
    for k in range(steps):
        tokens = shift_left(ids_BT, 1 + k)
        weight = shift_left(mask_BT, 1 + k).float()
        target_p = shift_left(teacher_p, 1 + k)
        embeds = F.embedding(tokens, embed_VH).to(hidden.dtype)
        logits, hidden = draft.step(embeds, hidden, positions + k, cache)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(target_p * logp).sum(-1)  # [B, T]
        denom = weight.sum().clamp(min=1.0)
        loss_k = (ce * weight).sum() / denom
        total = total + (step_weight ** k) * loss_k
        with torch.no_grad():
            hit = (logits.argmax(-1) == target_p.argmax(-1)).float()
            accs.append(float((hit * weight).sum() / denom))
        losses.append(float(loss_k.detach()))
    return total, losses, accs


def simulated_acceptance(accs: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected accepted length if steps failed independently."""
    total, run = 1.0, 1.0
    for a in accs:
        run *= a
        total += run
    return total


# ---------------------------------------------------------------- assembly


def build_draft_config(cfg: TrainConfig, info, draft_vocab: int, capture_layers) -> DraftConfig:
    heads = cfg.num_attention_heads or info.num_attention_heads
    return DraftConfig(
        hidden_size=info.hidden_size,  # serving reuses the target's embedding: same width
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_key_value_heads or heads,
        head_dim=cfg.head_dim or info.hidden_size // heads,
        intermediate_size=cfg.intermediate_size or info.intermediate_size,
        vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=info.hidden_size,
        rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta,
        max_position_embeddings=info.max_position_embeddings,
        capture_layers=list(capture_layers),
    )


def build_draft(dcfg: DraftConfig, seed: int, d2t, t2d) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(dcfg)
    for name, p in draft.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    draft.set_vocab_mapping(d2t, t2d)
    return draft


@torch.no_grad()
def evaluate(draft, files, cfg: TrainConfig, embed, teacher, autocast) -> dict:
    draft.eval()
    losses, accs, n = [0.0] * cfg.ttt_steps, [0.0] * cfg.ttt_steps, 0
    for f in files[: cfg.max_eval_samples]:
        batch = _to_device(collate([hs.load(f)], cfg.max_seq_len), cfg.device)
        with autocast():
            _, ls, acs = ttt_loss(draft, batch, embed, teacher, cfg.ttt_steps, cfg.step_weight)
        losses = [a + b for a, b in zip(losses, ls)]
        accs = [a + b for a, b in zip(accs, acs)]
        n += 1
    draft.train()
    n = max(n, 1)
    accs = [a / n for a in accs]
    return {"eval_loss": [l / n for l in losses], "eval_acc": accs,
            "eval_sim_accept": simulated_acceptance(accs)}


def _to_device(batch: dict, device: str) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}


def metrics_line(step: int, num_steps: int, m: dict, eta_s: float) -> str:
    """One fixed-format log line."""
    from eagle3.progress import human_seconds

    return (f"step {step:05d}/{num_steps:05d} ({100 * step / max(num_steps, 1):.1f}%) | "
            f"loss {m['loss']:.4f} | acc0 {m['acc'][0]:.3f} | sim-accept {m['sim_accept']:.2f} | "
            f"lr {m['lr']:.1e} | dt {m['dt_ms']:.0f}ms | tok/s {m['tok_s']:,.0f} | "
            f"data-wait {100 * m['data_wait']:.0f}% | eta {human_seconds(eta_s)}")


def append_jsonl(path: Path, obj: dict) -> None:
    with Path(path).open("a") as f:
        f.write(json.dumps(obj) + "\n")


def timed_next(it) -> tuple[dict, float]:
    t = time.perf_counter()
    batch = next(it)
    return batch, time.perf_counter() - t


# ---------------------------------------------------------------- the loop


def train(cfg: TrainConfig, out_dir: Path, train_files: list[Path], eval_files: list[Path],
          draft: Eagle3Draft, embed_VH: torch.Tensor, teacher_VdH: torch.Tensor) -> dict:
    """Train `draft` in place; checkpoints under `out_dir/checkpoints`. Returns the summary."""
    device = torch.device(cfg.device)
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    draft.to(device)
    embed_VH = embed_VH.to(device, torch.bfloat16 if use_bf16 else torch.float32)
    teacher_VdH = teacher_VdH.to(device, torch.bfloat16 if use_bf16 else torch.float32)
    per_epoch = len(epoch_batches(len(train_files), cfg.batch_size, cfg.seed, 0))
    num_steps = cfg.epochs * per_epoch // cfg.grad_accum
    if num_steps < 1:
        raise ValueError(f"{len(train_files)} train samples make no full step of "
                         f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}")
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, int(0.03 * num_steps))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)  # fp32 master weights
    from eagle3.checkpoint import load_latest, save_checkpoint
    from eagle3.cli import config_dict

    ckpt_config = {**config_dict(cfg), **draft.cfg.to_dict()}
    loop_state = {"step": 0, "tokens": 0, "ema_loss": 0.0}
    state = load_latest(out_dir / "checkpoints", ckpt_config)
    if state is not None:
        from eagle3.checkpoint import set_rng_state

        draft.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loop_state = state["loop_state"]
        set_rng_state(state["rng"])
    start_step = loop_state["step"]
    metrics_path = out_dir / "metrics.jsonl"
    data = iterate_batches(train_files, cfg, start_step * cfg.grad_accum)
    draft.train()
    t_last, wait, timed_tokens, timed_steps, last_eval = time.perf_counter(), 0.0, 0, 0, {}
    for step in range(start_step, num_steps + 1):
        last_step = step == num_steps
        lr = lr_at(step, num_steps, cfg.lr, warmup, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if eval_files and (last_step or (step % cfg.eval_every == 0 and step > start_step)):
            last_eval = evaluate(draft, eval_files, cfg, embed_VH, teacher_VdH, autocast)
            log.info("eval step %d | loss0 %.4f | acc %s | sim-accept %.2f", step,
                     last_eval["eval_loss"][0], [round(a, 3) for a in last_eval["eval_acc"]],
                     last_eval["eval_sim_accept"])
            append_jsonl(metrics_path, {"step": step, **last_eval})
        if step > start_step and (last_step or step % cfg.save_every == 0):
            loop_state["step"] = step
            save_checkpoint(out_dir / "checkpoints", step, draft.state_dict(),
                            optimizer.state_dict(), loop_state, ckpt_config, cfg.keep_latest)
        if last_step:
            break
        step_losses, step_accs, tokens, padded = [0.0] * cfg.ttt_steps, [0.0] * cfg.ttt_steps, 0, 0
        for micro_step in range(cfg.grad_accum):
            batch, waited = timed_next(data)
            wait += waited
            batch = _to_device(batch, cfg.device)
            with autocast():
                loss, ls, acs = ttt_loss(draft, batch, embed_VH, teacher_VdH, cfg.ttt_steps,
                                         cfg.step_weight)
            (loss / cfg.grad_accum).backward()  # each backward adds to .grad: average micro-steps
            step_losses = [a + b / cfg.grad_accum for a, b in zip(step_losses, ls)]
            step_accs = [a + b / cfg.grad_accum for a, b in zip(step_accs, acs)]
            tokens += batch["tokens"]
            padded += batch["padded_tokens"]
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.max_grad_norm)
        weighted = sum(cfg.step_weight ** k * l for k, l in enumerate(step_losses))
        if not (math.isfinite(weighted) and math.isfinite(float(grad_norm))):
            raise FloatingPointError(f"step {step}: loss {weighted} / grad norm {float(grad_norm)}"
                                     " is not finite; stopping before the update")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loop_state["tokens"] += tokens
        # EMA of the loss, debiased by the global step count (as Adam debiases its moments),
        # so that a resumed run logs the same values as an uninterrupted one.
        loop_state["ema_loss"] = 0.9 * loop_state["ema_loss"] + 0.1 * weighted
        timed_tokens += tokens
        timed_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == num_steps:
            now = time.perf_counter()
            dt = (now - t_last) / timed_steps
            m = {"step": step + 1, "loss": loop_state["ema_loss"] / (1 - 0.9 ** (step + 1)),
                 "loss_steps": step_losses, "acc": step_accs,
                 "sim_accept": simulated_acceptance(step_accs), "lr": lr,
                 "grad_norm": float(grad_norm), "dt_ms": 1000 * dt,
                 "tok_s": timed_tokens / max(now - t_last, 1e-9),
                 "data_wait": wait / max(now - t_last, 1e-9), "padding": 1 - tokens / padded}
            log.info(metrics_line(step + 1, num_steps, m, dt * (num_steps - step - 1)))
            append_jsonl(metrics_path, m)
            t_last, wait, timed_tokens, timed_steps = now, 0.0, 0, 0
    return {"num_steps": num_steps, "tokens": loop_state["tokens"], **last_eval}
