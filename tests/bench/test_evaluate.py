"""The offline evaluator: oracle and hand-computed acceptance, lossless greedy output, and
speculative sampling that keeps the target's output distribution."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from eagle3.bench.evaluate import (
    Eagle3Proposer,
    OracleProposer,
    TargetRunner,
    autoregressive_decode,
    greedy_decode,
    speculative_chain,
    speculative_decode,
    verify_sampled,
)
from eagle3.core.target import load_embedding
from eagle3.draft.model import DraftConfig, Eagle3Draft

PROMPTS = [[543, 82, 88, 431, 68, 76, 546, 56], [544, 84, 82, 263, 546, 100, 101, 102, 540, 545]]


class BigramTarget:
    """A scripted target: the logits at a position depend only on the token there.

    It keeps the ids it has processed, so a test can check the decoder crops its cache right;
    its aux state of a position is the token id itself (one column).
    """

    def __init__(self, log_probs_VV: torch.Tensor):
        self.log_probs = log_probs_VV
        self.processed: list[int] = []

    def forward(self, ids):
        self.processed += ids
        return self.log_probs[ids], torch.tensor(ids, dtype=torch.float32)[:, None]

    def crop(self, length):
        del self.processed[length:]


def _successor_target(vocab: int) -> BigramTarget:
    """Greedy continuation of token t is (t + 1) % vocab."""
    logits = torch.full((vocab, vocab), -5.0)
    logits[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 5.0
    return BigramTarget(logits)


class ScriptedProposer:
    """Proposes fixed lists, round by round; checks it gets the aux states of ids[:-1]."""

    def __init__(self, rounds: list[list[int]]):
        self.rounds = list(rounds)

    def propose(self, ids, aux, steps):
        assert aux[:, 0].tolist() == ids[:-1]
        return self.rounds.pop(0)


def test_speculative_chain_matches_hand_computed_accept_lengths_when_scripted():
    # prompt [0]; the target continues 1, 2, 3, ... Round 1 drafts [2, 3, 9] after [0, 1]:
    # 2 and 3 accepted, 9 rejected, bonus 4 -> 3 committed. Round 2 drafts [7, 6, 5] after 4:
    # 7 rejected at once, bonus 5 -> 1. Round 3 drafts [6, 7, 8]: all accepted, bonus 9 -> 4.
    target = _successor_target(10)
    proposer = ScriptedProposer([[2, 3, 9], [7, 6, 5], [6, 7, 8]])
    res = speculative_chain(target, proposer, [0], max_new=9, eos=set(), steps=3)
    assert res.output_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert res.accept_lengths == [3, 1, 4]
    assert res.acceptance_length == pytest.approx(8 / 3)
    assert target.processed == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # cache cut back after rejections
    assert proposer.rounds == []


def test_speculative_chain_stops_at_eos_when_it_is_accepted_mid_round():
    target = _successor_target(10)
    res = speculative_chain(target, ScriptedProposer([[2, 3, 4]]), [0], max_new=50, eos={3},
                            steps=3)
    assert res.output_ids == [1, 2, 3]
    assert res.accept_lengths == [4]


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_oracle_draft_accepts_every_token_when_it_proposes_greedy_output(target_model, steps):
    max_new = 4 * (steps + 1) + 1  # the prefill token + 4 full verify passes
    for prompt in PROMPTS:
        ref = greedy_decode(target_model, prompt, max_new, eos=set())
        res = speculative_decode(target_model, OracleProposer(prompt, ref.output_ids), prompt,
                                 max_new, set(), steps, [2, 4, 5])
        assert res.output_ids == ref.output_ids
        assert res.accept_lengths == [steps + 1] * 4
        assert res.acceptance_length == steps + 1


def _tiny_draft(target_model, draft_vocab: int | None = None) -> Eagle3Draft:
    vocab = target_model.config.vocab_size
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      intermediate_size=128, vocab_size=vocab,
                      draft_vocab_size=draft_vocab or vocab, target_hidden_size=64,
                      capture_layers=[2, 4, 5])
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg).eval()
    if draft_vocab:  # every third target id
        hot = torch.arange(draft_vocab) * 3
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        draft.set_vocab_mapping(hot - torch.arange(draft_vocab), t2d)
    return draft


def test_untrained_draft_is_near_one_and_lossless(tiny_target_dir, target_model):
    draft = _tiny_draft(target_model)
    embed = load_embedding(tiny_target_dir)
    lengths = []
    for prompt in PROMPTS:
        ref = greedy_decode(target_model, prompt, 30, eos=set())
        res = speculative_decode(target_model, Eagle3Proposer(draft, embed), prompt, 30, set(),
                                 3, [2, 4, 5])
        assert res.output_ids == ref.output_ids
        lengths += res.accept_lengths
    assert sum(lengths) / len(lengths) < 1.3


def test_wrong_proposals_still_give_greedy_output(target_model):
    class Wrong:
        def propose(self, ids, aux, steps):
            return [0] * steps

    prompt = PROMPTS[0]
    ref = greedy_decode(target_model, prompt, 12, eos=set())
    res = speculative_decode(target_model, Wrong(), prompt, 12, set(), 3, [2, 4, 5])
    assert res.output_ids == ref.output_ids
    assert set(res.accept_lengths) <= {1, 2}  # a 0 could match by chance, rarely


# ---------------------------------------------------------------- speculative sampling


def test_verify_sampled_accepts_then_draws_from_the_residual_when_hand_computed():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # draft 1: p = q = 1, accepted; draft 0: p(0) = 0, rejected; residual max(0, p - q) = e_2.
    assert verify_sampled(p, q, [1, 0], torch.Generator().manual_seed(0)) == (1, 2)


def test_verify_sampled_accepts_with_probability_p_over_q_when_draft_overshoots():
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.6, 0.4]])
    gen = torch.Generator().manual_seed(0)
    outcomes = Counter(verify_sampled(p, q, [0], gen) for _ in range(6000))
    assert set(outcomes) <= {(1, 0), (1, 1), (0, 1)}  # a rejection always yields token 1
    accepted = (outcomes[(1, 0)] + outcomes[(1, 1)]) / 6000
    assert accepted == pytest.approx(0.2 / 0.6, abs=0.025)  # 4+ sigma


P_BIGRAM = torch.tensor([[0.50, 0.20, 0.20, 0.10], [0.10, 0.60, 0.20, 0.10],
                         [0.25, 0.25, 0.25, 0.25], [0.30, 0.10, 0.10, 0.50]])
Q_BIGRAM = torch.tensor([[0.10, 0.60, 0.20, 0.10], [0.40, 0.30, 0.20, 0.10],
                         [0.70, 0.10, 0.10, 0.10], [0.25, 0.25, 0.25, 0.25]])


class BigramDraft:
    """Samples each draft token from Q[previous token]; may report a different q (a bug)."""

    def __init__(self, sample_from: torch.Tensor, report: torch.Tensor):
        self.sample_from, self.report = sample_from, report

    def propose_sampled(self, ids, aux, steps, temperature, generator):
        tokens, dists, last = [], [], ids[-1]
        for _ in range(steps):
            last = int(torch.multinomial(self.sample_from[last], 1, generator=generator))
            tokens.append(last)
            dists.append(self.report[tokens[-2] if len(tokens) > 1 else ids[-1]])
        return tokens, torch.stack(dists)


def _chi_square_vs_target(draft: BigramDraft, samples: int, steps: int = 2,
                          length: int = 3) -> float:
    """Chi-square of `samples` speculative outputs of `length` tokens against the exact target
    distribution P[0][a] * P[a][b] * P[b][c]."""
    gen = torch.Generator().manual_seed(1234)
    counts = Counter()
    for _ in range(samples):
        res = speculative_chain(BigramTarget(P_BIGRAM.log()), draft, [0], length, set(), steps,
                                temperature=1.0, generator=gen)
        counts[tuple(res.output_ids)] += 1
    chi2 = 0.0
    for seq in itertools.product(range(4), repeat=length):
        p = math.prod(float(P_BIGRAM[a, b]) for a, b in zip((0,) + seq, seq))
        chi2 += (counts[seq] - samples * p) ** 2 / (samples * p)
    return chi2


def _chi_square_critical(dof: int, z: float = 3.72) -> float:
    """Wilson-Hilferty upper quantile (z = 3.72: p = 1e-4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_speculative_sampling_keeps_the_target_distribution_when_draft_differs():
    chi2 = _chi_square_vs_target(BigramDraft(Q_BIGRAM, Q_BIGRAM), samples=8000)
    assert chi2 < _chi_square_critical(63), chi2


def test_chi_square_check_detects_a_sampler_that_misreports_q():
    # The same sampler told the wrong q (uniform) no longer reproduces the target: the check
    # above has the power to catch a wrong acceptance rule.
    chi2 = _chi_square_vs_target(BigramDraft(Q_BIGRAM, torch.full((4, 4), 0.25)), samples=4000)
    assert chi2 > 3 * _chi_square_critical(63), chi2


def test_autoregressive_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(7)
    counts = Counter(autoregressive_decode(BigramTarget(P_BIGRAM.log()), [3], 1, set(), 1.0,
                                           gen).output_ids[0] for _ in range(4000))
    for t in range(4):
        assert counts[t] / 4000 == pytest.approx(float(P_BIGRAM[3, t]), abs=0.035)


def test_eagle3_proposer_samples_inside_the_draft_vocab_with_normalized_q(tiny_target_dir,
                                                                          target_model):
    draft = _tiny_draft(target_model, draft_vocab=100)
    proposer = Eagle3Proposer(draft, load_embedding(tiny_target_dir))
    gen = torch.Generator().manual_seed(0)
    res = speculative_decode(target_model, proposer, PROMPTS[0], 20, set(), 3, [2, 4, 5],
                             temperature=1.0, generator=gen)
    assert len(res.output_ids) == 20 and all(1 <= a <= 4 for a in res.accept_lengths)
    ids = PROMPTS[1]
    _, aux = TargetRunner(target_model, [2, 4, 5]).forward(ids[:-1])
    tokens, q = proposer.propose_sampled(ids, aux, 3, 1.0, gen)
    assert q.shape == (3, target_model.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
    assert q[:, ~draft.t2d].abs().sum() == 0  # no mass outside the draft vocabulary
    assert all(t % 3 == 0 and q[i, t] > 0 for i, t in enumerate(tokens))
