"""Rendering conversations with the target's own chat template, and their loss masks.

Everything goes through `tokenizer.apply_chat_template`; no template is written by hand here.
The loss mask is derived from the template itself: the tokens an assistant turn adds are the
difference between the rendering of the conversation up to that turn with the generation prompt
(what serving feeds the target) and the rendering that includes the turn. That works for any
template in which the prompt rendering is a prefix of the full rendering, which is checked, so a
template that renders history differently from serving is caught rather than silently trained on.

A conversation yields one sample per user turn that is followed by assistant turns: the sample
ends at the last assistant turn before the next user message, so that every supervised turn is
rendered exactly as serving renders it (templates such as Kimi's drop reasoning of assistant
turns before the last user message).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class RenderError(ValueError):
    """A conversation the template cannot render as serving would."""


@dataclass
class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    tokenizer: Any
    # Extra keyword arguments for the template, e.g. {"thinking": True}.
    template_kwargs: dict = field(default_factory=dict)
    # The token that closes an assistant turn; None = the tokenizer's eos token.
    end_of_turn: str | None = None

    def __post_init__(self) -> None:
        eot = self.end_of_turn or self.tokenizer.eos_token
        self.end_of_turn_id = self.tokenizer.convert_tokens_to_ids(eot)

    def render_ids(self, messages: list[dict], tools: list | None, add_generation_prompt: bool):
        """Token ids of `messages` rendered by the template (no extra special tokens)."""
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """What serving feeds the target to generate the next assistant turn."""
        return self.render_ids(messages, tools, add_generation_prompt=True)

    def supervised_samples(self, messages: list[dict], tools: list | None = None):
        """Yield (input_ids, loss_mask, n_prompt_tokens) per user segment with assistant turns.

        `n_prompt_tokens` is the length of the serving prompt of the segment's first assistant
        turn. Raises RenderError when the template renders a turn differently from serving.
        """
        for end in _segment_ends(messages):
            ids = self.render_ids(messages[: end + 1], tools, add_generation_prompt=False)
            mask = [0] * len(ids)
            n_prompt = None
            for i in range(end + 1):
                if messages[i]["role"] != "assistant" or not _in_segment(messages, i, end):
                    continue
                prompt = self.render_ids(messages[:i], tools, add_generation_prompt=True)
                upto = self.render_ids(messages[: i + 1], tools, add_generation_prompt=False)
                if ids[: len(prompt)] != prompt or ids[: len(upto)] != upto:
                    raise RenderError(
                        f"assistant turn {i}: the template does not render the conversation "
                        "as a continuation of the serving prompt (history rendered differently)"
                    )
                for t in range(len(prompt), self._turn_end(upto, len(prompt))):
                    mask[t] = 1
                n_prompt = len(prompt) if n_prompt is None else n_prompt
            yield ids, mask, n_prompt

    def _turn_end(self, ids: list[int], start: int) -> int:
        """Index after the end-of-turn token closing the turn that starts at `start`."""
        for t in range(len(ids) - 1, start - 1, -1):
            if ids[t] == self.end_of_turn_id:
                return t + 1
        return len(ids)  # a template without an end-of-turn token: supervise all it added


def _segment_ends(messages: list[dict]) -> list[int]:
    """Indices of the last assistant message before each following user message (or the end)."""
    ends = []
    for i, m in enumerate(messages):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "assistant" and nxt in (None, "user"):
            ends.append(i)
    return ends


def _in_segment(messages: list[dict], i: int, end: int) -> bool:
    """True when no user message sits between message `i` and `end`."""
    return all(m["role"] != "user" for m in messages[i + 1 : end + 1])


def split_for_generation(messages: list[dict]) -> tuple[list[dict], dict | None]:
    """(prompt messages, reference reply): the conversation cut before its last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return messages, None
    return messages[:last], messages[last]
