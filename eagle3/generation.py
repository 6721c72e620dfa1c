"""Stage 01b logic: conversations -> tokenized records, regenerating responses with the target.

For a dataset marked `regenerate`, each conversation is cut before its last assistant turn, the
prompt is rendered with the target's template (exactly what serving feeds it), and the target
generates the reply greedily; the record keeps the exact generated token ids (no decode and
re-encode). For other datasets the existing replies are rendered with their loss masks.

Output is append-only JSONL resumed by record id. Regeneration runs in fixed batches (the same
batches on every run), and a batch with any missing record is regenerated whole, so a resumed
run writes the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from eagle3.chat import ChatRenderer, RenderError, split_for_generation
from eagle3.records import JsonlAppender, TokenizedRecord, read_jsonl

log = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    """One conversation to regenerate: its id, source and serving prompt."""

    id: str
    source: str
    prompt_ids: list[int]
    max_new_tokens: int


def existing_ids(path: Path) -> set[str]:
    """Ids already written to a (possibly torn) output file."""
    return {r["id"] for r in read_jsonl(path)} if Path(path).exists() else set()


def tokenize_kept(conv: dict, renderer: ChatRenderer, max_seq_len: int) -> Iterator[dict]:
    """Records for a conversation kept as is: one per user segment (see eagle3.chat)."""
    samples = list(renderer.supervised_samples(conv["messages"], conv.get("tools")))
    for k, (ids, mask, n_prompt) in enumerate(samples):
        if len(ids) > max_seq_len:
            raise RenderError(f"too long: {len(ids)} tokens > max_seq_len {max_seq_len}")
        rid = conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}"
        yield TokenizedRecord(rid, conv["source"], ids, mask, n_prompt, "dataset").to_json()


def build_job(conv: dict, renderer: ChatRenderer, max_seq_len: int, max_new_tokens: int):
    """The generation job of a conversation, or RenderError saying why it has none."""
    prompt_msgs, _ = split_for_generation(conv["messages"])
    if not prompt_msgs or prompt_msgs[-1]["role"] not in ("user", "tool"):
        raise RenderError("no prompt: the conversation does not end in a user or tool turn "
                          "before its last assistant reply")
    prompt = renderer.prompt_ids(prompt_msgs, conv.get("tools"))
    budget = min(max_new_tokens, max_seq_len - len(prompt))
    if budget < 1:
        raise RenderError(f"too long: prompt has {len(prompt)} tokens, max_seq_len {max_seq_len}")
    return GenerationJob(conv["id"], conv["source"], prompt, budget)


class HFGenerator:
    """Greedy generation with an in-process transformers target (small targets, tests)."""

    def __init__(self, model, eos_ids: list[int], pad_id: int):
        self.model = model
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    @torch.no_grad()
    def generate(self, jobs: list[GenerationJob]) -> list[tuple[list[int], str]]:
        """(output ids, finish reason) per job; output stops after the first eos id."""
        device = self.model.device
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, j in enumerate(jobs):  # left padding: generation continues every row at the end
            ids[b, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            attn[b, width - len(j.prompt_ids):] = 1
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=max(j.max_new_tokens for j in jobs),
            do_sample=False,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )[:, width:].tolist()
        results = []
        for j, row in zip(jobs, out):
            row = row[: j.max_new_tokens]
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            if stop is None:
                results.append((row, "length"))
            else:
                results.append((row[: stop + 1], "stop"))
        return results


def run_generation(jobs: list[GenerationJob], generator: HFGenerator, out: JsonlAppender,
                   raw: JsonlAppender, done: set[str], batch_size: int, bar) -> dict:
    """Generate every job not in `done`, writing tokenized + raw records; returns counts."""
    counts = {"generated": 0, "length": 0, "stop": 0, "output_tokens": 0}
    # Fixed batches over a fixed order (longest first): identical on every run of the stage.
    order = sorted(jobs, key=lambda j: (-len(j.prompt_ids), j.id))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        if all(j.id in done for j in batch):
            bar.update(len(batch))
            continue
        for job, (output, reason) in zip(batch, generator.generate(batch)):
            if job.id in done:
                continue
            rec = TokenizedRecord(job.id, job.source, job.prompt_ids + output,
                                  [0] * len(job.prompt_ids) + [1] * len(output),
                                  len(job.prompt_ids), reason)
            # raw first: `done` is read from the tokenized file, so a kill between the two
            # writes repeats a raw line (harmless) rather than losing one.
            raw.write({"id": job.id, "output_ids": output, "finish_reason": reason})
            out.write(rec.to_json())
            counts["generated"] += 1
            counts[reason] += 1
            counts["output_tokens"] += len(output)
        out.flush()
        raw.flush()
        bar.update(len(batch))
    return counts
