"""Tokenized records: lengths, the serving-prompt prefix, and what is supervised."""

from __future__ import annotations

from eagle3.core.chat import split_for_generation
from eagle3.core.records import read_jsonl

ROLE_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>")


def _records(demo_run):
    return list(read_jsonl(demo_run / "01c_merged/train.jsonl")) + list(
        read_jsonl(demo_run / "01c_merged/eval.jsonl"))


def _conversations(demo_run):
    convs = {}
    for path in (demo_run / "01_prepared").glob("*/conversations.jsonl"):
        convs.update({c["id"]: c for c in read_jsonl(path)})
    return convs


def test_tokenized_lengths_agree_for_every_record(demo_run):
    for r in _records(demo_run):
        assert len(r["input_ids"]) == len(r["loss_mask"]) == r["seq_len"], r["id"]
        assert r["n_response_tokens"] == sum(r["loss_mask"])


def test_sequence_begins_with_the_serving_prompt_when_regenerated(demo_run, tokenizer):
    convs = _conversations(demo_run)
    checked = 0
    for r in _records(demo_run):
        if r["finish_reason"] == "dataset":
            continue
        conv = convs[r["id"]]
        prompt_msgs, _ = split_for_generation(conv["messages"])
        expected = tokenizer.apply_chat_template(prompt_msgs, tools=conv.get("tools"),
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        assert r["input_ids"][: len(expected)] == expected, r["id"]
        assert r["n_prompt_tokens"] == len(expected)
        assert not any(r["loss_mask"][: len(expected)])
        assert all(r["loss_mask"][len(expected):])
        checked += 1
    assert checked > 10


def test_kept_records_supervise_only_assistant_content_and_its_end_token(demo_run, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    role_ids = {tokenizer.convert_tokens_to_ids(t) for t in ROLE_TOKENS}
    convs = _conversations(demo_run)
    checked = 0
    for r in _records(demo_run):
        if r["finish_reason"] != "dataset":
            continue
        ids, mask = r["input_ids"], r["loss_mask"]
        conv = convs[r["id"].split("#")[0]]
        # The serving prompt of the first supervised turn is a prefix and unsupervised.
        first = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
        prompt = tokenizer.apply_chat_template(conv["messages"][:first], tools=conv.get("tools"),
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        # Role headers are never supervised.
        assert all(m == 0 for t, m in zip(ids, mask) if t in role_ids), r["id"]
        # Each supervised span ends with <|im_end|>; every <|im_end|> closing an assistant
        # turn is supervised, those closing user/tool/system turns are not.
        spans, start = [], None
        for i, m in enumerate(mask + [0]):
            if m and start is None:
                start = i
            if not m and start is not None:
                spans.append((start, i))
                start = None
        assert spans
        for s, e in spans:
            assert ids[e - 1] == im_end, r["id"]
            assert im_end not in ids[s : e - 1]
        n_assistant = sum(1 for m in conv["messages"] if m["role"] == "assistant")
        supervised_ends = sum(1 for t, m in zip(ids, mask) if t == im_end and m)
        assert supervised_ends == len(spans) <= n_assistant
        assert sum(1 for t, m in zip(ids, mask) if t == im_end and not m) >= 2  # system, user
        checked += 1
    assert checked > 10


def test_n_response_tokens_counts_supervised_tokens_when_a_record_has_two_turns():
    from eagle3.core.records import TokenizedRecord

    # prompt 3 tokens, reply 2 (supervised), user turn 2, reply 3 (supervised)
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    rec = TokenizedRecord("d/0", "d", list(range(10)), mask, 3, "dataset").to_json()
    assert rec["n_response_tokens"] == 5 == sum(mask)
    assert rec["n_prompt_tokens"] + rec["n_response_tokens"] == 8 != rec["seq_len"] == 10
