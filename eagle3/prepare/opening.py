"""Where a user turn opens in the target's own chat template: the text an aligned chat model
continues to write a user request itself (the self-written source, eagle3/prepare/selfwritten.py;
"Magpie", Xu et al. 2024).

The cut is found by rendering, never written by hand: render the conversation so far plus a user
turn holding a sentinel (no generation prompt) and cut right before the sentinel. Two different
sentinels must give the same text before and after it, and what follows the text must start
with a special token (ChatML's and Kimi's `<|im_end|>`): sampling stops there. A template that
transforms the text, whose opening depends on the text, that fails to render a user turn, or
that closes a user turn with plain text (Llama 2's `[/INST]`) cannot be cut: `TemplateCutError`
names the template and why.

ChatML (SmolLM2, default system prompt):
    `<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging
    Face<|im_end|>\\n<|im_start|>user\\n` ... `<|im_end|>`
Kimi-K2.5:
    `<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot
    AI.<|im_end|><|im_user|>user<|im_middle|>` ... `<|im_end|>`
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.core.chat import ChatRenderer, RenderError

SENTINELS = ("xqzsentinelalpha7", "kwvsentinelbravozulu3")  # of two lengths: a template that
# renders the length is caught too


class TemplateCutError(ValueError):
    """The target's chat template cannot be cut before a user turn's text; the message names
    the template and why."""


def template_name(renderer: ChatRenderer) -> str:
    return f"the chat template of {getattr(renderer.tokenizer, 'name_or_path', '') or 'the target'}"


def user_turn_cut(renderer: ChatRenderer, history: list[dict]) -> tuple[str, str]:
    """(text before, text after) the content of a new user turn after `history`, as the
    template renders it; TemplateCutError when it cannot be cut there."""
    name = template_name(renderer)
    cuts = []
    for s in SENTINELS:
        try:
            text = renderer.render_text(history + [{"role": "user", "content": s}], None,
                                        add_generation_prompt=False)
        except RenderError as e:
            raise TemplateCutError(f"{name} fails to render a user turn ({e})") from e
        if text.count(s) != 1:
            raise TemplateCutError(
                f"{name} does not render a user's text verbatim once (a sentinel appears "
                f"{text.count(s)} times in {text[-120:]!r}), so no opening can be cut from it")
        i = text.index(s)
        cuts.append((text[:i], text[i + len(s):]))
    if cuts[0][0] != cuts[1][0]:
        raise TemplateCutError(f"{name}: the text before a user turn's content depends on the "
                               "content, so no opening can be cut from it")
    if cuts[0][1] != cuts[1][1]:
        raise TemplateCutError(f"{name}: the text after a user turn's content depends on the "
                               "content, so its end cannot be found")
    return cuts[0]


@dataclass
class Opening:
    """The first user turn's opening and the token that closes a user turn."""

    text: str  # the rendered text up to the user's content
    ids: list[int]  # its token ids: what the target continues
    end_of_turn: str  # the special token that closes a user turn
    stop_ids: list[int]  # generation stops at these: the closing token, then eos


def derive_opening(renderer: ChatRenderer, system: str | None) -> Opening:
    """The opening of the first user turn (system prompt `system`, or the template's own when
    None); TemplateCutError when the template cannot be cut or nothing special closes a turn."""
    tok = renderer.tokenizer
    history = [{"role": "system", "content": system}] if system else []
    prefix, suffix = user_turn_cut(renderer, history)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items()
                                          if t.special}
    after = renderer.encode(suffix) if suffix else []
    if not after or after[0] not in special:
        raise TemplateCutError(
            f"{template_name(renderer)}: no special token closes a user turn (after the text "
            f"comes {suffix[:40]!r}), so sampling could not stop at its end")
    stops = [after[0]] + ([tok.eos_token_id] if tok.eos_token_id not in (None, after[0])
                          else [])
    return Opening(prefix, renderer.encode(prefix), tok.convert_ids_to_tokens(after[0]), stops)


def next_user_ids(renderer: ChatRenderer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` followed by the opening of a further user turn."""
    return renderer.encode(user_turn_cut(renderer, messages)[0])
