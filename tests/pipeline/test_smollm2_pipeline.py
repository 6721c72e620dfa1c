"""The real-model path: SmolLM2-135M-Instruct through 01 -> 01b -> merge -> 02b -> 03 -> 04 -> 05
on a few records (tests/smollm2_helpers.py), checked stage by stage against the model itself."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eagle3.core.records import read_jsonl


def test_01b_keeps_the_replies_smollm2_itself_writes_greedily(smollm2_run, smollm2_target_dir):
    from transformers import AutoModelForCausalLM

    rows = list(read_jsonl(next((smollm2_run / "01b_generated").glob("*/tokenized.jsonl"))))
    assert len(rows) == 24 and all(r["finish_reason"] in ("stop", "length") for r in rows)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target_dir, dtype=torch.float32).eval()
    r = rows[0]
    prompt = r["input_ids"][: r["n_prompt_tokens"]]
    reply = r["input_ids"][r["n_prompt_tokens"]:]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply), do_sample=False)
    assert out[0, len(prompt):].tolist() == reply  # the target's own greedy tokens
    assert r["loss_mask"][r["n_prompt_tokens"]:] == [1] * len(reply)


def test_02b_captures_smollm2_layers_2_15_27_equal_to_a_transformers_forward(
        smollm2_run, smollm2_target_dir):
    from transformers import AutoModelForCausalLM

    manifest = json.loads((smollm2_run / "02b_hidden_states/manifest.json").read_text())
    assert manifest["capture_layers"] == [2, 15, 27]
    path = next((smollm2_run / "02b_hidden_states/train").glob("shard_*/data_*.pt"))
    rec = torch.load(path, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(rec["input_ids"][None], output_hidden_states=True).hidden_states
    want = [hs[2][0], hs[15][0], hs[27][0], hs[-1][0]]  # hs[-1]: after the final norm
    for got, ref in zip(rec["hidden_states"], want):
        assert torch.allclose(got.float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().mean()))


def test_04_trains_a_draft_of_smollm2_shape_that_05_runs_losslessly(smollm2_run):
    cfg = json.loads((smollm2_run / "04_train/final/config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (
        576, 9, 64, 1536, 49152, 1024)
    metrics = list(read_jsonl(smollm2_run / "04_train/metrics.jsonl"))
    evals = [m for m in metrics if "eval_loss" in m]
    assert evals[-1]["eval_loss"][0] < evals[0]["eval_loss"][0] - 1.0  # it learned
    results = json.loads((smollm2_run / "05_benchmark/results.json").read_text())
    r = results["prompt_sets"]["chat"]["steps"]["3"]
    assert r["lossless_mismatches"] == 0
    assert 1.0 <= r["acceptance_length"] <= 4.0 and 0.0 <= r["loop_share"] <= 1.0
    buckets = r["acceptance_by_context"]  # 05 ran with --context-bucket-tokens 64
    assert len(buckets) >= 2 and all(b["to"] - b["from"] == 64 for b in buckets)
    assert sum(b["verify_passes"] for b in buckets) == r["verify_passes"]
    total = sum(b["acceptance_length"] * b["verify_passes"] for b in buckets)
    assert total / r["verify_passes"] == pytest.approx(r["acceptance_length"])
    from eagle3.core.run_summary import summary_table

    # the run's closing table: 04's estimate for the untrained draft beside the trained one's
    assert re.search(r"the untrained draft \(step 0\): 1\.0\d\d, loop-free",
                     summary_table(smollm2_run))
    report = (smollm2_run / "05_benchmark/report.md").read_text()
    assert "Acceptance by context position" in report
