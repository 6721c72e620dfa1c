"""Offline speculative decoding: a draft against a transformers target, greedy, chain.

Each round the draft proposes `steps` tokens from the target's aux states (exactly as SGLang's
draft extend + draft decode do), the target verifies them in one forward pass, the longest
prefix matching its own greedy choices is accepted, and the target's next token is added as the
bonus. The acceptance length of a round is accepted + 1 (SGLang's definition: what one verify
pass commits); the run's acceptance length is committed tokens / verify passes. Output must equal
plain greedy decoding token for token (checked by the tests and reported by 05).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle3.draft_model import Eagle3Draft, StepCache


class Proposer(Protocol):
    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        """Draft `steps` target ids following `ids` (the last of which the target has not
        processed yet); `aux_NK` are the target's aux states of `ids[:-1]`."""


class TargetRunner:
    """A transformers target with a KV cache that can be cut back after a rejection."""

    def __init__(self, model, capture_layers: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.capture_layers = capture_layers
        self.cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens: (logits `[n, V]`, aux `[n, 3Ht]`)."""
        x = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True,
                         output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.capture_layers], dim=-1)
        return out.logits[0].float(), aux

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (negative crop: the non-deprecated form)."""
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)


@dataclass
class DecodeResult:
    output_ids: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # per verify pass: accepted + 1
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def _finish(ids: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut generated ids at the first eos (kept) or at `max_new`; True when done."""
    for i, t in enumerate(ids[:max_new]):
        if t in eos:
            return ids[: i + 1], True
    return ids[:max_new], len(ids) >= max_new


def greedy_decode(model, prompt: list[int], max_new: int, eos: set[int]) -> DecodeResult:
    """Plain greedy decoding with a KV cache (the reference and the baseline throughput)."""
    t0 = time.perf_counter()
    runner = TargetRunner(model, [0])
    logits, _ = runner.forward(prompt)
    out = [int(logits[-1].argmax())]
    while not _finish(out, max_new, eos)[1]:
        logits, _ = runner.forward(out[-1:])
        out.append(int(logits[-1].argmax()))
    return DecodeResult(_finish(out, max_new, eos)[0], seconds=time.perf_counter() - t0)


def speculative_decode(model, proposer: Proposer, prompt: list[int], max_new: int,
                       eos: set[int], steps: int, capture_layers: list[int]) -> DecodeResult:
    """Greedy chain speculative decoding; returns the output and per-round accept lengths."""
    t0 = time.perf_counter()
    runner = TargetRunner(model, capture_layers)
    logits, aux = runner.forward(prompt)  # prefill: the first token is not a verify pass
    ids = list(prompt) + [int(logits[-1].argmax())]
    result = DecodeResult([])
    while not _finish(ids[len(prompt):], max_new, eos)[1]:
        drafts = proposer.propose(ids, aux, steps)
        logits, new_aux = runner.forward([ids[-1]] + drafts)
        greedy = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        ids += drafts[:accepted] + [greedy[accepted]]
        aux = torch.cat([aux, new_aux[: accepted + 1]], dim=0)
        runner.crop(len(ids) - 1)  # the target has processed every committed id but the last
        result.accept_lengths.append(accepted + 1)
    result.output_ids = _finish(ids[len(prompt):], max_new, eos)[0]
    result.seconds = time.perf_counter() - t0
    return result


class Eagle3Proposer:
    """Proposes with an EAGLE-3 draft the way SGLang serves it (chain, top-1)."""

    def __init__(self, draft: Eagle3Draft, embed_VH: torch.Tensor):
        self.draft = draft
        self.embed = embed_VH.to(next(draft.parameters()).dtype)

    @torch.no_grad()
    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        n = aux_NK.shape[0]  # target states of ids[0..n-1]; ids[n] is the pending token
        dev = self.embed.device
        dtype = self.embed.dtype
        embeds = self.embed[torch.tensor(ids[1 : n + 1], device=dev)][None]
        hidden = self.draft.fc(aux_NK.to(dtype)[None])
        cache = StepCache()
        logits, out = self.draft.step(embeds, hidden, torch.arange(n, device=dev)[None], cache)
        tokens = [int(self.draft.draft_to_target(logits[0, -1].argmax()))]
        hidden, anchor = out[:, -1:], torch.tensor([n - 1], device=dev)
        for k in range(1, steps):
            embeds = self.embed[torch.tensor([tokens[-1]], device=dev)][None]
            logits, hidden = self.draft.step(embeds, hidden,
                                             torch.tensor([[n - 1 + k]], device=dev), cache,
                                             anchors_T=anchor)
            tokens.append(int(self.draft.draft_to_target(logits[0, -1].argmax())))
        return tokens


class OracleProposer:
    """Proposes the target's own greedy continuation: every proposal is accepted."""

    def __init__(self, prompt: list[int], reference_output: list[int]):
        self.full = list(prompt) + list(reference_output)

    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        start = len(ids)
        return self.full[start : start + steps] or [0]
