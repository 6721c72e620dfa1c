"""Adapters: rows of public dataset schemas -> conversation records (PIPELINE.md, "Records").

Each adapter takes one source row (a dict) and returns the OpenAI-shaped message list plus the
tools, or raises RecordError with the reason. Ids are derived from the row itself (its own id
field, else a hash of its content), never from a line number, so re-runs give the same ids.
Tool call ids are normalised to Kimi's `functions.NAME:IDX` (IDX counts calls in the
conversation) and tool results are relinked to them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

from eagle3.records import RecordError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
}


def stable_id(dataset: str, row: dict, id_field: str | None = None) -> str:
    """`<dataset>/<row id>` from the row's own id, else a content hash of the row."""
    if id_field and row.get(id_field) not in (None, ""):
        return f"{dataset}/{row[id_field]}"
    digest = hashlib.sha1(json.dumps(row, sort_keys=True, ensure_ascii=False).encode())
    return f"{dataset}/{digest.hexdigest()[:16]}"


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def sharegpt(row: dict) -> tuple[list[dict], list | None]:
    """`{"conversations": [{"from", "value"}], "system"?}` (ShareGPT, OpenThoughts)."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordError("missing: 'conversations' is missing or empty")
    messages = []
    if row.get("system"):
        messages.append({"role": "system", "content": _text(row["system"], "system")})
    for i, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise RecordError(f"unknown role: turn {i} has from={turn.get('from')!r}")
        messages.append({"role": role, "content": _text(turn.get("value"), f"turn {i} value")})
    return messages, row.get("tools")


def openai_messages(row: dict) -> tuple[list[dict], list | None]:
    """`{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}], "tools"?}`."""
    raw = row.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RecordError("missing: 'messages' is missing or empty")
    messages = []
    for i, m in enumerate(raw):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise RecordError(f"unknown role: message {i} has role={role!r}")
        out = {"role": role, "content": m.get("content") or ""}
        _text(out["content"], f"message {i} content")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning:
            out["reasoning_content"] = _text(reasoning, f"message {i} reasoning")
        if m.get("tool_calls"):
            out["tool_calls"] = m["tool_calls"]
        if role == "tool":
            out["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                out["name"] = m["name"]
        messages.append(out)
    return messages, row.get("tools")


ADAPTERS: dict[str, Callable[[dict], tuple[list[dict], list | None]]] = {
    "sharegpt": sharegpt,
    "openai": openai_messages,
}


def normalize_tool_calls(messages: list[dict]) -> list[dict]:
    """Rename tool call ids to `functions.NAME:IDX`, parse-check arguments, relink results."""
    renamed: dict[str, str] = {}
    idx = 0
    for i, m in enumerate(messages):
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            name = fn.get("name")
            if not name:
                raise RecordError(f"bad tool call: message {i} has a tool call without a name")
            args = fn.get("arguments", "{}")
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError as e:
                raise RecordError(f"bad tool call: message {i} arguments are not JSON ({e})")
            new_id = f"functions.{name}:{idx}"
            idx += 1
            if tc.get("id"):
                renamed[tc["id"]] = new_id
            tc["id"] = new_id
            tc["type"] = "function"
            tc["function"] = {"name": name, "arguments": json.dumps(parsed, ensure_ascii=False)}
        if m["role"] == "tool":
            old = m.get("tool_call_id")
            if old not in renamed:
                raise RecordError(f"orphan tool result: message {i} answers unknown call {old!r}")
            m["tool_call_id"] = renamed[old]
    return messages


def to_conversation(dataset: str, adapter: str, row: dict, id_field: str | None) -> dict:
    """One source row -> one conversation record, or RecordError with the reason."""
    if not isinstance(row, dict):
        raise RecordError(f"malformed: row is a {type(row).__name__}, not an object")
    messages, tools = ADAPTERS[adapter](row)
    messages = normalize_tool_calls(messages)
    if not any(m["role"] == "user" for m in messages):
        raise RecordError("no user turn: the conversation has no user message")
    record = {"id": stable_id(dataset, row, id_field), "source": dataset, "messages": messages}
    if tools:
        record["tools"] = tools
    return record
