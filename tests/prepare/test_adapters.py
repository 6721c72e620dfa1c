"""Adapters and clean-up: each public schema's fixture rows become the expected messages.

Expected messages are written by hand from the fixture rows in tests/fixtures/datasets/.
"""

from __future__ import annotations

import json

import pytest
from dataset_helpers import FIXTURES, fixture_rows

from eagle3.core.records import RecordError
from eagle3.prepare.conversations import stable_id, to_conversation


def conv(name: str, k: int = 0, mode: str = "keep", **kw) -> dict:
    adapter = FIXTURES[name][0]
    return to_conversation(fixture_rows(name)[k], "ds", adapter, kw.pop("id_field", None), mode,
                           **kw)


def roles(c: dict) -> list[str]:
    return [m["role"] for m in c["messages"]]


def test_every_fixture_row_converts_when_read_in_its_own_schema():
    for name, (adapter, mode) in FIXTURES.items():
        for row in fixture_rows(name):
            c = to_conversation(row, "ds", adapter, None, mode)
            assert c["messages"] and c["source"] == "ds", name


def test_sharegpt_maps_roles_and_keeps_turn_text_when_vicuna_row():
    c = conv("sharegpt_vicuna.jsonl", id_field="id")
    assert c["id"] == "ds/QWJhYvA_0"
    assert roles(c) == ["user", "assistant", "user", "assistant"]
    assert c["messages"][2]["content"] == "Now do it for a coaching business."


def test_openthoughts_system_and_thought_markers_become_system_and_reasoning():
    c = conv("openthoughts.jsonl")
    assert roles(c) == ["system", "user", "assistant"]
    reply = c["messages"][2]
    assert reply["reasoning_content"] == ("The sum 1+2+...+n is n(n+1)/2, so for n=10 it is 55.")
    assert reply["content"] == "The sum is \\boxed{55}."
    assert conv("openthoughts.jsonl", drop_system=True)["messages"][0]["role"] == "user"


def test_openai_messages_drop_empty_system_and_split_inline_think_when_nemotron_row():
    c = conv("nemotron_post_training.jsonl")
    assert roles(c) == ["user", "assistant"]  # the empty system message is dropped
    assert c["messages"][1] == {"role": "assistant", "content": "x = 4",
                                "reasoning_content": "Subtract 3: 2x = 8, so x = 4."}


def test_openai_adapter_reads_input_and_output_when_llama_nemotron_row():
    c = conv("llama_nemotron.jsonl")
    assert c["messages"] == [
        {"role": "system", "content": "detailed thinking on"},
        {"role": "user", "content": "Is 97 prime?"},
        {"role": "assistant", "content": "Yes, 97 is prime.",
         "reasoning_content": "Check divisors up to 9: 2,3,5,7 do not divide 97."}]


def test_openai_adapter_reads_parquet_rows_when_ultrachat():
    c = conv("ultrachat_200k.parquet")
    assert roles(c) == ["user", "assistant", "user", "assistant"]
    assert c["messages"][3]["content"] == "In the chloroplasts, mostly in leaf cells."


def test_agent_trace_flattens_parts_renames_calls_and_links_results_when_openhands_row():
    c = conv("openhands_traces.jsonl", id_field="id")
    assert c["id"] == "ds/django__django-11099"
    assert roles(c) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert c["messages"][0]["content"] == "You are OpenHands agent."
    calls = [tc for m in c["messages"] for tc in m.get("tool_calls", [])]
    assert [tc["id"] for tc in calls] == ["functions.execute_bash:0", "functions.execute_bash:1",
                                          "functions.finish:2"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "command": "grep -n 'regex' utils/validators.py"}
    results = [m for m in c["messages"] if m["role"] == "tool"]
    assert [(r["tool_call_id"], r["name"]) for r in results] == [
        ("functions.execute_bash:0", "execute_bash"), ("functions.execute_bash:1", "execute_bash")]
    assert results[0]["content"] == "12:    regex = r'^[\\w.@+-]+$'"
    assert [t["function"]["name"] for t in c["tools"]] == ["execute_bash", "finish"]


@pytest.mark.parametrize("name,prompt,reply", [
    ("magicoder.jsonl", "Explain list comprehensions.",
     "A list comprehension builds a list: `[x * x for x in range(5)]`."),
    ("codefeedback.jsonl", "Create a SQL query that selects all users older than 30.",
     "```sql\nSELECT * FROM users WHERE age > 30;\n```"),
])
def test_pair_adapters_make_one_user_and_one_assistant_turn(name, prompt, reply):
    rows = fixture_rows(name)
    k = next(i for i, r in enumerate(rows) if prompt in json.dumps(r))
    assert conv(name, k)["messages"] == [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": reply}]


def test_pair_adapter_splits_reasoning_when_opencodereasoning_output_thinks_inline():
    (user, reply) = conv("opencodereasoning.jsonl")["messages"]
    assert user["content"] == "Given an integer n, print the sum of its digits."
    assert reply["reasoning_content"] == "Read n as a string and add the digits."
    assert reply["content"].startswith("```python\nprint(sum(")


def test_xlam_turns_answers_into_calls_and_parameters_into_json_schema():
    c = conv("xlam_function_calling.json", 1)
    (user, reply) = c["messages"]
    assert user["content"] == "What is the factorial of 5 and the 10th Fibonacci number?"
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in reply["tool_calls"]] == [("factorial", {"n": 5}), ("fibonacci", {"n": 10})]
    fib = c["tools"][1]["function"]["parameters"]
    assert fib["properties"]["n"]["type"] == "integer"
    assert fib["properties"]["memo"]["type"] == "object"
    assert fib["required"] == ["n"]  # "Dict[int, int], optional" is not required
    giveaway = conv("xlam_function_calling.json", 0)["tools"][0]["function"]["parameters"]
    assert giveaway["required"] == [] and giveaway["properties"]["type"]["default"] == "game"


def test_glaive_parses_markers_functioncall_and_system_functions():
    c = conv("glaive_function_calling_v2.json", 0)
    assert roles(c) == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert c["messages"][0]["content"] == ("You are a helpful assistant with access to the "
                                           "following functions. Use them if required")
    call = c["messages"][2]["tool_calls"][0]["function"]
    assert call["name"] == "get_exchange_rate"
    assert json.loads(call["arguments"]) == {"base_currency": "USD", "target_currency": "EUR"}
    assert c["messages"][3]["content"] == '{"exchange_rate": 0.85}'
    assert c["messages"][4]["content"] == "The current exchange rate from USD to EUR is 0.85."
    assert c["tools"][0]["function"]["parameters"]["required"] == ["base_currency",
                                                                   "target_currency"]
    plain = conv("glaive_function_calling_v2.json", 1)
    assert "tools" not in plain and roles(plain) == ["system", "user", "assistant"]


def test_hermes_parses_literal_tool_calls_and_drops_its_tool_system_prompt():
    c = conv("hermes_function_calling.json", id_field="id")
    assert roles(c) == ["user", "assistant", "tool", "assistant"]
    call = c["messages"][1]["tool_calls"][0]
    assert call["function"]["name"] == "get_stock_price"
    assert json.loads(call["function"]["arguments"]) == {"symbol": "AAPL"}
    assert c["messages"][2]["tool_call_id"] == call["id"]
    assert json.loads(c["messages"][2]["content"])["content"]["price"] == 150.75
    assert c["tools"][0]["function"]["name"] == "get_stock_price"


def test_swe_agent_maps_ai_turns_to_assistant_when_trajectory_row():
    c = conv("swe_agent_trajectories.parquet")
    assert roles(c) == ["system", "user", "assistant", "user", "assistant"]
    assert c["messages"][0]["content"] == "SETTING: You are an autonomous programmer."
    assert c["messages"][4]["content"].startswith("DISCUSSION\nOpen it.")


def test_prompt_only_mode_drops_the_trailing_reply_and_keeps_earlier_turns():
    assert roles(conv("prompts_only.jsonl", 0, "prompt_only")) == ["user"]
    assert roles(conv("prompts_only.jsonl", 1, "prompt_only")) == ["user", "assistant", "user"]
    magic = conv("magicoder.jsonl", 0, "prompt_only")
    assert roles(magic) == ["user"]


def test_stable_id_is_a_content_hash_when_the_row_has_no_id_field():
    row = {"b": 1, "a": [1, 2]}
    assert stable_id("d", row) == stable_id("d", {"a": [1, 2], "b": 1})
    assert stable_id("d", row) != stable_id("d", {"a": [1, 2], "b": 2})
    assert stable_id("d", {"id": 7}, "id") == "d/7"


def _openai(messages, **extra) -> dict:
    return {"messages": messages, **extra}


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("row,mode,kind", [
    (_openai([A, U, A]), "keep", "bad order"),
    (_openai([U]), "keep", "no final assistant turn"),
    (_openai([U, A, {"role": "system", "content": "s"}]), "regenerate", "no prompt"),
    (_openai([{"role": "system", "content": "s"}, A]), "keep", "bad order"),
    (_openai([U, {"role": "tool", "content": "5"}, A]), "keep", "orphan tool result"),
    (_openai([U, {"role": "assistant", "content": "<think>cut off"}]), "keep", "bad reasoning"),
    (_openai([U, A], tools="not json"), "keep", "bad json field"),
    (_openai([U, A], tools=[{"type": "function", "function": {}}]), "keep", "bad tools"),
    (_openai([U, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "{"}}]}]), "keep", "bad tool call"),
    (_openai([U, {"role": "wizard", "content": "x"}]), "keep", "unknown role"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "alien", "value": "y"}]},
     "keep", "unknown role"),
])
def test_conversation_is_rejected_with_its_kind_when_row_is_broken(row, mode, kind):
    adapter = "sharegpt" if "conversations" in row else "openai"
    with pytest.raises(RecordError) as e:
        to_conversation(row, "ds", adapter, None, mode)
    assert str(e.value).split(":")[0] == kind


def test_regenerate_mode_accepts_a_conversation_that_ends_with_a_tool_result():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    c = to_conversation(_openai([U, call, {"role": "tool", "tool_call_id": "c", "content": "1"}]),
                        "ds", "openai", None, "regenerate")
    assert roles(c) == ["user", "assistant", "tool"]
    with pytest.raises(RecordError, match="no final assistant turn"):
        to_conversation(_openai([U, call, {"role": "tool", "tool_call_id": "c", "content": "1"}]),
                        "ds", "openai", None, "keep")
