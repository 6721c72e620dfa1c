"""Rendering conversations with the target's own chat template, and their loss masks.

Everything goes through `tokenizer.apply_chat_template`; no template is written by hand here.
The loss mask is derived from the template itself. For assistant turn `i`:

    P_i = render(messages[:i], add_generation_prompt=True)   what serving feeds the target
    U_i = render(messages[:i+1])                             the conversation through turn i

and the turn's supervised tokens are those after P_i up to the last end-of-turn token of U_i.

Samples. A sample is the rendering F = U_E of the conversation through some assistant turn E;
it supervises every assistant turn i <= E whose P_i and U_i are both prefixes of F, i.e. turns
that the sample renders exactly as serving renders them (docs/PIPELINE.md, prefix property). Turns
left out get samples of their own, built the same way from the latest uncovered turn down. So a
template that keeps history unchanged gives one sample per conversation, Kimi's (reasoning of
turns before the last user message dropped) one per user segment with reasoning, and a template
that rewrites every earlier assistant turn one per assistant turn.

Tokenization. The exact rule (`exact=True`, the reference) tokenizes F, every P_i and every U_i
and checks that each is a token prefix of F: O(turns x length) tokens. The fast rule tokenizes F
once, cut at the P_i/U_i boundaries. A cut is *hard* when an added token of the tokenizer starts
there (or ends there, for tokenizers that pass a probe showing text after an added token is
tokenized as at the start of a text) and no added token straddles it: every HF tokenizer splits
added tokens out before anything else, so tokenizing the pieces equals tokenizing the whole. Any
other cut is checked exactly within the piece between hard cuts around it. `tests/test_chat.py`
checks the fast rule against the exact one; the stage also re-checks a sample of records.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class RenderError(ValueError):
    """A conversation the template cannot render as serving would."""


@dataclass
class Sample:
    """One supervised sequence of a conversation."""

    input_ids: list[int]
    loss_mask: list[int]
    n_prompt_tokens: int  # serving prompt length of the sample's first supervised turn
    last_message: int  # index of the last message the sample includes (an assistant turn)
    supervised_turns: list[int]  # indices of the assistant messages it supervises
    spans: list[tuple[int, int]]  # per supervised turn: (end of P_i, end of U_i) in tokens
    text: str  # the rendered text the ids tokenize


@dataclass
class _Plan:
    """One sample before tokenization: its text and the char spans of its supervised turns."""

    last_message: int
    text: str
    turns: list[tuple[int, int, int]]  # (message index, end of P_i, end of U_i) in chars


@dataclass
class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    tokenizer: Any
    # Extra keyword arguments for the template, e.g. {"thinking": True}.
    template_kwargs: dict = field(default_factory=dict)
    # The token that closes an assistant turn; None = the special token the template closes an
    # assistant turn with, else (no such token) the tokenizer's eos token.
    end_of_turn: str | None = None

    def __post_init__(self) -> None:
        self._anchors = _AddedTokens(self.tokenizer)
        eot = self.end_of_turn or self._template_end_of_turn() or self.tokenizer.eos_token
        self.end_of_turn_id = self.tokenizer.convert_tokens_to_ids(eot)
        self._cut_after_anchor = self._probe_cut_after_anchor()
        self._backend = self._probe_backend()
        specials = sorted(self._anchors.special, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def _template_end_of_turn(self) -> str | None:
        """The special token right after an assistant turn's text in the template's rendering
        (what closes a reply, whatever the tokenizer calls its eos: a GGUF's tokenizer may name
        another token), or None when the template does not render it so."""
        sentinel = "xqzreplysentinel7"
        try:
            text = self.render_text([{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": sentinel}], None, False)
        except RenderError:
            return None
        if text.count(sentinel) != 1:
            return None
        after = text[text.index(sentinel) + len(sentinel):]
        return next((t for t in sorted(self._anchors.special, key=len, reverse=True)
                     if after.startswith(t)), None)

    def special_text_in(self, messages: list[dict], tools: list | None = None) -> str | None:
        """Where text that reaches the template holds a special token's string (serving would
        tokenize it as that token, e.g. a fake end of turn), else None: message text, reasoning,
        names, tool calls (names and arguments) and tool declarations (every string in them)."""
        if self._special_re is None:
            return None
        for i, m in enumerate(messages):
            texts = [("content", m.get("content")), ("reasoning", m.get("reasoning_content")),
                     ("name", m.get("name")), ("tool_call_id", m.get("tool_call_id"))]
            for tc in m.get("tool_calls") or []:
                texts += [("tool call name", tc["function"]["name"]),
                          ("tool call arguments", tc["function"]["arguments"])]
            for where, text in texts:
                if isinstance(text, str) and (hit := self._special_re.search(text)):
                    return f"message {i} {where} holds {hit.group()!r}"
        for k, tool in enumerate(tools or []):
            # The declaration as JSON: every name, description and schema string it holds.
            text = json.dumps(tool, ensure_ascii=False)
            if hit := self._special_re.search(text):
                return f"tool {k} declaration holds {hit.group()!r}"
        return None

    def unrendered_tool_use(self, messages: list[dict], tools: list | None = None) -> str | None:
        """Where a conversation uses tools that this template drops from its text (SmolLM2's
        ChatML template renders neither tool declarations nor assistant tool calls), else None.

        Training on such a rendering would supervise an assistant turn without the call it made
        (or a prompt without the tools it was given): the record is refused instead.
        """
        declares, calls = self._tool_support()
        if tools and not declares:
            return "the target's chat template renders no tool declarations"
        if not calls and any(m.get("tool_calls") for m in messages):
            return "the target's chat template renders no assistant tool calls"
        return None

    def _tool_support(self) -> tuple[bool, bool]:
        """(renders tool declarations, renders assistant tool calls), probed once by rendering
        a made-up tool and call and looking for the tool's name and the call's arguments in
        the text (Kimi's template writes a call by its id and arguments, not its name)."""
        if not hasattr(self, "_tool_probe"):
            name, value = "probe_tool_4f1c", "probe_value_9d2e"
            tool = {"type": "function", "function": {
                "name": name, "description": "probe", "parameters": {
                    "type": "object", "properties": {"q": {"type": "string"}}}}}
            call = {"id": "call_0", "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"q": value})}}
            msgs = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [call]}]
            self._tool_probe = (self._renders(msgs[:1], [tool], name),
                                self._renders(msgs, [tool], value))
        return self._tool_probe

    def _renders(self, messages: list[dict], tools: list, needle: str) -> bool:
        try:
            return needle in self.render_text(messages, tools, add_generation_prompt=False)
        except RenderError:
            return False

    # ------------------------------------------------------------ rendering primitives

    def render_text(self, messages: list[dict], tools: list | None,
                    add_generation_prompt: bool) -> str:
        """The template's text for `messages`; template errors become RenderError."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except Exception as e:  # jinja raises TemplateError, TypeError, KeyError, ...
            raise RenderError(f"render error: the chat template failed ({type(e).__name__}: "
                              f"{str(e)[:200]})") from e

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` exactly as `tokenizer(text)` gives them (no added BOS/EOS)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render_ids(self, messages: list[dict], tools: list | None, add_generation_prompt: bool):
        """Token ids of `messages` rendered by the template (no extra special tokens)."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt))

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """What serving feeds the target to generate the next assistant turn."""
        return self.render_ids(messages, tools, add_generation_prompt=True)

    # ------------------------------------------------------------ samples

    def supervised_samples(self, messages: list[dict], tools: list | None = None):
        """Yield (input_ids, loss_mask, n_prompt_tokens) per sample (see the module doc)."""
        for s in self.samples(messages, tools):
            yield s.input_ids, s.loss_mask, s.n_prompt_tokens

    def samples(self, messages: list[dict], tools: list | None = None,
                exact: bool = False) -> list[Sample]:
        """The samples of a conversation, in order of their last message.

        Raises RenderError when a turn cannot be rendered as a continuation of its serving
        prompt, in text or in tokens. `exact` uses the reference tokenization (slow).
        """
        out = []
        for plan in self._plans(messages, tools):
            cuts = sorted({c for _, p, u in plan.turns for c in (p, u)})
            if exact:
                ids, at = self._encode_exact(plan.text, cuts)
            else:
                ids, at = self._encode_with_cuts(plan.text, cuts)
            mask = [0] * len(ids)
            for _, p, u in plan.turns:
                start, stop = at[p], at[u]
                end = _last_index(ids, self.end_of_turn_id, start, stop)
                # A template without an end-of-turn token: supervise all the turn added.
                stop = stop if end is None else end + 1
                mask[start:stop] = [1] * (stop - start)
            if not any(mask):
                raise RenderError("empty: the assistant turns add no token to supervise")
            first_prompt = at[plan.turns[0][1]]
            out.append(Sample(ids, mask, first_prompt, plan.last_message,
                              [i for i, _, _ in plan.turns],
                              [(at[p], at[u]) for _, p, u in plan.turns], plan.text))
        return out

    def _plans(self, messages: list[dict], tools: list | None) -> list[_Plan]:
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise RenderError("no assistant turn: nothing to supervise")
        prompt_text: dict[int, str] = {}
        upto_text: dict[int, str] = {}
        for i in turns:  # P_i and U_i do not depend on the sample: render each once
            prompt_text[i] = self.render_text(messages[:i], tools, add_generation_prompt=True)
            upto_text[i] = self.render_text(messages[: i + 1], tools, add_generation_prompt=False)
        plans, uncovered = [], list(turns)
        while uncovered:
            last = uncovered[-1]
            text = upto_text[last]
            covered = [i for i in uncovered
                       if text.startswith(prompt_text[i]) and text.startswith(upto_text[i])]
            if last not in covered:
                raise RenderError(
                    f"template mismatch: assistant turn {last} is not rendered as a "
                    "continuation of its serving prompt (the template rewrites the prompt "
                    "when the reply follows)")
            plans.append(_Plan(last, text, [(i, len(prompt_text[i]), len(upto_text[i]))
                                            for i in covered]))
            uncovered = [i for i in uncovered if i not in covered]
        return plans[::-1]

    # ------------------------------------------------------------ tokenization with cuts

    def _encode_exact(self, text: str, cuts: list[int]) -> tuple[list[int], dict[int, int]]:
        """Reference: tokenize the text and each prefix ending at a cut; prefixes must agree."""
        ids = self.encode(text)
        at = {len(text): len(ids)}
        for c in cuts:
            prefix = self.encode(text[:c])
            if ids[: len(prefix)] != prefix:
                raise RenderError(_token_mismatch(c))
            at[c] = len(prefix)
        return ids, at

    def _encode_with_cuts(self, text: str, cuts: list[int]) -> tuple[list[int], dict[int, int]]:
        """Tokenize `text` once, in pieces split at its hard cuts; map every cut to a token."""
        hard = [c for c in cuts if 0 < c < len(text) and self._is_hard_cut(text, c)]
        bounds = [0, *hard, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        piece_ids = self._encode_many(pieces)
        ids: list[int] = []
        at = {}
        starts = []
        for b, pid in zip(bounds, piece_ids + [[]]):
            at[b] = len(ids)
            starts.append(len(ids))
            ids.extend(pid)
        hard_set = set(bounds)
        k = 0
        for c in cuts:  # a soft cut: check it exactly within the piece that holds it
            if c in hard_set:
                continue
            while bounds[k + 1] < c:
                k += 1
            left = self.encode(text[bounds[k] : c])
            if piece_ids[k][: len(left)] != left:
                raise RenderError(_token_mismatch(c))
            at[c] = starts[k] + len(left)
        return ids, at

    def _encode_many(self, pieces: list[str]) -> list[list[int]]:
        if self._backend is not None:  # same ids as tokenizer(...), without its wrapping
            return [e.ids for e in self._backend.encode_batch(pieces, add_special_tokens=False)]
        return [self.encode(p) for p in pieces]

    def _probe_backend(self):
        """The `tokenizers` backend of a fast tokenizer, if it encodes exactly as the
        tokenizer's own call does on probes with special tokens; else None."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if not getattr(self.tokenizer, "is_fast", False) or not hasattr(backend, "encode_batch"):
            return None
        probes = ["Hello world", " x\n\ny ", self.tokenizer.eos_token or "", "{\"a\": [1, 2]}"]
        probes.append("".join(probes) + (self._anchors.probe_token() or ""))
        got = [e.ids for e in backend.encode_batch(probes, add_special_tokens=False)]
        return backend if got == [self.encode(p) for p in probes] else None

    def _is_hard_cut(self, text: str, c: int) -> bool:
        a = self._anchors
        if a.straddles(text, c):
            return False
        if a.starts_at(text, c):
            return True
        if self._cut_after_anchor:
            n = a.ends_at(text, c)
            return n > 0 and not a.straddles(text, c - n)
        return False

    def _probe_cut_after_anchor(self) -> bool:
        """True when text after an added token is tokenized as if it started a text.

        Tokenizers that mark the start of a text (SentencePiece `prepend_scheme="first"`, a
        prefix space) fail this, and then only cuts where an added token starts are hard.
        """
        anchor = self._anchors.probe_token()
        if anchor is None:
            return False
        for probe in ("Hello world", " leading space", "\nnew line", "x", "{\"a\": 1}"):
            if self.encode(anchor + probe) != self.encode(anchor) + self.encode(probe):
                log.info("tokenizer marks text starts; only cuts before added tokens are hard")
                return False
        return True


class _AddedTokens:
    """The tokenizer's added tokens as strings, for cut tests by position."""

    def __init__(self, tokenizer: Any):
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._anchors: dict[str, list[str]] = defaultdict(list)  # first char -> strings
        self._all: dict[str, list[str]] = defaultdict(list)
        self.max_len = 1
        self.special: list[str] = []  # strings of added tokens marked special
        for tok in decoder.values():
            content = str(getattr(tok, "content", tok))
            if not content:
                continue
            if getattr(tok, "special", False):
                self.special.append(content)
            self._all[content[0]].append(content)
            self.max_len = max(self.max_len, len(content))
            # Strip flags let an added token swallow neighbouring spaces: never a hard cut.
            stripping = any(getattr(tok, f, False) for f in ("lstrip", "rstrip", "single_word"))
            matched_raw = getattr(tok, "special", True) or not getattr(tok, "normalized", False)
            if not stripping and matched_raw:
                self._anchors[content[0]].append(content)
        for d in (self._anchors, self._all):
            for k in d:
                d[k].sort(key=len, reverse=True)

    def probe_token(self) -> str | None:
        return next((s for v in self._anchors.values() for s in v), None)

    def starts_at(self, text: str, pos: int) -> bool:
        return any(text.startswith(s, pos) for s in self._anchors.get(text[pos], ()))

    def ends_at(self, text: str, pos: int) -> int:
        """Length of an anchor token ending exactly at `pos` (0 if none)."""
        for start in range(max(0, pos - self.max_len), pos):
            for s in self._anchors.get(text[start], ()):
                if start + len(s) == pos and text.startswith(s, start):
                    return len(s)
        return 0

    def straddles(self, text: str, pos: int) -> bool:
        """True when an added token occurrence covers both sides of `pos`."""
        for start in range(max(0, pos - self.max_len + 1), pos):
            for s in self._all.get(text[start], ()):
                if start + len(s) > pos and text.startswith(s, start):
                    return True
        return False


def _last_index(ids: list[int], value: int, start: int, stop: int) -> int | None:
    for t in range(stop - 1, start - 1, -1):
        if ids[t] == value:
            return t
    return None


def _token_mismatch(c: int) -> str:
    return (f"token mismatch: the text up to char {c} tokenizes differently alone than inside "
            "the conversation, so serving would see other tokens")


def split_for_generation(messages: list[dict]) -> tuple[list[dict], dict | None]:
    """(prompt messages, reference reply) for regeneration.

    A conversation ending with an assistant turn is cut before that turn (the turn is the
    reference); one ending with any other turn (a prompt-only record) is the prompt whole.
    """
    if messages and messages[-1].get("role") == "assistant":
        return messages[:-1], messages[-1]
    return messages, None
