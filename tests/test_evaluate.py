"""The offline evaluator: an oracle draft reaches steps + 1, output is lossless."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft_model import DraftConfig, Eagle3Draft
from eagle3.evaluate import (Eagle3Proposer, OracleProposer, greedy_decode,
                             speculative_decode)
from eagle3.target import load_embedding

PROMPTS = [[543, 82, 88, 431, 68, 76, 546, 56], [544, 84, 82, 263, 546, 100, 101, 102, 540, 545]]


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


def test_untrained_draft_is_near_one_and_lossless(tiny_target_dir, target_model):
    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      intermediate_size=128, vocab_size=target_model.config.vocab_size,
                      draft_vocab_size=target_model.config.vocab_size, target_hidden_size=64,
                      capture_layers=[2, 4, 5])
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg).eval()
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
