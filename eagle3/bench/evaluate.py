"""Offline speculative decoding: a draft against a transformers target, chain (top-1), lossless.

Each round the draft proposes `steps` tokens from the target's aux states (exactly as SGLang's
draft extend + draft decode do), the target verifies them in one forward pass, and the round
commits the accepted draft tokens plus one token of the target's own (the bonus, or the
correction after a rejection). The acceptance length of a round is accepted + 1 (SGLang's
definition: what one verify pass commits); the run's acceptance length is committed tokens over
verify passes. The first token comes from the prefill and is not a verify pass.

- Temperature 0 (greedy): a draft token is accepted while it equals the target's argmax. The
  output equals plain greedy decoding token for token (checked by the tests and reported by 05).
- Temperature > 0 (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): the draft
  samples token x from its distribution q (its softmax over the draft vocabulary at the same
  temperature, mapped to target ids through `d2t`); x is accepted with probability
  min(1, p(x) / q(x)) where p is the target's softmax at that temperature; on rejection the round
  ends with a token drawn from norm(max(0, p - q)); when every draft token is accepted the bonus
  is drawn from p. The output is distributed exactly as plain sampling from the target (a
  statistical test checks it). SGLang's own EAGLE verify at temperature > 0 ("target only"
  sampling of a top-k tree) is a different rule, so SGLang's figures at temperature > 0 can
  differ from these; at temperature 0 both are the same greedy rule.

Top-k trees (`--speculative-eagle-topk` > 1) are not evaluated here: only chains.

Shapes: N committed positions the target has processed, K = 3 x target hidden (aux width),
V target vocab, S draft steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle3.draft.attention import StepCache
from eagle3.draft.model import Eagle3Draft


class Target(Protocol):
    """A target that runs new tokens against its cache and can cut the cache back."""

    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens: (logits `[n, V]`, aux `[n, K]`)."""

    def crop(self, length: int) -> None:
        """Keep the first `length` processed positions."""


class Proposer(Protocol):
    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        """Draft `steps` target ids greedily following `ids` (the last of which the target has
        not processed yet); `aux_NK` are the target's aux states of `ids[:-1]`."""

    def propose_sampled(self, ids: list[int], aux_NK: torch.Tensor, steps: int,
                        temperature: float, generator: torch.Generator
                        ) -> tuple[list[int], torch.Tensor]:
        """Sample `steps` target ids; also returns the draft distributions `[S, V]` (CPU) that
        each token was drawn from, over target ids."""


class TargetRunner:
    """A transformers target with a KV cache that can be cut back after a rejection."""

    def __init__(self, model, capture_layers: list[int]):
        from transformers import DynamicCache

        self.model = model
        self.capture_layers = capture_layers
        self.cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens: (logits `[n, V]`, aux `[n, K]`)."""
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
    # per verify pass: tokens in context when it started (prompt + committed, the pending one
    # included): the position of its first draft token
    round_contexts: list[int] = field(default_factory=list)
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


def target_probs(logits_nV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at `temperature`, float32 on CPU (where the sampling generator lives)."""
    return torch.softmax(logits_nV.float() / temperature, dim=-1).cpu()


def _pick(logits_V: torch.Tensor, temperature: float, generator) -> int:
    """Argmax at temperature 0, else one sample of the softmax at `temperature`."""
    if temperature == 0:
        return int(logits_V.argmax())
    return int(torch.multinomial(target_probs(logits_V[None], temperature)[0], 1,
                                 generator=generator))


def verify_greedy(logits_nV: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted draft count, the target's token after them) under greedy verification."""
    greedy = logits_nV.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return accepted, greedy[accepted]


def verify_sampled(p_nV: torch.Tensor, q_SV: torch.Tensor, drafts: list[int],
                   generator: torch.Generator) -> tuple[int, int]:
    """Chain rejection sampling: (accepted draft count, the round's last token).

    `p_nV[i]` is the target distribution at the position verifying `drafts[i]` (row S is the
    bonus position); `q_SV[i]` the draft distribution `drafts[i]` was drawn from.
    """
    for i, x in enumerate(drafts):
        px, qx = float(p_nV[i, x]), float(q_SV[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u * qx < px:  # u < min(1, p/q): accept
            continue
        residual = (p_nV[i] - q_SV[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability 0
            residual = p_nV[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p_nV[len(drafts)], 1, generator=generator))


def autoregressive_decode(target: Target, prompt: list[int], max_new: int, eos: set[int],
                          temperature: float = 0.0,
                          generator: torch.Generator | None = None) -> DecodeResult:
    """Plain decoding, one target pass a token (the reference and the baseline throughput)."""
    t0 = time.perf_counter()
    logits, _ = target.forward(prompt)
    out = [_pick(logits[-1], temperature, generator)]
    while not _finish(out, max_new, eos)[1]:
        logits, _ = target.forward(out[-1:])
        out.append(_pick(logits[-1], temperature, generator))
    return DecodeResult(_finish(out, max_new, eos)[0], seconds=time.perf_counter() - t0)


def speculative_chain(target: Target, proposer: Proposer, prompt: list[int], max_new: int,
                      eos: set[int], steps: int, temperature: float = 0.0,
                      generator: torch.Generator | None = None) -> DecodeResult:
    """Chain speculative decoding (greedy at temperature 0, else speculative sampling)."""
    t0 = time.perf_counter()
    logits, aux = target.forward(prompt)  # prefill: the first token is not a verify pass
    ids = list(prompt) + [_pick(logits[-1], temperature, generator)]
    result = DecodeResult([])
    while not _finish(ids[len(prompt):], max_new, eos)[1]:
        if temperature == 0:
            drafts = proposer.propose(ids, aux, steps)
            logits, new_aux = target.forward([ids[-1]] + drafts)
            accepted, last = verify_greedy(logits, drafts)
        else:
            drafts, q_SV = proposer.propose_sampled(ids, aux, steps, temperature, generator)
            logits, new_aux = target.forward([ids[-1]] + drafts)
            accepted, last = verify_sampled(target_probs(logits, temperature), q_SV, drafts,
                                            generator)
        result.round_contexts.append(len(ids))
        ids += drafts[:accepted] + [last]
        aux = torch.cat([aux, new_aux[: accepted + 1]], dim=0)
        target.crop(len(ids) - 1)  # the target has processed every committed id but the last
        result.accept_lengths.append(accepted + 1)
    result.output_ids = _finish(ids[len(prompt):], max_new, eos)[0]
    result.seconds = time.perf_counter() - t0
    return result


def greedy_decode(model, prompt: list[int], max_new: int, eos: set[int]) -> DecodeResult:
    """Plain greedy decoding of a transformers target with a KV cache."""
    return autoregressive_decode(TargetRunner(model, [0]), prompt, max_new, eos)


def speculative_decode(model, proposer: Proposer, prompt: list[int], max_new: int,
                       eos: set[int], steps: int, capture_layers: list[int],
                       temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> DecodeResult:
    """`speculative_chain` on a transformers target capturing aux states at `capture_layers`."""
    return speculative_chain(TargetRunner(model, capture_layers), proposer, prompt, max_new,
                             eos, steps, temperature, generator)


class Eagle3Proposer:
    """Proposes with an EAGLE-3 draft the way SGLang serves it (chain, top-1)."""

    def __init__(self, draft: Eagle3Draft, embed_VH: torch.Tensor):
        self.draft = draft
        self.embed = embed_VH.to(next(draft.parameters()).dtype)

    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        return self._run(ids, aux_NK, steps, lambda logits: (self._to_target(logits.argmax()),
                                                             None))[0]

    def propose_sampled(self, ids: list[int], aux_NK: torch.Tensor, steps: int,
                        temperature: float, generator: torch.Generator
                        ) -> tuple[list[int], torch.Tensor]:
        vocab = self.draft.cfg.vocab_size
        draft_ids = torch.arange(self.draft.cfg.draft_vocab_size)
        target_ids = (draft_ids + self.draft.d2t.cpu()).long()

        def pick(logits_D):
            q_D = torch.softmax(logits_D.float().cpu() / temperature, dim=-1)
            d = int(torch.multinomial(q_D, 1, generator=generator))
            q_V = torch.zeros(vocab).index_add_(0, target_ids, q_D)  # over target ids
            return int(target_ids[d]), q_V

        tokens, dists = self._run(ids, aux_NK, steps, pick)
        return tokens, torch.stack(dists)

    def _to_target(self, draft_id: torch.Tensor) -> int:
        return int(self.draft.draft_to_target(draft_id))

    @torch.no_grad()
    def _run(self, ids: list[int], aux_NK: torch.Tensor, steps: int, pick):
        """Extend over the context, then `steps - 1` decode steps; `pick(logits)` -> (id, q)."""
        n = aux_NK.shape[0]  # target states of ids[0..n-1]; ids[n] is the pending token
        dev = self.embed.device
        embeds = self.embed[torch.tensor(ids[1 : n + 1], device=dev)][None]
        hidden = self.draft.project_aux(aux_NK.to(self.embed.dtype)[None])
        cache = StepCache()
        logits, out = self.draft.step(embeds, hidden, torch.arange(n, device=dev)[None], cache)
        token, q = pick(logits[0, -1])
        tokens, dists = [token], [q]
        hidden, anchor = out[:, -1:], torch.tensor([n - 1], device=dev)
        for k in range(1, steps):
            embeds = self.embed[torch.tensor([tokens[-1]], device=dev)][None]
            logits, hidden = self.draft.step(embeds, hidden,
                                             torch.tensor([[n - 1 + k]], device=dev), cache,
                                             anchors_T=anchor)
            token, q = pick(logits[0, -1])
            tokens.append(token)
            dists.append(q)
        return tokens, dists


class OracleProposer:
    """Proposes the target's own greedy continuation: every proposal is accepted."""

    def __init__(self, prompt: list[int], reference_output: list[int]):
        self.full = list(prompt) + list(reference_output)

    def propose(self, ids: list[int], aux_NK: torch.Tensor, steps: int) -> list[int]:
        start = len(ids)
        return self.full[start : start + steps] or [0]
