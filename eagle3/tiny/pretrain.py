"""Brief, deterministic pretraining of the tiny target on the embedded demo text (opt-in).

Not used by demo.sh yet: 150 steps (loss 7.1 -> 0.41) took 621 s on a heavily loaded 2-core
machine and the greedy replies measured after them still loop; whether it lifts the demo's
loop-free acceptance is not measured.

A randomly initialised target decodes greedily into loops from the first token, and a draft
predicts a loop trivially: its acceptance then says nothing. The aim is a target with learned
behaviour: trained on the demo's own conversations (datasets/samples/, rendered with the
target's chat template), its greedy replies should follow the demo text rather than loop.

Same config and architecture as the untrained target (eagle3/tiny/target.py); only the weights
differ. Deterministic: fixed seed, fixed data order, one intra-op thread while it trains.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SAMPLES = Path(__file__).resolve().parents[2] / "datasets" / "samples"
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


@dataclass
class PretrainConfig:
    """How the tiny target is pretrained (written into tiny_target.json)."""

    steps: int = 150  # optimizer steps (loss 7.1 -> 0.41 on the demo text, measured)
    rows: int = 8  # token rows per step
    row_tokens: int = 128  # tokens per row (cut from the concatenated conversations)
    lr: float = 3e-3  # AdamW peak, cosine to 10% after a 5% warmup
    seed: int = 0


def demo_conversations(samples: Path = SAMPLES) -> list[dict]:
    """The demo's conversations as {"messages", "tools"} (ShareGPT and OpenAI files)."""
    convs = []
    for line in (samples / "sharegpt_demo.jsonl").read_text().splitlines():
        turns = json.loads(line)["conversations"]
        convs.append({"messages": [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                                   for t in turns], "tools": None})
    for line in (samples / "openai_tools_demo.jsonl").read_text().splitlines():
        row = json.loads(line)
        convs.append({"messages": row["messages"], "tools": row.get("tools")})
    return convs


def token_stream(tokenizer, convs: list[dict]) -> torch.Tensor:
    """Every conversation rendered with the chat template, concatenated `[N]`."""
    ids = []
    for c in convs:
        ids += tokenizer.apply_chat_template(c["messages"], tools=c["tools"], tokenize=True,
                                             return_dict=False)
    return torch.tensor(ids, dtype=torch.long)


def _lr(step: int, cfg: PretrainConfig) -> float:
    warmup = max(1, cfg.steps // 20)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def pretrain(model, tokenizer, cfg: PretrainConfig | None = None) -> dict:
    """Train `model` in place on the demo text; returns {"steps", "loss_start", "loss_end",
    "seconds", "tokens"}."""
    cfg = cfg or PretrainConfig()
    stream = token_stream(tokenizer, demo_conversations())
    n_rows = stream.numel() // cfg.row_tokens
    rows = stream[: n_rows * cfg.row_tokens].view(n_rows, cfg.row_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same sums in the same order on every machine
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    t0, losses = time.perf_counter(), []
    try:
        order = torch.randperm(n_rows, generator=g)
        for step in range(cfg.steps):
            if (step * cfg.rows) % n_rows + cfg.rows > n_rows:
                order = torch.randperm(n_rows, generator=g)
            start = (step * cfg.rows) % n_rows
            batch = rows[order[start:start + cfg.rows]]
            for group in opt.param_groups:
                group["lr"] = _lr(step, cfg)
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
        model.eval()
    out = {"steps": cfg.steps, "tokens": int(stream.numel()), "loss_start": losses[0],
           "loss_end": sum(losses[-10:]) / len(losses[-10:]),
           "seconds": time.perf_counter() - t0, "config": asdict(cfg)}
    log.info("pretrained the tiny target on the demo text: %d steps, loss %.2f -> %.2f, %.0f s",
             cfg.steps, out["loss_start"], out["loss_end"], out["seconds"])
    return out
