"""Stage 01b against the real SGLang server (CPU, float32) on every tiny target of
tests/sglang/conftest.py (DeepSeek-V3 of both latent widths, Llama, Qwen2): every record, of two
datasets generated through one pool of requests, is the prompt our template rendered followed
by exactly the tokens transformers' greedy decoding produces, the end-of-turn token included
when it stopped."""

from __future__ import annotations

import importlib
import json

import torch

from eagle3.core.chat import split_for_generation
from eagle3.core.records import read_jsonl
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage

MAX_NEW = 16


def test_generate_sglang_records_equal_transformers_greedy_tokens(sglang_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sets = {"ds": synthetic_conversations(4, "ds"), "more": synthetic_conversations(3, "more")}
    write_prepared_stage(tmp_path, sets, max_seq_len=4096)
    rc = importlib.import_module("01b_generate_synthetic").main([
        "--workdir", str(tmp_path), "--target", str(sglang_server.target), "--backend",
        "sglang", "--server-url", sglang_server.url, "--max-new-tokens", str(MAX_NEW),
        "--log-level", "WARNING"])
    assert rc == 0
    records = {r["id"]: r for name in sets
               for r in read_jsonl(tmp_path / "01b_generated" / name / "tokenized.jsonl")}
    convs = [c for name in sets for c in sets[name]]
    assert set(records) == {c["id"] for c in convs}
    tokenizer = AutoTokenizer.from_pretrained(sglang_server.target)
    model = AutoModelForCausalLM.from_pretrained(sglang_server.target,
                                                 dtype=torch.float32).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for conv in convs:
        prompt_msgs, _ = split_for_generation(conv["messages"])
        prompt = tokenizer.apply_chat_template(prompt_msgs, tools=conv.get("tools"),
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True, thinking=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=eos)[0, len(prompt):].tolist()
        reason = "stop" if out[-1:] == [eos] else "length"
        record = records[conv["id"]]
        assert record["input_ids"] == prompt + out, conv["id"]
        assert record["loss_mask"] == [0] * len(prompt) + [1] * len(out)
        assert record["finish_reason"] == reason
    manifest = json.loads((tmp_path / "01b_generated/manifest.json").read_text())
    assert manifest["complete"] and manifest["outputs"]["pool"]["datasets"] == ["ds", "more"]
