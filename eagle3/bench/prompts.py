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
- any other value is a path to a local JSONL file (its stem names the set) holding either
  tokenized records or conversation records.

Conversation records (`{"id", "messages", "tools"?}`, docs/PIPELINE.md's shape) are rendered with
the target's chat template (`ChatRenderer.prompt_ids`, generation prompt added); a conversation that
ends with an assistant turn is cut before it, so the target writes that turn itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core.chat import split_for_generation
from eagle3.core.records import read_jsonl
from eagle3.core.stage import STAGE_DIRS

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"
BUILTIN_SETS = ("chat", "code", "math", "tools")
EVAL_SET = "eval"


class PromptError(ValueError):
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


def load_prompt_set(spec: str, workdir: Path, renderer=None, limit: int | None = None
                    ) -> PromptSet:
    """The first `limit` prompts of a set; `renderer` (a ChatRenderer) renders conversations."""
    path = prompt_set_path(spec, workdir)
    name = spec if spec in (EVAL_SET, *BUILTIN_SETS) else path.stem
    out = PromptSet(name, [])
    for n, rec in enumerate(read_jsonl(path), start=1):
        if limit is not None and len(out.prompts) >= limit:
            break
        out.prompts.append(_prompt_ids(rec, renderer, f"{path}:{n}"))
        out.ids.append(str(rec.get("id", f"{name}/{n}")))
    if not out.prompts:
        raise PromptError(f"{path} holds no prompts")
    return out


def _prompt_ids(rec: dict, renderer, where: str) -> list[int]:
    if "input_ids" in rec:
        n = rec.get("n_prompt_tokens")
        if not n:
            raise PromptError(f"{where}: tokenized record without n_prompt_tokens")
        return list(rec["input_ids"][:n])
    if "messages" in rec:
        if renderer is None:
            raise PromptError(f"{where}: conversation records need the target's tokenizer "
                              "(pass --target)")
        messages = rec["messages"]
        if messages and messages[-1]["role"] == "assistant":
            messages = split_for_generation(messages)[0]
        return renderer.prompt_ids(messages, rec.get("tools"))
    raise PromptError(f"{where}: a prompt record needs input_ids + n_prompt_tokens or messages")
