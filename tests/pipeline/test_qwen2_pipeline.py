"""The tiny qwen2 target (Qwen2.5-Coder's layout: q/k/v biases, grouped KV heads, an untied head,
rope base 1e6) through 01 -> 01b -> merge -> 02b -> 03 -> 04 -> 05 on a few records
(tests/pipeline_helpers.py), checked stage by stage against the model itself, as
tests/pipeline/test_smollm2_pipeline.py checks SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.core.records import read_jsonl


@pytest.fixture(scope="module")
def qwen2_model(qwen2_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_target_dir, dtype=torch.float32).eval()


def _hidden_states(model, ids: torch.Tensor) -> tuple:
    with torch.no_grad():
        return model(ids[None], output_hidden_states=True).hidden_states


def test_the_tiny_qwen2_target_has_biases_and_an_untied_head_that_change_its_output(
        qwen2_target_dir, qwen2_model):
    """What makes the checks below about Qwen2's layout: zeroing the q/k/v biases, or reading
    the embedding as the head, changes the target's greedy tokens."""
    from eagle3.core.target import load_embedding, load_lm_head, ties_embeddings

    assert ties_embeddings(qwen2_target_dir) is False
    head, embed = load_lm_head(qwen2_target_dir), load_embedding(qwen2_target_dir)
    assert torch.equal(head, qwen2_model.lm_head.weight) and not torch.allclose(head, embed)
    ids = torch.arange(3, 200, 5)
    final = _hidden_states(qwen2_model, ids)[-1][0]
    assert ((final @ head.T).argmax(-1) != (final @ embed.T).argmax(-1)).float().mean() > 0.5
    unbiased = type(qwen2_model)(qwen2_model.config).eval()
    unbiased.load_state_dict(qwen2_model.state_dict())
    with torch.no_grad():
        for layer in unbiased.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert proj.bias.abs().max() > 0.01
                proj.bias.zero_()
        changed = (unbiased(ids[None]).logits - qwen2_model(ids[None]).logits).abs().max()
    assert changed > 0.05


def test_01b_keeps_the_replies_the_tiny_qwen2_target_writes_greedily(qwen2_run, qwen2_model):
    rows = list(read_jsonl(next((qwen2_run / "01b_generated").glob("*/tokenized.jsonl"))))
    assert len(rows) == 24 and all(r["finish_reason"] in ("stop", "length") for r in rows)
    for r in rows[:6]:  # the longest prompts first (01b's order) and later ones
        prompt = r["input_ids"][: r["n_prompt_tokens"]]
        reply = r["input_ids"][r["n_prompt_tokens"]:]
        with torch.no_grad():
            out = qwen2_model.generate(torch.tensor([prompt]), max_new_tokens=len(reply),
                                       do_sample=False)
        assert out[0, len(prompt):].tolist() == reply, r["id"]  # its own greedy tokens
        assert r["loss_mask"][r["n_prompt_tokens"]:] == [1] * len(reply)


def test_02b_captures_layers_2_4_5_equal_to_a_transformers_forward_through_the_untied_head(
        qwen2_run, qwen2_target_dir, qwen2_model):
    from eagle3.core.target import default_capture_layers, load_lm_head

    manifest = json.loads((qwen2_run / "02b_hidden_states/manifest.json").read_text())
    assert manifest["capture_layers"] == default_capture_layers(8) == [2, 4, 5]
    head = load_lm_head(qwen2_target_dir)
    paths = sorted((qwen2_run / "02b_hidden_states/train").glob("shard_*/data_*.pt"))
    assert len(paths) >= 10
    for path in paths[:4]:
        rec = torch.load(path, weights_only=True)
        hs = _hidden_states(qwen2_model, rec["input_ids"])
        want = [hs[2][0], hs[4][0], hs[5][0], hs[-1][0]]  # hs[-1]: after the final norm
        for got, ref in zip(rec["hidden_states"], want, strict=True):
            assert torch.allclose(got.float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().mean()))
        # the stored final state through the untied head predicts the reply 01b kept
        mask = rec["loss_mask"].bool()
        predicted = (rec["hidden_states"][3].float() @ head.T).argmax(-1)
        agree = (predicted[:-1] == rec["input_ids"][1:])[mask[1:]].float().mean()
        assert agree > 0.9, path


def test_04_trains_a_draft_of_the_targets_shape_that_05_runs_losslessly(qwen2_run,
                                                                         qwen2_target_dir):
    target = json.loads((qwen2_target_dir / "config.json").read_text())
    cfg = json.loads((qwen2_run / "04_train/final/config.json").read_text())
    # no preset: the target's heads and MLP, head_dim = hidden / heads (eagle3/train/config.py)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"],
            cfg["draft_vocab_size"], cfg["rope_theta"]) == (
        64, 4, 4, 16, 128, target["vocab_size"], 256, 1000000.0)
    assert cfg["eagle_config"]["trained_capture_layers"] == [2, 4, 5]
    evals = [m for m in read_jsonl(qwen2_run / "04_train/metrics.jsonl") if "eval_loss" in m]
    assert evals[-1]["eval_loss"][0] < evals[0]["eval_loss"][0] - 0.5  # it learned
    assert evals[0]["eval_sim_accept"] == 1.0 and evals[-1]["eval_sim_accept"] > 2.0
    # 04 scores the target's argmax with the head it loaded: the untied lm_head reproduces the
    # greedy replies 01b kept (measured 99%); the embedding read as the head would give 20%
    assert evals[-1]["eval_greedy_share"] > 0.95
    results = json.loads((qwen2_run / "05_benchmark/results.json").read_text())
    r = results["prompt_sets"]["chat"]["steps"]["3"]
    assert r["lossless_mismatches"] == 0
    # the random target's greedy replies loop: acceptance is reported, it measures no quality
    assert 1.0 <= r["acceptance_length"] <= 4.0 and 0.0 <= r["loop_share"] <= 1.0
    buckets = r["acceptance_by_context"]  # 05 ran with --context-bucket-tokens 64
    assert len(buckets) >= 2 and all(b["to"] - b["from"] == 64 for b in buckets)
    assert sum(b["verify_passes"] for b in buckets) == r["verify_passes"]
    total = sum(b["acceptance_length"] * b["verify_passes"] for b in buckets)
    assert total / r["verify_passes"] == pytest.approx(r["acceptance_length"])
