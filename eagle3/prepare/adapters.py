"""Adapters: rows of public dataset schemas -> OpenAI-shaped messages (docs/PIPELINE.md, "Records").

Each adapter takes one source row (a dict) and returns `(messages, tools)` or raises RecordError
whose message starts with the kind of problem (`missing field: ...`). Shared clean-up (tool
call ids and arguments, inline reasoning, roles and order) happens afterwards, in
`eagle3.prepare.conversations`, the same for every adapter.

- `sharegpt`: `conversations: [{from, value}]`, `system`?, `tools`? (ShareGPT_Vicuna_unfiltered,
  open-perfectblend, OpenThoughts-114k)
- `openai`: `messages: [{role, content, reasoning_content?, tool_calls?, tool_call_id?}]`,
  `tools`?; or Llama-Nemotron's `input` + `output` (UltraChat 200k, Nemotron post-training,
  OpenHands traces)
- `instruction_response`, `input_output`, `query_answer`, `problem_solution`: one prompt field
  and one reply field (Magicoder, OpenCodeReasoning, CodeFeedback)
- `xlam`: `query`, `answers` and `tools` as JSON strings (xlam-function-calling-60k)
- `glaive`: `system`, `chat` with `USER:` / `ASSISTANT:` / `<functioncall>` /
  `FUNCTION RESPONSE:` markers (glaive-function-calling-v2)
- `hermes`: `conversations` with `<tool_call>` / `<tool_response>` tags, `tools`
  (hermes-function-calling-v1)
- `swe_agent`: `trajectory: [{role: system|user|ai, text}]`, `system_prompt`?
  (SWE-agent-trajectories)
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable

from eagle3.core.records import RecordError

Adapter = Callable[[dict], tuple[list[dict], list | None]]

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "system": "system", "tool": "tool", "function_response": "tool", "observation": "tool",
    "ipython": "tool",
}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user",
                "assistant": "assistant", "tool": "tool", "function": "tool"}
SWE_AGENT_ROLES = {"system": "system", "user": "user", "ai": "assistant",
                   "assistant": "assistant"}


# ---------------------------------------------------------------- field helpers


def _field(row: dict, name: str) -> Any:
    if name not in row or row[name] is None:
        raise RecordError(f"missing field: {name!r}")
    return row[name]


def _text(value: Any, where: str) -> str:
    """A message text: a string, or OpenAI content parts of type text (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") not in ("text", None) for p in value):
            kinds = sorted({str(p.get("type")) for p in value})
            raise RecordError(f"bad type: {where} has non-text content parts {kinds}")
        return "".join(_text(p.get("text"), where) for p in value)
    raise RecordError(f"bad type: {where} is a {type(value).__name__}, not a string")


def _role(value: Any, table: dict[str, str], where: str, fold_case: bool = False) -> str:
    """A role name looked up in `table`; anything but a known string is a RecordError."""
    role = table.get(value.lower() if fold_case else value) if isinstance(value, str) else None
    if role is None:
        raise RecordError(f"unknown role: {where}={_short(value)}")
    return role


def _short(value: Any) -> str:
    return text if len(text := repr(value)) <= 60 else text[:57] + "..."


def _str_or_none(value: Any, where: str) -> str | None:
    """An optional string field (a tool call id, a tool name)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise RecordError(f"bad type: {where} is a {type(value).__name__}, not a string")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise RecordError(f"bad type: {where} is a {type(value).__name__}, not a list")
    if not value:
        raise RecordError(f"empty field: {where} is an empty list")
    return value


def parse_json_field(value: Any, where: str) -> Any:
    """A field that some datasets store as a JSON string and others as the object itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RecordError(f"bad json field: {where} is not valid JSON ({e.msg})") from e


def parse_loose_object(text: str, where: str) -> dict:
    """A JSON object, or a Python-literal dict (single quotes) as Hermes and glaive write."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        try:
            obj = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
            raise RecordError(f"bad tool call: {where} is neither JSON nor a literal "
                              f"({type(e).__name__})") from e
    if not isinstance(obj, dict):
        raise RecordError(f"bad tool call: {where} is a {type(obj).__name__}, not an object")
    return obj


def _tool_call(name: Any, arguments: Any) -> dict:
    """An OpenAI tool call; ids and argument checks come later (eagle3.prepare.conversations)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- chat schemas


def sharegpt(row: dict) -> tuple[list[dict], list | None]:
    """`{"conversations": [{"from", "value"}], "system"?, "tools"?}`."""
    turns = _list(_field(row, "conversations"), "'conversations'")
    messages = []
    if row.get("system"):
        messages.append({"role": "system", "content": _text(row["system"], "'system'")})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"bad type: turn {i} is a {type(turn).__name__}, not an object")
        role = _role(turn.get("from"), SHAREGPT_ROLES, f"turn {i} has from", fold_case=True)
        messages.append({"role": role, "content": _text(turn.get("value"), f"turn {i} value")})
    tools = parse_json_field(row.get("tools"), "'tools'") if row.get("tools") else None
    return messages, tools


def openai_messages(row: dict) -> tuple[list[dict], list | None]:
    """`{"messages": [...], "tools"?}`, or Llama-Nemotron's `input` messages + `output` text."""
    if "messages" in row and row["messages"] is not None:
        raw = _list(row["messages"], "'messages'")
    elif "input" in row and isinstance(row["input"], list):
        raw = list(row["input"]) + [{"role": "assistant", "content": _field(row, "output")}]
    else:
        raise RecordError("missing field: 'messages'")
    messages = []
    if isinstance(row.get("system_prompt"), str) and row["system_prompt"]:
        messages.append({"role": "system", "content": row["system_prompt"]})
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RecordError(f"bad type: message {i} is a {type(m).__name__}, not an object")
        role = _role(m.get("role"), OPENAI_ROLES, f"message {i} has role")
        out = {"role": role, "content": _text(m.get("content"), f"message {i} content")}
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking")
                          if isinstance(m.get(k), (str, list)) and m.get(k)), None)
        if reasoning is not None and role == "assistant":
            out["reasoning_content"] = _text(reasoning, f"message {i} reasoning")
        if m.get("tool_calls"):
            out["tool_calls"] = _openai_calls(m["tool_calls"], i)
        elif isinstance(m.get("function_call"), dict):  # the pre-2023 single-call field
            fc = m["function_call"]
            out["tool_calls"] = [_tool_call(fc.get("name"), fc.get("arguments"))]
        if role == "tool":
            out["tool_call_id"] = _str_or_none(m.get("tool_call_id"), f"message {i} tool_call_id")
            if name := _str_or_none(m.get("name"), f"message {i} name"):
                out["name"] = name
        messages.append(out)
    tools = parse_json_field(row.get("tools"), "'tools'") if row.get("tools") else None
    return messages, tools


def _openai_calls(calls: Any, i: int) -> list[dict]:
    calls = parse_json_field(calls, f"message {i} tool_calls")
    if not isinstance(calls, list):
        raise RecordError(f"bad tool call: message {i} tool_calls is not a list")
    out = []
    for tc in calls:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            raise RecordError(f"bad tool call: message {i} has a tool call without 'function'")
        call = _tool_call(fn.get("name"), fn.get("arguments"))
        if call_id := _str_or_none(tc.get("id"), f"message {i} tool call id"):
            call["id"] = call_id
        out.append(call)
    return out


def pair(prompt_field: str, reply_field: str) -> Adapter:
    """One prompt field and one reply field (an empty reply leaves a prompt-only record)."""

    def adapter(row: dict) -> tuple[list[dict], list | None]:
        prompt = _text(_field(row, prompt_field), repr(prompt_field))
        if reply_field not in row:
            raise RecordError(f"missing field: {reply_field!r}")
        reply = _text(row[reply_field], repr(reply_field))
        messages = [{"role": "user", "content": prompt}]
        if reply:
            messages.append({"role": "assistant", "content": reply})
        return messages, None

    adapter.__doc__ = f"`{{{prompt_field!r}, {reply_field!r}}}` pairs."
    return adapter


def swe_agent(row: dict) -> tuple[list[dict], list | None]:
    """`{"trajectory": [{"role": system|user|ai, "text"}], "system_prompt"?}` (SWE-agent)."""
    steps = _list(_field(row, "trajectory"), "'trajectory'")
    messages = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise RecordError(f"bad type: step {i} is a {type(step).__name__}, not an object")
        role = _role(step.get("role"), SWE_AGENT_ROLES, f"step {i} has role")
        text = step.get("text", step.get("content"))
        messages.append({"role": role, "content": _text(text, f"step {i} text")})
    system = row.get("system_prompt") or steps[0].get("system_prompt")
    if system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": _text(system, "'system_prompt'")})
    return messages, None


# ---------------------------------------------------------------- function calling schemas


def xlam(row: dict) -> tuple[list[dict], list | None]:
    """xLAM: `query` text, `answers` and `tools` as JSON strings; the reply is the calls."""
    query = _text(_field(row, "query"), "'query'")
    answers = parse_json_field(_field(row, "answers"), "'answers'")
    tools = parse_json_field(_field(row, "tools"), "'tools'")
    if not isinstance(answers, list) or not isinstance(tools, list):
        raise RecordError("bad type: 'answers' and 'tools' must be JSON lists")
    calls = []
    for k, a in enumerate(answers):
        if not isinstance(a, dict):
            raise RecordError(f"bad tool call: answer {k} is not an object")
        calls.append(_tool_call(a.get("name"), a.get("arguments", {})))
    messages = [{"role": "user", "content": query}]
    if calls:
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
    return messages, [xlam_tool(t) for t in tools]


_XLAM_TYPES = {"str": "string", "string": "string", "int": "integer", "integer": "integer",
               "float": "number", "number": "number", "bool": "boolean", "boolean": "boolean",
               "list": "array", "array": "array", "dict": "object", "object": "object"}


def xlam_tool(tool: Any) -> dict:
    """xLAM's `{name, description, parameters: {p: {type, description, default?}}}` as an
    OpenAI tool with a JSON-schema `parameters` (Python type names mapped, `, optional` and a
    default make a parameter optional)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise RecordError("bad tools: an xLAM tool has no name")
    params = tool.get("parameters") or {}
    if not isinstance(params, dict):
        raise RecordError(f"bad tools: xLAM tool {tool['name']!r} parameters are a "
                          f"{type(params).__name__}, not an object")
    props, required = {}, []
    for pname, p in params.items():
        p = p if isinstance(p, dict) else {"description": str(p)}
        raw_type = str(p.get("type", "string"))
        base = raw_type.split(",")[0].strip()
        base = base.split("[")[0].strip().lower()
        schema = {"type": _XLAM_TYPES.get(base, "string"), "description": p.get("description", "")}
        if "default" in p:
            schema["default"] = p["default"]
        elif "optional" not in raw_type.lower():
            required.append(pname)
        props[pname] = schema
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description", ""),
        "parameters": {"type": "object", "properties": props, "required": required}}}


_GLAIVE_MARK = re.compile(r"(?:^|\n)\s*(USER|ASSISTANT|FUNCTION RESPONSE):\s?")
_GLAIVE_EOT = "<|endoftext|>"


def glaive(row: dict) -> tuple[list[dict], list | None]:
    """glaive v2: `system` (tools as JSON objects after the intro) and a marked-up `chat`."""
    system_text, tools = _glaive_system(_text(row.get("system", ""), "'system'"))
    chat = _text(_field(row, "chat"), "'chat'")
    parts = _GLAIVE_MARK.split(chat)
    if len(parts) < 3 or parts[0].strip():
        raise RecordError("malformed chat: 'chat' does not start with a USER:/ASSISTANT: marker")
    messages = [{"role": "system", "content": system_text}] if system_text else []
    for marker, body in zip(parts[1::2], parts[2::2]):
        body = body.replace(_GLAIVE_EOT, "").strip()
        if marker == "USER":
            messages.append({"role": "user", "content": body})
        elif marker == "FUNCTION RESPONSE":
            messages.append({"role": "tool", "content": body})
        else:
            messages.append(_glaive_assistant(body))
    return messages, tools


def _glaive_system(text: str) -> tuple[str, list | None]:
    text = re.sub(r"^\s*SYSTEM:\s*", "", text)
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    tools, pos, decoder = [], start, json.JSONDecoder()
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise RecordError(f"bad tools: a function in 'system' is not JSON ({e.msg})") from e
        tools.append({"type": "function", "function": obj})
        while pos < len(text) and text[pos].isspace():
            pos += 1
    intro = text[:start].strip().rstrip("-").strip()
    return intro, tools


def _glaive_assistant(body: str) -> dict:
    if "<functioncall>" not in body:
        return {"role": "assistant", "content": body}
    content, call = body.split("<functioncall>", 1)
    call = call.strip()
    # glaive writes `{"name": "f", "arguments": '{"a": 1}'}`: the arguments are a quoted string.
    m = re.fullmatch(r'\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}', call,
                     re.DOTALL)
    if m:
        name, arguments = m.group(1), m.group(2)
    else:
        obj = parse_loose_object(call, "<functioncall>")
        name, arguments = obj.get("name"), obj.get("arguments", {})
    return {"role": "assistant", "content": content.strip(),
            "tool_calls": [_tool_call(name, arguments)]}


_TOOL_CALL_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_RESPONSE_TAG = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_TOOLS_TAG = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


def hermes(row: dict) -> tuple[list[dict], list | None]:
    """Hermes function calling: ShareGPT turns with `<tool_call>` / `<tool_response>` tags.

    Tools come from the `tools` field, else from the system prompt's `<tools>` block; a system
    prompt that declares tools in Hermes' own format is dropped (the target's template declares
    them its own way).
    """
    messages, tools = sharegpt(row)
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "system" and "<tools>" in m["content"]:
            if tools is None:
                tools = _hermes_tools(m["content"])
            continue
        calls = _TOOL_CALL_TAG.findall(m["content"]) if m["role"] == "assistant" else []
        results = _TOOL_RESPONSE_TAG.findall(m["content"]) if m["role"] == "tool" else []
        if calls:
            objs = [parse_loose_object(c, f"turn {i} <tool_call>") for c in calls]
            text = _TOOL_CALL_TAG.sub("", m["content"]).strip()
            out.append({"role": "assistant", "content": text, "tool_calls": [
                _tool_call(o.get("name"), o.get("arguments", {})) for o in objs]})
        elif results:
            out.extend({"role": "tool", "content": r.strip()} for r in results)
        else:
            out.append(m)
    return out, tools


def _hermes_tools(system: str) -> list:
    m = _TOOLS_TAG.search(system)
    body = m.group(1).strip() if m else ""
    try:
        tools = json.loads(body)
    except json.JSONDecodeError:
        try:
            tools = ast.literal_eval(body)
        except (ValueError, SyntaxError) as e:
            raise RecordError("bad tools: the <tools> block is neither JSON nor a literal") from e
    return tools if isinstance(tools, list) else [tools]


ADAPTERS: dict[str, Adapter] = {
    "sharegpt": sharegpt,
    "openai": openai_messages,
    "instruction_response": pair("instruction", "response"),
    "input_output": pair("input", "output"),
    "query_answer": pair("query", "answer"),
    "problem_solution": pair("problem", "solution"),
    "xlam": xlam,
    "glaive": glaive,
    "hermes": hermes,
    "swe_agent": swe_agent,
}
