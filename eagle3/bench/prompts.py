"""Prompt sets for stage 05: the held-out eval split, the project's own sets, local files.

A prompt set is a name and a list of prompts as token ids, exactly what the target is fed:

- `eval`: the held-out split of the user's own data, `<workdir>/01c_merged/eval.jsonl`
  (tokenized records; the prompt is `input_ids[:n_prompt_tokens]`, the serving prompt of the
  record's first assistant turn).
- `chat`, `code`, `math`, `tools`: small sets written for this project, in `prompts/*.jsonl`:
  MT-Bench-style single and multi-turn chat (writing, role play, explanation, planning, with a
  scripted earlier assistant turn where the prompt is a follow-up), HumanEval-style code tasks
  (complete or write a function, fix a bug), GSM8K-style word problems, and agentic tool use
  (function definitions, earlier tool calls and tool results, a coding-agent system prompt).
- `human_chat`, `human_code`: prompts written by people that no stage sees: MT-bench first turns
  (40 of 80) and HumanEval tasks (82 of 164), read from the files PyPI packages ship
  (eagle3/prepare/human.py; sources, licences and counts in `prompts/human_sources.json`).
- any other value is a path to a local JSONL file (its stem names the set) holding either
  tokenized records or conversation records.

Conversation records (`{"id", "messages", "tools"?}`, docs/PIPELINE.md's shape) are rendered with
the target's chat template (`ChatRenderer.prompt_ids`, generation prompt added); a conversation that
ends with an assistant turn is cut before it, so the target writes that turn itself.

Bad lines (not JSON, a torn last line, not an object, no prompt, an empty prompt) are skipped
and listed with their file and line in `05_benchmark/skipped.jsonl` (`BadRecords`, up to
`--max-bad`); without a skip list the first one is an `InputFileError` naming the file and line.
A set with no usable prompt at all is an `InputFileError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eagle3.core.chat import split_for_generation
from eagle3.core.faults import BadRecords, InputFileError
from eagle3.core.stage import STAGE_DIRS, StageError

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"
BUILTIN_SETS = ("chat", "code", "math", "tools", "human_chat", "human_code")
EVAL_SET = "eval"


class PromptError(StageError, ValueError):
    """A prompt set that cannot be loaded; the message names the file or record and the fix."""


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]  # token ids fed to the target
    ids: list[str] = field(default_factory=list)  # record id of each prompt


def prompt_set_path(spec: str, workdir: Path) -> Path:
    """The JSONL file behind a prompt-set name or path."""
    if spec == EVAL_SET:
        return Path(workdir) / STAGE_DIRS["merge"] / "eval.jsonl"
    if spec in BUILTIN_SETS:
        return PROMPTS_DIR / f"{spec}.jsonl"
    path = Path(spec)
    if not path.is_file():
        raise PromptError(f"prompt set {spec!r} is neither {EVAL_SET!r}, one of {BUILTIN_SETS}, "
                          "nor an existing JSONL file")
    return path


def load_prompt_set(spec: str, workdir: Path, renderer=None, limit: int | None = None,
                    bad: BadRecords | None = None) -> PromptSet:
    """The first `limit` usable prompts of a set; `renderer` (a ChatRenderer) renders
    conversations. A bad line goes to `bad` (None: InputFileError)."""
    path = prompt_set_path(spec, workdir)
    name = spec if spec in (EVAL_SET, *BUILTIN_SETS) else path.stem
    out = PromptSet(name, [])
    skipped = 0
    for n, rec, problem in _lines(path):
        if limit is not None and len(out.prompts) >= limit:
            break
        if problem is None:
            try:
                ids = _prompt_ids(rec, renderer, f"{path}:{n}")
                problem = None if ids else f"empty prompt: {path}:{n} has no prompt token"
            except PromptError as e:
                problem = f"no prompt: {e}"
            except (KeyError, TypeError, ValueError) as e:  # a turn the template cannot render
                problem = f"no prompt: {path}:{n}: cannot render it ({e!r})"
        if problem is not None:
            if bad is None:
                raise InputFileError(f"{path}:{n}", problem)
            bad.add(f"{name}:{n}", problem, path)
            skipped += 1
            continue
        out.prompts.append(ids)
        out.ids.append(str(rec.get("id", f"{name}/{n}")))
    if not out.prompts:
        raise InputFileError(path, f"holds no usable prompt ({skipped} bad lines skipped"
                             f"{f': see {bad.path}' if skipped else ''}); fix the file or "
                             "leave it out of --prompt-sets")
    return out


def _lines(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, record, problem) of each non-blank line; a problem names what is wrong."""
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                torn = not raw.endswith(b"\n")
                yield n, None, (f"torn line: {path}:{n} ends without a newline mid-record"
                                if torn else f"bad JSON: {path}:{n}: {e}")
                continue
            if not isinstance(rec, dict):
                yield n, None, f"bad JSON: {path}:{n} is a {type(rec).__name__}, not an object"
                continue
            yield n, rec, None


def _prompt_ids(rec: dict, renderer, where: str) -> list[int]:
    if "input_ids" in rec:
        n, ids = rec.get("n_prompt_tokens"), rec["input_ids"]
        if not n:
            raise PromptError(f"{where}: tokenized record without n_prompt_tokens")
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids[:n]):
            raise PromptError(f"{where}: input_ids must be a list of token ids")
        return list(ids[:n])
    if "messages" in rec:
        if renderer is None:
            raise PromptError(f"{where}: conversation records need the target's tokenizer "
                              "(pass --target)")
        messages = rec["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise PromptError(f"{where}: messages must be a list of {{role, content}} turns")
        if not messages:
            raise PromptError(f"{where}: empty messages")
        if messages[-1]["role"] == "assistant":
            messages = split_for_generation(messages)[0]
        return renderer.prompt_ids(messages, rec.get("tools"))
    raise PromptError(f"{where}: a prompt record needs input_ids + n_prompt_tokens or messages")
