"""From an adapter's messages to a conversation record: the clean-up every source gets.

- Ids: `<dataset>/<row id>` from the row's own id field, else a hash of the row's content, so
  re-runs give the same ids and exact duplicate rows collide (and are quarantined).
- Reasoning written inline (`<think>…</think>`, OpenThoughts' `<|begin_of_thought|>` markers)
  moves to `reasoning_content`, where chat templates expect it.
- Tool declarations become OpenAI `{"type": "function", "function": {...}}` entries; tool call
  ids become Kimi's `functions.NAME:IDX` (IDX counts calls in the conversation), arguments are
  parsed and re-serialised as JSON objects, and each tool result is linked to its call (by id,
  else to the oldest unanswered call of the turn before, as ShareGPT-style sets imply).
- Order: the first non-system turn is a user turn; kept replies need a final assistant turn;
  records to regenerate need a prompt that ends in a user or tool turn. `prompt_only` records
  drop the trailing assistant turn, so 01b regenerates from the whole record.

Every rejection is a RecordError whose message starts with its kind (`orphan tool result: …`).
"""

from __future__ import annotations

import hashlib
import json
import re

from eagle3.core.chat import split_for_generation
from eagle3.core.records import RecordError
from eagle3.prepare.adapters import ADAPTERS, parse_json_field
from eagle3.prepare.validate import check_id

MODES = ("keep", "regenerate", "prompt_only")

_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
_THOUGHT = re.compile(r"\s*<\|begin_of_thought\|>(.*?)<\|end_of_thought\|>(.*)", re.DOTALL)
_SOLUTION = re.compile(r"\s*<\|begin_of_solution\|>(.*?)<\|end_of_solution\|>\s*", re.DOTALL)


def stable_id(dataset: str, row: dict, id_field: str | None = None) -> str:
    """`<dataset>/<row id>` from the row's own id, else a content hash of the row."""
    if id_field and row.get(id_field) not in (None, ""):
        return f"{dataset}/{check_id(row[id_field], id_field)}"
    blob = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    digest = hashlib.sha1(blob.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{dataset}/{digest[:16]}"


def to_conversation(row: dict, dataset: str, adapter: str, id_field: str | None = None,
                    mode: str = "keep", drop_system: bool = False) -> dict:
    """One source row -> one conversation record, or RecordError with the reason."""
    if not isinstance(row, dict):
        raise RecordError(f"not an object: the row is a {type(row).__name__}")
    messages, tools = ADAPTERS[adapter](row)
    tools = normalize_tools(tools)
    for m in messages:
        if m["role"] == "assistant":
            split_inline_reasoning(m)
    messages = normalize_tool_calls(messages, tools)
    messages = check_turns(messages, mode, drop_system)
    record = {"id": stable_id(dataset, row, id_field), "source": dataset, "messages": messages}
    if tools:
        record["tools"] = tools
    return record


def split_inline_reasoning(m: dict) -> None:
    """Move reasoning written into an assistant's content to `reasoning_content`."""
    content = m["content"]
    if m.get("reasoning_content") or ("think" not in content and "thought" not in content):
        return
    reasoning = None
    if match := _THINK.fullmatch(content):
        reasoning, content = match.group(1), match.group(2)
    elif match := _THOUGHT.fullmatch(content):
        reasoning, content = match.group(1), match.group(2)
        if sol := _SOLUTION.fullmatch(content):
            content = sol.group(1)
    elif content.lstrip().startswith("<think>"):
        raise RecordError("bad reasoning: <think> is never closed by </think>")
    elif "</think>" in content and "<think>" not in content:
        # Sets distilled from templates whose generation prompt opens <think> themselves.
        reasoning, content = content.split("</think>", 1)
    if reasoning is not None:
        m["reasoning_content"], m["content"] = reasoning.strip(), content.strip()


def normalize_tools(tools) -> list | None:
    """OpenAI-style tool list, or None when the row declares none."""
    if tools in (None, "", []):
        return None
    if not isinstance(tools, list):
        raise RecordError(f"bad tools: 'tools' is a {type(tools).__name__}, not a list")
    out = []
    for k, t in enumerate(tools):
        t = parse_json_field(t, f"tool {k}")
        fn = t.get("function") if isinstance(t, dict) and "function" in t else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError(f"bad tools: tool {k} is not a function declaration with a name")
        fn = dict(fn)
        if "parameters" in fn:
            fn["parameters"] = parse_json_field(fn["parameters"], f"tool {k} parameters")
            if not isinstance(fn["parameters"], dict):
                raise RecordError(f"bad tools: tool {k} parameters are a "
                                  f"{type(fn['parameters']).__name__}, not a JSON schema object")
        if not isinstance(fn.get("description", ""), str):
            raise RecordError(f"bad tools: tool {k} description is a "
                              f"{type(fn['description']).__name__}, not a string")
        out.append({"type": "function", "function": fn})
    return out


def normalize_tool_calls(messages: list[dict], tools: list | None) -> list[dict]:
    """Kimi-style call ids, JSON-object arguments, every tool result linked to one call."""
    declared = {t["function"]["name"] for t in tools} if tools else None
    renamed: dict[str, str] = {}
    names: dict[str, str] = {}
    pending: list[str] = []
    answered: set[str] = set()
    idx = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = []
            for tc in m["tool_calls"]:
                name = _call_name(tc, i, declared)
                new_id = f"functions.{name}:{idx}"
                idx += 1
                if tc.get("id"):
                    if not isinstance(tc["id"], str):
                        raise RecordError(f"bad tool call: message {i} call id is a "
                                          f"{type(tc['id']).__name__}, not a string")
                    if tc["id"] in renamed:
                        raise RecordError(f"bad tool call: message {i} reuses call id "
                                          f"{tc['id']!r}")
                    renamed[tc["id"]] = new_id
                args = _call_arguments(tc["function"].get("arguments"), i)
                tc.clear()
                tc.update(id=new_id, type="function", function={"name": name, "arguments": args})
                names[new_id] = name
                pending.append(new_id)
        elif m["role"] == "assistant":
            m.pop("tool_calls", None)
        elif m["role"] == "tool":
            m["tool_call_id"] = _link_result(m.get("tool_call_id"), i, renamed, pending,
                                             answered)
            m["name"] = names[m["tool_call_id"]]
        elif m["role"] == "user":
            pending = []
    return messages


def _call_name(tc: dict, i: int, declared: set | None) -> str:
    fn = tc.get("function") if isinstance(tc, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise RecordError(f"bad tool call: message {i} has a tool call without a name")
    if declared is not None and name not in declared:
        raise RecordError(f"unknown tool: message {i} calls {name!r}, which 'tools' does not "
                          "declare")
    return name


def _call_arguments(args, i: int) -> str:
    if args is None or args == "":
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise RecordError(f"bad tool call: message {i} arguments are not JSON ({e.msg})")
    if not isinstance(args, dict):
        raise RecordError(f"bad tool call: message {i} arguments are a "
                          f"{type(args).__name__}, not a JSON object")
    return json.dumps(args, ensure_ascii=False)


def _link_result(old: str | None, i: int, renamed: dict, pending: list, answered: set) -> str:
    if old and not isinstance(old, str):
        raise RecordError(f"bad tool call: message {i} tool_call_id is a {type(old).__name__}, "
                          "not a string")
    if old:
        new = renamed.get(old)
        if new is None:
            raise RecordError(f"orphan tool result: message {i} answers unknown call {old!r}")
        if new in pending:
            pending.remove(new)
    elif pending:
        new = pending.pop(0)
    else:
        raise RecordError(f"orphan tool result: message {i} follows no unanswered tool call")
    if new in answered:
        raise RecordError(f"duplicate tool result: message {i} answers {new} again")
    answered.add(new)
    return new


def check_turns(messages: list[dict], mode: str, drop_system: bool = False) -> list[dict]:
    """Roles, order and emptiness; returns the messages the record keeps (see module doc)."""
    messages = [m for m in messages if not (m["role"] == "system" and (
        drop_system or not m["content"].strip()))]
    turns = [m for m in messages if m["role"] != "system"]
    if not turns:
        raise RecordError("empty field: the conversation has no user or assistant turn")
    if turns[0]["role"] != "user":
        raise RecordError(f"bad order: the first turn is {turns[0]['role']}, not user")
    for i, m in enumerate(messages):
        empty = not m["content"].strip()
        if m["role"] == "user" and empty:
            raise RecordError(f"empty turn: message {i} (user) is empty")
        if m["role"] == "assistant" and empty and not (
                m.get("reasoning_content") or m.get("tool_calls")):
            raise RecordError(f"empty turn: message {i} (assistant) has no content, reasoning "
                              "or tool call")
    last = messages[-1]["role"]
    if mode == "keep":
        if last != "assistant":
            raise RecordError(f"no final assistant turn: the conversation ends with a {last} "
                              "turn and its replies are kept")
        return messages
    if mode == "prompt_only":
        messages = split_for_generation(messages)[0]
    prompt = split_for_generation(messages)[0]
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        end = prompt[-1]["role"] if prompt else "nothing"
        raise RecordError(f"no prompt: the prompt to regenerate from ends with {end}, "
                          "not a user or tool turn")
    return messages
