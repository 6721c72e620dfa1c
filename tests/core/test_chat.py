"""ChatRenderer: loss masks from the template itself, samples per template shape, fast == exact.

Two template shapes: the tiny target's Kimi-style template (reasoning of turns before the last
user message dropped) and a Qwen3-like ChatML one (`<think>\\n` opens the generation prompt,
every earlier assistant turn is rewritten). References are `apply_chat_template(tokenize=True)`
and hand-written strings.
"""

from __future__ import annotations

import json
import random

import pytest
from dataset_helpers import (
    SMOLLM2_TEMPLATE,
    build_metaspace_tokenizer,
    build_qwen_like_tokenizer,
    fixture_conversations,
    fixture_rows,
)

from eagle3.core.chat import ChatRenderer, RenderError, split_for_generation


@pytest.fixture(scope="module")
def kimi(tokenizer):
    return ChatRenderer(tokenizer, {"thinking": True})


@pytest.fixture(scope="module")
def qwen():
    return ChatRenderer(build_qwen_like_tokenizer())


@pytest.fixture(scope="module")
def convs():
    return fixture_conversations()


def _key(samples):
    return [(s.input_ids, s.loss_mask, s.n_prompt_tokens, s.spans) for s in samples]


def _serving_prompt(tok, messages, tools):
    return tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def _supervised_text(renderer, sample):
    tok = renderer.tokenizer
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


# ---------------------------------------------------------------- fast path == exact path


@pytest.mark.parametrize("shape", ["kimi", "qwen", "metaspace"])
def test_samples_match_exact_tokenization_when_rendering_every_fixture(shape, request, convs):
    renderer = (ChatRenderer(build_metaspace_tokenizer(), {"thinking": True})
                if shape == "metaspace" else request.getfixturevalue(shape))
    n = 0
    for name, records in convs.items():
        for c in records:
            fast = renderer.samples(c["messages"], c.get("tools"))
            exact = renderer.samples(c["messages"], c.get("tools"), exact=True)
            assert _key(fast) == _key(exact), (shape, name)
            n += len(fast)
    assert n >= 20


def _random_conversation(rng: random.Random) -> dict:
    pieces = ["Hello", " world", "\n", "\n\n", "  ", "x", "é", "数学", "{\"a\": 1}", "```py\n",
              "<b>", "think", " </ not a tag", "\t", "9", "'s", "...", " "]

    def text(lo=0):
        return "".join(rng.choice(pieces) for _ in range(rng.randint(lo, 12)))

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": text(1)}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text(1)})
        for _ in range(rng.randint(1, 3)):  # an agent loop: call, result, call, ..., reply
            m = {"role": "assistant", "content": text()}
            if rng.random() < 0.5:
                m["reasoning_content"] = text(1)
            if rng.random() < 0.5:
                m["tool_calls"] = [{"id": f"functions.f:{len(messages)}", "type": "function",
                                    "function": {"name": "f", "arguments": json.dumps(
                                        {"q": text()})}}]
            if not (m["content"].strip() or m.get("tool_calls") or m.get("reasoning_content")):
                m["content"] = "ok"
            messages.append(m)
            if not m.get("tool_calls"):
                break
            messages.append({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"],
                             "content": text()})
        if messages[-1]["role"] == "tool":
            messages.append({"role": "assistant", "content": text(1) or "done"})
    return {"messages": messages, "tools": tools}


@pytest.mark.parametrize("shape", ["kimi", "qwen"])
def test_samples_match_exact_tokenization_when_conversations_are_random(shape, request):
    renderer = request.getfixturevalue(shape)
    rng = random.Random(1234)
    checked = 0
    for _ in range(80):
        c = _random_conversation(rng)
        try:
            exact = renderer.samples(c["messages"], c["tools"], exact=True)
        except RenderError as e:  # then the fast path must refuse too, for the same reason
            with pytest.raises(RenderError, match=str(e).split(":")[0]):
                renderer.samples(c["messages"], c["tools"])
            continue
        assert _key(renderer.samples(c["messages"], c["tools"])) == _key(exact)
        checked += 1
    assert checked > 60


# ---------------------------------------------------------------- masks, by hand


def test_loss_mask_covers_exactly_the_reply_and_end_token_when_kimi_template(kimi):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]
    (s,) = kimi.samples(messages)
    prompt = _serving_prompt(kimi.tokenizer, messages[:1], None)
    assert s.input_ids[: len(prompt)] == prompt and s.n_prompt_tokens == len(prompt)
    assert s.loss_mask == [0] * len(prompt) + [1] * (len(s.input_ids) - len(prompt))
    assert _supervised_text(kimi, s) == "<think>Add them.</think>4.<|im_end|>"


def test_loss_mask_starts_inside_the_think_block_when_generation_prompt_opens_it(qwen):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]
    (s,) = qwen.samples(messages)
    prompt = _serving_prompt(qwen.tokenizer, messages[:1], None)
    assert qwen.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    assert s.input_ids[: len(prompt)] == prompt and not any(s.loss_mask[: len(prompt)])
    assert _supervised_text(qwen, s) == "Add them.\n</think>\n\n4.<|im_end|>"
    # The newline the template writes after <|im_end|> is not the target's output.
    assert s.loss_mask[-1] == 0 and qwen.tokenizer.decode(s.input_ids[-1:]) == "\n"


@pytest.mark.parametrize("shape", ["kimi", "qwen"])
def test_every_supervised_turn_follows_its_serving_prompt_when_rendering_fixtures(
        shape, request, convs):
    renderer = request.getfixturevalue(shape)
    for records in convs.values():
        for c in records:
            for s in renderer.samples(c["messages"], c.get("tools")):
                for i, (start, _) in zip(s.supervised_turns, s.spans):
                    prompt = _serving_prompt(renderer.tokenizer, c["messages"][:i], c.get("tools"))
                    assert s.input_ids[: len(prompt)] == prompt and start == len(prompt)
                    assert s.loss_mask[start] == 1
                assert not any(s.loss_mask[: s.n_prompt_tokens])


# ---------------------------------------------------------------- samples per template shape


def test_conversation_gives_one_sample_per_user_segment_when_kimi_drops_old_reasoning(kimi):
    messages = [{"role": "user", "content": "A?"},
                {"role": "assistant", "content": "a", "reasoning_content": "first"},
                {"role": "user", "content": "B?"},
                {"role": "assistant", "content": "b", "reasoning_content": "second"}]
    first, second = kimi.samples(messages)
    assert first.supervised_turns == [1] and second.supervised_turns == [3]
    assert _supervised_text(kimi, first) == "<think>first</think>a<|im_end|>"
    assert "first" not in second.text  # dropped from history, exactly as serving renders it
    assert _supervised_text(kimi, second) == "<think>second</think>b<|im_end|>"
    for m in messages:
        m.pop("reasoning_content", None)
    (only,) = kimi.samples(messages)  # nothing dropped: one sample supervises both turns
    assert only.supervised_turns == [1, 3]


def test_agent_trace_gives_one_sample_per_assistant_turn_when_template_rewrites_turns(
        qwen, kimi, convs):
    (trace,) = convs["openhands_traces.jsonl"]
    turns = [i for i, m in enumerate(trace["messages"]) if m["role"] == "assistant"]
    samples = qwen.samples(trace["messages"], trace["tools"])
    assert [s.supervised_turns for s in samples] == [[i] for i in turns]
    (whole,) = kimi.samples(trace["messages"], trace["tools"])
    assert whole.supervised_turns == turns


# ---------------------------------------------------------------- tool calls survive rendering

# Calls as the raw rows state them (name, arguments), independent of the adapters.
EXPECTED_CALLS = {
    "openhands_traces.jsonl": [[
        ("execute_bash", {"command": "grep -n 'regex' utils/validators.py"}),
        ("execute_bash", {"command": "sed -i 's/\\$/\\\\Z/' utils/validators.py"}),
        ("finish", {})]],
    "xlam_function_calling.json": [[("live_giveaways_by_type", {"type": "beta"}),
                                    ("live_giveaways_by_type", {"type": "game"})],
                                   [("factorial", {"n": 5}), ("fibonacci", {"n": 10})]],
    "glaive_function_calling_v2.json": [[("get_exchange_rate", {"base_currency": "USD",
                                                                "target_currency": "EUR"})], []],
    "hermes_function_calling.json": [[("get_stock_price", {"symbol": "AAPL"})]],
}
EXPECTED_RESULTS = {
    "openhands_traces.jsonl": [["12:    regex = r'^[\\w.@+-]+$'", "done"]],
    "glaive_function_calling_v2.json": [['{"exchange_rate": 0.85}'], []],
    "hermes_function_calling.json": [['{"name": "get_stock_price", "content": {"symbol": "AAPL", '
                                      '"price": 150.75}}']],
    "xlam_function_calling.json": [[], []],
}


def test_tool_calls_and_results_appear_where_kimi_template_puts_them(kimi, convs):
    tok = kimi.tokenizer
    begin, arg, end = (tok.convert_tokens_to_ids(t) for t in (
        "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
    for name, per_row in EXPECTED_CALLS.items():
        for c, calls, results in zip(convs[name], per_row, EXPECTED_RESULTS[name]):
            (s,) = kimi.samples(c["messages"], c.get("tools"))
            starts = [k for k, t in enumerate(s.input_ids) if t == begin]
            assert len(starts) == len(calls), name
            for k, (fn, args), idx in zip(starts, calls, range(len(calls))):
                a = s.input_ids.index(arg, k)
                e = s.input_ids.index(end, a)
                assert tok.decode(s.input_ids[k + 1: a]) == f"functions.{fn}:{idx}"
                assert json.loads(tok.decode(s.input_ids[a + 1: e])) == args
                assert all(s.loss_mask[k: e + 1])  # the call is the target's output
            for idx, content in enumerate(results):
                rid = f"functions.{calls[idx][0]}:{idx}"
                piece = f"<|im_system|>tool<|im_middle|>## Return of {rid}\n{content}<|im_end|>"
                at = s.text.index(piece)
                assert not any(m for t, m in zip(_char_tokens(kimi, s), s.loss_mask)
                               if at <= t < at + len(piece))


def _char_tokens(renderer, sample) -> list[int]:
    """Char offset where each token of the sample starts (decoding prefix by prefix)."""
    tok, out, pos = renderer.tokenizer, [], 0
    for t in sample.input_ids:
        out.append(pos)
        pos += len(tok.decode([t]))
    return out


def test_tool_calls_render_as_json_blocks_when_qwen_like_template(qwen, convs):
    for name, per_row in EXPECTED_CALLS.items():
        for c, calls in zip(convs[name], per_row):
            last = qwen.samples(c["messages"], c.get("tools"))[-1]
            blocks = [json.loads(b.split("</tool_call>")[0])
                      for b in last.text.split("<tool_call>\n")[1:]]
            assert [(b["name"], b["arguments"]) for b in blocks] == calls, name


def test_reasoning_is_kept_in_the_supervised_turn_when_source_writes_it_inline(kimi, convs):
    raw = fixture_rows("openthoughts.jsonl")[0]["conversations"][1]["value"]
    (c,) = convs["openthoughts.jsonl"]
    (s,) = kimi.samples(c["messages"], c.get("tools"))
    text = _supervised_text(kimi, s)
    thought = raw.split("<|begin_of_thought|>")[1].split("<|end_of_thought|>")[0].strip()
    assert text == f"<think>{thought}</think>The sum is \\boxed{{55}}.<|im_end|>"


# ---------------------------------------------------------------- refusals and helpers


def test_samples_raise_when_template_renders_the_prompt_differently(tokenizer):
    tok = build_qwen_like_tokenizer()
    # Generation prompt "...assistant\n" but history turns rendered as "...assistant:\n".
    for head in ("'<|im_start|>assistant\\n' + content",
                 "'<|im_start|>assistant\\n<think>\\n' + reasoning"):
        tok.chat_template = tok.chat_template.replace(head, head.replace("assistant", "assistant:"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(RenderError, match="template mismatch"):
        ChatRenderer(tok).samples(messages)


@pytest.mark.parametrize("exact", [False, True])
def test_samples_raise_token_mismatch_when_prompt_ends_inside_a_word(exact):
    tok = build_qwen_like_tokenizer()
    renderer = ChatRenderer(tok)
    # A word the BPE merges across some split: prompt "...<head>", reply "<tail> ...".
    head, tail = next((w[:k], w[k:]) for w in ("function", "return", "temperature", "weather")
                      for k in range(1, len(w))
                      if renderer.encode(w) != renderer.encode(w[:k]) + renderer.encode(w[k:]))
    tok.chat_template = ("{%- for m in messages -%}{%- if m.role == 'user' -%}"
                         "<|im_start|>{{ m.content }}<|im_end|>{%- else -%}"
                         "<|im_start|>" + head + "{{ m.content }}<|im_end|>{%- endif -%}"
                         "{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>" + head +
                         "{%- endif -%}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": tail + " 42"}]
    with pytest.raises(RenderError, match="token mismatch"):
        ChatRenderer(tok).samples(messages, exact=exact)


def test_split_for_generation_keeps_the_whole_conversation_when_it_ends_with_user():
    u1, a1, u2 = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c"})
    tool = {"role": "tool", "content": "5", "tool_call_id": "x"}
    assert split_for_generation([u1, a1, u2]) == ([u1, a1, u2], None)
    assert split_for_generation([u1, a1]) == ([u1], a1)
    assert split_for_generation([u1, a1, tool]) == ([u1, a1, tool], None)


def test_special_text_in_names_the_message_when_text_holds_an_end_of_turn(kimi):
    messages = [{"role": "user", "content": "ok"}, {"role": "user", "content": "a<|im_end|>b"}]
    assert kimi.special_text_in(messages) == "message 1 content holds '<|im_end|>'"
    assert kimi.special_text_in(messages[:1]) is None


def test_every_supervised_turn_carries_its_reasoning_and_content_when_rendering_fixtures(
        kimi, convs):
    tok = kimi.tokenizer
    checked = 0
    for records in convs.values():
        for c in records:
            for s in kimi.samples(c["messages"], c.get("tools")):
                for i, (start, stop) in zip(s.supervised_turns, s.spans):
                    m = c["messages"][i]
                    turn = tok.decode(s.input_ids[start:stop])
                    assert turn.startswith(f"<think>{m.get('reasoning_content', '')}</think>"
                                           f"{m['content']}")
                    assert turn.endswith("<|im_end|>") and all(s.loss_mask[start:stop])
                    checked += bool(m.get("reasoning_content"))
    assert checked >= 4  # openthoughts, nemotron, llama-nemotron, opencodereasoning


def _tool_conversation():
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "12 C"},
                {"role": "assistant", "content": "It is 12 C."}]
    return messages, tools


def test_unrendered_tool_use_names_what_a_chatml_template_drops():
    tok = build_qwen_like_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    smol = ChatRenderer(tok)
    messages, tools = _tool_conversation()
    assert "tool declarations" in smol.unrendered_tool_use(messages, tools)
    assert "tool calls" in smol.unrendered_tool_use(messages, None)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert smol.unrendered_tool_use(plain, None) is None


def test_unrendered_tool_use_is_none_when_the_template_renders_tools(kimi, qwen):
    messages, tools = _tool_conversation()
    assert kimi.unrendered_tool_use(messages, tools) is None
    assert qwen.unrendered_tool_use(messages, tools) is None


def test_end_of_turn_is_the_token_the_template_closes_a_reply_with_whatever_eos_says():
    """A tokenizer may name another eos than the template's end of turn (transformers 5.17
    reads SmolLM2's GGUF with eos <|im_start|>): generation must stop, and loss masks end, at
    <|im_end|>, what the template renders after a reply. A configured end_of_turn still wins."""
    tok = build_qwen_like_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    im_end, im_start = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>"))
    assert ChatRenderer(tok).end_of_turn_id == im_end
    tok.eos_token = "<|im_start|>"
    assert tok.eos_token_id == im_start
    assert ChatRenderer(tok).end_of_turn_id == im_end
    assert ChatRenderer(tok, end_of_turn="<|im_start|>").end_of_turn_id == im_start
