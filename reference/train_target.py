#!/usr/bin/env python3
"""Reference target: a BPE tokenizer and a DeepSeek-V3 model (MLA + MoE) trained on the corpus.

The tokenizer is a byte-level BPE learned from the train files of the corpus, with the project's
Kimi-style special tokens and chat template (`eagle3.tiny.target`). The model is a
`DeepseekV3ForCausalLM` trained from scratch on the train samples rendered with that template
(so it learns the role headers, `<think></think>` and to close its replies with `<|im_end|>`):
packed sequences, AdamW with fp32 master weights, bf16 autocast on CUDA, warmup then cosine
over a wall-clock budget, and DeepSeek-V3's auxiliary-loss-free expert balancing (a per-expert
router bias nudged towards even load after every step). The folder it writes loads through
`AutoTokenizer` / `AutoModelForCausalLM` like any target; `reference_target.json` (written
last) holds the config and the training summary, and a re-run with it present is a no-op.

    python reference/train_target.py --corpus /tmp/ref/corpus --out /tmp/ref/target \
        --device cuda --train-seconds 200                       # H200, preset ref-100m
    python reference/train_target.py --corpus /tmp/s/corpus --out /tmp/s/target \
        --preset smoke --train-seconds 10                       # CPU smoke
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eagle3.core.cli import arg, config_dict, parse_config, setup_logging
from eagle3.core.progress import format_summary, human_seconds
from eagle3.core.records import read_jsonl
from eagle3.tiny.target import CHAT_TEMPLATE, END_OF_TURN, SPECIAL_TOKENS

log = logging.getLogger(__name__)
MARKER = "reference_target.json"


@dataclass
class TargetShape:
    """Architecture of a reference target (DeepSeek-V3 fields)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # nope + rope == v_head_dim keeps SDPA on its flash kernel
    v_head_dim: int
    intermediate_size: int  # dense MLP of the first layer
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    bpe_vocab_size: int  # BPE tokens before the special tokens are added


PRESETS = {
    # ~96M parameters (~40M active per token), 12 layers: big enough not to loop at once.
    "ref-100m": TargetShape(12, 512, 8, 192, 128, 48, 16, 64, 1536, 512, 8, 2, 8192),
    # CPU smoke: the same code paths in seconds.
    "smoke": TargetShape(8, 64, 4, 32, 32, 16, 8, 24, 128, 64, 4, 2, 512),
}


@dataclass
class TargetTrainConfig:
    corpus: Path = arg(help="corpus folder written by reference/build_corpus.py")
    out: Path = arg(help="target folder to write (tokenizer + model)")
    preset: str = arg("ref-100m", "architecture preset", choices=sorted(PRESETS))
    train_seconds: float = arg(200.0, "wall-clock training budget, seconds (the schedule's "
                                      "length; data preparation not included)")
    max_steps: int = arg(0, "stop after this many steps even within the budget (0 = no cap)")
    seq_len: int = arg(1024, "tokens per packed training row")
    batch_size: int = arg(64, "rows per optimizer step")
    lr: float = arg(1e-3, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final learning rate as a share of --lr")
    warmup_steps: int = arg(50, "linear warmup steps")
    weight_decay: float = arg(0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    balance_rate: float = arg(5e-3, "router bias update per step (aux-loss-free balancing; "
                                    "0 = off)")
    log_every: int = arg(20, "log a line every N steps")
    max_eval_rows: int = arg(64, "rows of held-out text for the final held-out loss")
    device: str = arg("cpu", "torch device (cuda on the GPU)")
    seed: int = arg(0, "seed of the init, the data order and the tokenizer trainer")
    force: bool = arg(False, "retrain even when a complete target with this config exists")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if self.train_seconds <= 0 and self.max_steps <= 0:
            raise ValueError("set --train-seconds > 0 or --max-steps > 0")
        if self.seq_len < 16 or self.batch_size < 1:
            raise ValueError("--seq-len must be >= 16 and --batch-size >= 1")


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], bpe_vocab_size: int):
    """Byte-level BPE learned from `texts`, wrapped with the Kimi-style specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token=END_OF_TURN, pad_token="[PAD]",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[BOS]", "[PAD]")])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render_samples(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of every row rendered by the chat template (thinking on: the served mode)."""
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- model


def build_model(shape: TargetShape, vocab_size: int, max_positions: int, seed: int):
    """A freshly initialised DeepseekV3ForCausalLM of `shape`, seeded."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, n_shared_experts=1,
        n_routed_experts=shape.n_routed_experts, num_experts_per_tok=shape.num_experts_per_tok,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=shape.q_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
        qk_nope_head_dim=shape.qk_nope_head_dim, v_head_dim=shape.v_head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(cfg)


def parameter_counts(model) -> dict:
    """Total parameters and those one token uses (shared + top-k of the routed experts)."""
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    embed = model.get_input_embeddings().weight.numel()
    return {"total": total, "active_per_token": active - embed, "routed_experts": routed}


class ExpertBalancer:
    """Aux-loss-free balancing (DeepSeek-V3, sec. 2.1.2): counts the experts each router picks
    and, after every step, moves each expert's selection bias by `rate` towards even load."""

    def __init__(self, model, rate: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._hook(load))

    @staticmethod
    def _hook(load: torch.Tensor):
        def count(module, inputs, output):  # output: (logits, topk weights, topk indices)
            if module.training:
                load.add_(torch.bincount(output[2].flatten(), minlength=load.numel()).float())
        return count

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; returns the worst max/mean expert load ratio of this step."""
        worst = 1.0
        for router, load in zip(self.routers, self.loads):
            if self.rate > 0:
                router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp(min=1)))
            load.zero_()
        return worst


# ---------------------------------------------------------------- schedule and data


def lr_at(step: int, progress: float, peak: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine to `peak * min_ratio` at progress 1.

    `progress` is the share of the budget spent (time or steps, whichever is further).
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def packed_rows(samples: list[list[int]], seq_len: int, seed: int, epoch: int) -> torch.Tensor:
    """One epoch: samples in a seeded order, concatenated, cut into rows of `seq_len + 1`."""
    order = list(range(len(samples)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    stream = np.concatenate([np.asarray(samples[i], dtype=np.int64) for i in order])
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(stream)} tokens make no row of --seq-len {seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx])


def row_batches(samples, cfg: TargetTrainConfig, device):
    """Endless batches `[B, seq_len + 1]` on `device`, epoch after epoch."""
    epoch = 0
    while True:
        rows = packed_rows(samples, cfg.seq_len, cfg.seed, epoch).to(device)
        for start in range(0, rows.shape[0] - cfg.batch_size + 1, cfg.batch_size):
            yield epoch, rows[start : start + cfg.batch_size]
        epoch += 1


def lm_loss(model, rows_BT1: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows_BT1[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), rows_BT1[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, samples: list[list[int]], cfg: TargetTrainConfig, autocast) -> float:
    """Mean next-token loss on held-out text (reported, never used to choose anything)."""
    if not samples:
        return float("nan")
    rows = packed_rows(samples, cfg.seq_len, cfg.seed, 0)[: cfg.max_eval_rows]
    model.eval()
    losses = []
    for start in range(0, rows.shape[0], cfg.batch_size):
        with autocast():
            losses.append(float(lm_loss(model, rows[start : start + cfg.batch_size]
                                        .to(cfg.device))))
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------- the loop


def train(model, samples: list[list[int]], cfg: TargetTrainConfig) -> dict:
    """Train in place until the time (or step) budget is spent; returns the summary."""
    device = torch.device(cfg.device)
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.95), fused=use_bf16)
    balancer = ExpertBalancer(model, cfg.balance_rate)
    batches = row_batches(samples, cfg, device)
    t0, step, tokens, ema, epoch, worst = time.perf_counter(), 0, 0, 0.0, 0, 1.0
    t_log, tok_log = t0, 0
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(elapsed / cfg.train_seconds if cfg.train_seconds > 0 else 0.0,
                       step / cfg.max_steps if cfg.max_steps > 0 else 0.0)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        epoch, rows = next(batches)
        with autocast():
            loss = lm_loss(model, rows)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += rows.shape[0] * (rows.shape[1] - 1)
        worst = balancer.step()
        if step % cfg.log_every == 0 or step == 1:
            value = float(loss.detach())  # one host sync per log line, not per step
            if not (math.isfinite(value) and math.isfinite(float(grad_norm))):
                raise FloatingPointError(f"step {step}: loss {value} / grad norm "
                                         f"{float(grad_norm)} is not finite; lower --lr")
            ema = value if step == 1 else 0.9 * ema + 0.1 * value
            now = time.perf_counter()
            rate = (tokens - tok_log) / max(now - t_log, 1e-9)
            t_log, tok_log = now, tokens
            eta = max(cfg.train_seconds - (now - t0), 0.0) if cfg.train_seconds > 0 else 0.0
            log.info("step %05d | epoch %d | loss %.4f | lr %.2e | grad %.2f | expert max/mean "
                     "%.2f | tok/s %s | eta %s", step, epoch, ema, lr, float(grad_norm), worst,
                     f"{rate:,.0f}", human_seconds(eta))
    seconds = time.perf_counter() - t0
    return {"steps": step, "tokens": tokens, "epochs": epoch + 1, "train_seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9), "final_train_loss_ema": ema,
            "expert_max_over_mean_load": worst}


def save_target(model, tokenizer, out: Path, summary: dict) -> None:
    """Write tokenizer + bf16 model to a temp folder, then rename it to `out`."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    model = model.to("cpu", torch.bfloat16).eval()
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TargetTrainConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    settings = {k: v for k, v in config_dict(cfg).items() if k not in ("force", "log_level")}
    marker = cfg.out / MARKER
    if marker.exists() and not cfg.force and json.loads(marker.read_text())["config"] == settings:
        log.info("reference target already trained in %s; --force retrains", cfg.out)
        return 0
    t0 = time.time()
    shape = PRESETS[cfg.preset]
    split = json.loads((cfg.corpus / "split.json").read_text())
    texts = [(Path(json.loads((cfg.corpus / "corpus.json").read_text())["stdlib"]) / p)
             .read_text(encoding="utf-8") for p in split["train"]]
    tokenizer = train_tokenizer(texts, shape.bpe_vocab_size)
    samples = render_samples(tokenizer, list(read_jsonl(cfg.corpus / "target_train.jsonl")))
    heldout = render_samples(tokenizer, list(read_jsonl(cfg.corpus / "heldout.jsonl")))
    prep_seconds = time.time() - t0
    model = build_model(shape, len(tokenizer), max(2048, 2 * cfg.seq_len), cfg.seed)
    model.set_experts_implementation("eager")  # any dtype under autocast; fine at 8 experts
    counts = parameter_counts(model)
    log.info("target %s: %s parameters (%s active per token, embedding excluded); %s samples, "
             "%s tokens", cfg.preset, f"{counts['total']:,}", f"{counts['active_per_token']:,}",
             f"{len(samples):,}", f"{sum(map(len, samples)):,}")
    summary = train(model, samples, cfg)
    device = torch.device(cfg.device)
    summary["heldout_loss"] = heldout_loss(
        model, heldout, cfg, lambda: torch.autocast(device.type, dtype=torch.bfloat16,
                                                    enabled=device.type == "cuda"))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    summary.update(parameters=counts, shape=asdict(shape), corpus_tokens=sum(map(len, samples)),
                   corpus_samples=len(samples), vocab_size=len(tokenizer),
                   prep_seconds=prep_seconds, peak_gpu_bytes=peak)
    save_target(model, tokenizer, cfg.out, {"config": settings, "summary": summary})
    rows = {"parameters (active/token)": f"{counts['total']:,} ({counts['active_per_token']:,})",
            "steps / epochs": f"{summary['steps']} / {summary['epochs']}",
            "tokens": f"{summary['tokens']:,}", "tokens/s": f"{summary['tokens_per_s']:,.0f}",
            "train loss (ema) / held-out loss":
                f"{summary['final_train_loss_ema']:.3f} / {summary['heldout_loss']:.3f}",
            "peak GPU memory": f"{peak / 2**30:.1f} GiB", "time": human_seconds(time.time() - t0),
            "output": str(cfg.out)}
    print(format_summary("reference target", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
