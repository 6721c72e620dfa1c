"""The speculators-format export loads with the `speculators` package's own loader and that
package's Eagle-3 forward computes the same per-step logits as our training unroll.

Needs speculators 0.9.0, installed without its CUDA torch pins:
    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0
    pip install openai loguru typer rich click httpx psutil protobuf "dill<0.4.2" \
        "multiprocess<0.70.20" xxhash pandas
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.speculators import export_speculators, speculators_name
from eagle3.train.ttt import TTTModel, shift_rows

try:
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel
except ImportError as e:  # an optional dependency: see the module docstring
    pytest.skip(f"speculators 0.9.0 is not importable ({e}); install it as this module's "
                "docstring says to run these tests", allow_module_level=True)

VD = 24


def _draft(capture_layers, hidden: int, vocab: int) -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, vocab_size=vocab, draft_vocab_size=VD,
                      target_hidden_size=hidden, rope_theta=500.0, capture_layers=capture_layers)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    hot = torch.arange(VD) * 2 + 1
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab_mapping(hot - torch.arange(VD), t2d)
    return draft


def test_export_loads_with_the_speculators_loader_with_every_tensor(tmp_path, tiny_target_dir,
                                                                   monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = json.loads((tiny_target_dir / "config.json").read_text())
    draft = _draft([2, 4, 5], target["hidden_size"], target["vocab_size"])
    export_speculators(draft, tmp_path, str(tiny_target_dir), steps=3)
    model = SpeculatorModel.from_pretrained(str(tmp_path))
    assert isinstance(model, Eagle3DraftModel)
    cfg = model.config
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 4, 5]  # capture indices, unshifted
    assert cfg.draft_vocab_size == VD and cfg.target_hidden_size == target["hidden_size"]
    assert cfg.transformer_layer_config.vocab_size == target["vocab_size"]
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == 3
    theirs = model.state_dict()
    ours = {speculators_name(k): v for k, v in draft.state_dict().items()}
    for name, value in ours.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(theirs[name].to(expected.dtype), expected), name
    loader_only = set(theirs) - set(ours)  # taken from the verifier (the target) by vLLM
    assert loader_only <= {"embed_tokens.weight", "verifier_norm.weight",
                           "verifier_lm_head.weight"}, loader_only
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"


def test_speculators_forward_equals_our_training_unroll(tmp_path, tiny_target_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = json.loads((tiny_target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    draft = _draft([2, 4, 5], hidden, vocab)
    export_speculators(draft, tmp_path, str(tiny_target_dir), steps=3)
    model = SpeculatorModel.from_pretrained(str(tmp_path)).float().eval()
    draft = draft.to(torch.bfloat16).float()  # the exported (bf16) weights, in fp32
    embed = torch.randn(vocab, hidden)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
    T, K = 128, 3  # speculators' flex masks extend by whole 128-blocks
    ids = torch.randint(0, vocab, (1, T))
    aux = torch.randn(1, T, 3 * hidden)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=shift_rows(ids, 1),  # speculators feeds t+1 first
              document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(T)[None], ttt_steps=K)
        ours = list(TTTModel(draft, embed, torch.zeros(VD, hidden), K, 1.0).unroll(
            ids, torch.zeros(1, T, dtype=torch.int32), torch.arange(T)[None], aux))
    hook.remove()
    assert len(captured) == K
    for k in range(K):
        valid = T - 1 - k  # rows whose input token lies inside the sequence
        torch.testing.assert_close(captured[k][0, :valid], ours[k][0, :valid], rtol=1e-4,
                                   atol=1e-4, msg=f"step {k}")
