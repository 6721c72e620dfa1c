"""Reading stage 01b's input, `01_prepared/<dataset>/conversations.jsonl`, line by line.

Stage 01 wrote and validated every line, so a line that is not a conversation record now means
the file was damaged or edited after 01 finished: a torn last line (a copy cut short), a line
that is not JSON, or a record that breaks the conversation contract of docs/PIPELINE.md ("Records":
an object with a string `id` and `source` and a non-empty list of messages, each an object with
a known `role` and a string `content`). Each such line is skipped and listed in the stage's skip
list (`01b_generated/skipped.jsonl`, `eagle3.core.faults.BadRecords`) under the key
`<dataset>/conversations.jsonl:<line>`, up to `--max-bad` lines; it is never sent to the target.
Conversations that are records but cannot be rendered (too long, no prompt) are the quarantine's
(`<dataset>/quarantine.jsonl`), as before: those are data, not damage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from eagle3.core.faults import BadRecords
from eagle3.core.records import ROLES


def conversation_problem(row) -> str | None:
    """Why `row` breaks the conversation record contract, or None when it keeps it."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    for key in ("id", "source"):
        if not isinstance(row.get(key), str) or not row[key]:
            return f"{key} missing or not a non-empty string"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages missing or not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"messages[{i}] is not an object with a role in {ROLES}"
        if not isinstance(m.get("content"), str):
            return f"messages[{i}].content missing or not a string"
    if "tools" in row and not isinstance(row["tools"], (list, type(None))):
        return "tools is not a list"
    return None


def read_conversations(path: Path, bad: BadRecords) -> Iterator[dict]:
    """The conversation records of `path`, in file order; every other line goes to `bad` (which
    raises TooManyBad past its budget)."""
    path = Path(path)
    where = f"{path.parent.name}/{path.name}"
    with path.open("rb") as f:
        for n, line in enumerate(f, start=1):
            key = f"{where}:{n}"
            if not line.endswith(b"\n"):
                bad.add(key, f"torn line: the last line ({len(line)} bytes) has no newline; "
                             "the file was cut short after stage 01 wrote it", path)
                return
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                bad.add(key, f"bad JSON: {e}", path)
                continue
            problem = conversation_problem(row)
            if problem is not None:
                rid = row.get("id") if isinstance(row, dict) else None
                bad.add(key, f"bad record: {problem}" + (f" (id {rid!r})" if rid else ""), path)
                continue
            yield row
