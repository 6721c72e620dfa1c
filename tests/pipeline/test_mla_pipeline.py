"""04 --draft-arch mla on the demo's states, then 05's preflight and offline evaluator on it.

The MLA draft reads the same 02b states and 03 vocabulary as the demo's Llama-style draft (a
work folder linking them), so both are trained on the same data.
"""

from __future__ import annotations

import importlib
import json

import pytest

from eagle3.draft.check import check_draft_for_run
from eagle3.draft.export import load_draft
from eagle3.draft.mla import Eagle3MLADraft


@pytest.fixture(scope="module")
def mla_run(demo_run, tmp_path_factory):
    w = tmp_path_factory.mktemp("mla") / "run"
    w.mkdir()
    for name in ("01c_merged", "02b_hidden_states", "03_vocab"):
        (w / name).symlink_to(demo_run / name, target_is_directory=True)
    rc = importlib.import_module("04_train").main([
        "--workdir", str(w), "--target", str(demo_run / "target"), "--draft-arch", "mla",
        "--fc-norm", "--norm-output", "--epochs", "1", "--lr", "1e-3", "--max-seq-len", "256",
        "--num-workers", "0", "--eval-every", "100", "--log-every", "50"])
    assert rc == 0
    return w


def test_mla_draft_trains_exports_and_passes_preflight_when_the_target_uses_mla(mla_run,
                                                                                demo_run):
    final = mla_run / "04_train" / "final"
    config = json.loads((final / "config.json").read_text())
    target = json.loads((demo_run / "target" / "config.json").read_text())
    for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "num_attention_heads"):
        assert config[k] == target[k], k  # sized from the target's own MLA
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    assert not (mla_run / "04_train" / "final_speculators").exists()  # no such vLLM format
    problems, _ = check_draft_for_run(final, demo_run / "target", mla_run)
    assert [p for p in problems if p.level == "error"] == []
    assert isinstance(load_draft(final), Eagle3MLADraft)


def test_05_offline_evaluator_runs_the_mla_draft_losslessly(mla_run, demo_run):
    rc = importlib.import_module("05_benchmark").main([
        "--workdir", str(mla_run), "--target", str(demo_run / "target"), "--backend", "hf",
        "--steps", "3", "--max-new-tokens", "16", "--num-prompts", "2"])
    assert rc == 0  # 05 exits 1 when speculative output differs from plain decoding
    results = json.loads((mla_run / "05_benchmark" / "results.json").read_text())
    sets = results["prompt_sets"]
    assert all(r["steps"]["3"]["acceptance_length"] >= 1.0 for r in sets.values())
