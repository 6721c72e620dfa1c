"""Checks every stage-01 row gets besides its adapter's: structure, values and a cheap size bound.

- `check_depth(row)`: rows nest at most `MAX_DEPTH` levels (a deeper one would make JSON
  encoding and the adapters recurse past Python's limit), checked without recursion.
- `check_values(record)`: the conversation record written out holds no NUL character (many
  tools cut strings there, and a tokenizer treats it as text) and no NaN or infinite number
  (`json.dumps` would write `NaN`, which is not JSON). Both are quarantined, never cleaned: the
  reason names the field (`messages[2].content`, `tools[0].function.parameters...`).
- `check_id(value, field)`: a row's own id is a string or an integer (not a bool, list or
  object, which would turn into ids like `ds/{'a': 1}`).
- `min_tokens(messages, max_token_chars)`: a lower bound on the tokens each prefix of a
  conversation renders to, from its character count alone: no token stands for more than
  `max_token_chars` characters of text, so a conversation far over `--max-seq-len` is found
  before it is rendered (rendering a multi-MB message costs seconds and a GB of memory).
"""

from __future__ import annotations

import math
from typing import Any

from eagle3.core.records import RecordError

MAX_DEPTH = 64
# The bound divides by twice the longest token: a tokenizer's normalizer may shorten text a
# little (NFKC folds ligatures), and the bound must stay below the real count.
SAFETY = 2


def check_depth(row: Any) -> None:
    stack = [(row, 1, "row")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            raise RecordError(f"too deeply nested: {where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{where}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))


def check_values(record: dict) -> None:
    stack: list[tuple[Any, str]] = [(v, k) for k, v in record.items()]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise RecordError(f"NUL character: {where} holds a NUL (\\x00) at char "
                                  f"{value.index(chr(0))}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise RecordError(f"non-finite number: {where} is {value}, which JSON cannot "
                                  "hold")
        elif isinstance(value, dict):
            stack.extend((v, f"{where}.{k}") for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))


def check_id(value: Any, field: str) -> str:
    """The id text of a row's own id field."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(f"bad id: field {field!r} is a {type(value).__name__}; ids must be "
                          "strings or integers")
    return str(value)


def max_token_chars(tokenizer) -> int:
    """Characters of the longest token's text in the vocabulary (an upper bound on the text one
    token stands for: byte-level tokens spell one byte a character, others more)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def min_tokens(messages: list[dict], max_chars: int) -> list[int]:
    """A lower bound on the tokens of each prefix `messages[:i+1]`, from the characters of the
    text every template renders whole (contents, tool call arguments; not reasoning, which
    templates may drop from history, nor tool declarations, which they may abridge)."""
    per = SAFETY * max(max_chars, 1)
    total = 0
    out = []
    for m in messages:
        total += len(m.get("content") or "")
        total += sum(len(tc["function"]["arguments"]) for tc in m.get("tool_calls") or [])
        out.append(total // per)
    return out
