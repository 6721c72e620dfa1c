"""Steering what the target writes in the self-written source (eagle3/prepare/selfwritten.py):
each candidate user turn gets its own draw of labelled options (a task type, a topic, a format, a
length, a persona, ... : the recipe names the axes) and the target writes after an opening that
holds them ("Magpie", Xu et al. 2024, steers its domains by the system prompt the same way).

The recipe's `steer` block (inside `self_written`):

    "steer": {"share": 0.9, "keep_system": false,
              "system": "The user is {persona}. They ask {task} about {topic}, {length}.",
              "prefix": null,
              "axes": {"task": [["code", "for help with a program", 2.0], ...],
                       "topic": [["cooking", "cooking", 1.0], ...], ...}}

- `axes`: name -> options `[label, text, weight]`; one option per axis is drawn (by weight) for
  each steered candidate, seeded by the dataset's seed and name, the round and the candidate's
  place in it: the same recipe draws the same steers.
- `system`: the system prompt of the opening, `{axis}` replaced by the drawn option's text
  (literal braces doubled). The template must render it (checked before 01 starts).
- `prefix`: the first words of the user turn, which the target continues (kept in the user
  turn); first user turns only.
- `share`: the share of candidates steered; the others get the plain opening.
- `keep_system`: the steering system prompt stays in the written conversation (and so in 01b's
  prompt and the draft's training context); false (default) keeps the recipe's `system` (or the
  template's default) there, and the steer only shapes the user turns.
Every record written under a steer carries `"steer": {axis: label}` (the held-out prompts too),
which `eagle3.prepare.diversity` counts.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Any

from eagle3.core.chat import ChatRenderer
from eagle3.generate.jobs import seed_of
from eagle3.prepare.opening import TemplateCutError, derive_opening


@dataclass(frozen=True)
class Draw:
    """One candidate's steer: the labels drawn, the system prompt and user-turn prefix made."""

    labels: dict  # axis -> label
    system: str | None  # the opening's system prompt; None = unsteered (the spec's own)
    prefix: str  # what the user turn starts with ("" = nothing)


UNSTEERED = Draw({}, None, "")


def placeholders(template: str) -> set[str]:
    """The `{name}` fields of a template (ValueError on a malformed one, or on a field with a
    conversion or format spec: `{name!r}`, `{name:>8}`)."""
    names = set()
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is not None:
            if spec or conversion:
                raise ValueError(f"{{{name}}} takes no conversion or format spec")
            names.add(name)
    return names


@dataclass
class SteerSpec:
    """The `steer` block of a `self_written` recipe entry (see the module doc)."""

    axes: dict = field(default_factory=dict)  # name -> [[label, text, weight], ...]
    system: str | None = None  # system prompt template over the axes
    prefix: str | None = None  # user-turn start template over the axes
    share: float = 1.0  # share of candidates steered, (0, 1]
    keep_system: bool = False  # the steering system prompt stays in the conversation

    def __post_init__(self) -> None:
        def bad(msg: str):
            raise ValueError(f"self_written.steer: {msg}")

        if not isinstance(self.axes, dict) or not self.axes:
            bad("axes must name at least one axis: {name: [[label, text, weight], ...]}")
        axes = {}
        for name, options in self.axes.items():
            if not (isinstance(name, str) and name.isidentifier()):
                bad(f"axis name {name!r} must be an identifier (it is a {{placeholder}})")
            try:
                opts = [(str(lab), str(text), float(w)) for lab, text, w in options]
            except (TypeError, ValueError):
                bad(f"axis {name}: options must be [[label, text, weight], ...], got "
                    f"{options!r}")
            if not opts or any(w <= 0 or not lab.strip() for lab, _, w in opts):
                bad(f"axis {name}: needs options with a label and a weight > 0, got {options!r}")
            if len({lab for lab, _, _ in opts}) != len(opts):
                bad(f"axis {name}: labels repeat")
            axes[name] = [[lab, text, w] for lab, text, w in opts]
        self.axes = axes
        if self.system is None and self.prefix is None:
            bad("set system and/or prefix: a template that uses the axes")
        used: set[str] = set()
        for key in ("system", "prefix"):
            template = getattr(self, key)
            if template is None:
                continue
            if not isinstance(template, str) or not template.strip():
                bad(f"{key} must be a non-empty string or null")
            try:
                names = placeholders(template)
            except ValueError as e:
                bad(f"{key} is not a valid template ({e}); write literal braces as {{{{ }}}}")
            if any(not n.isidentifier() for n in names) or names - set(self.axes):
                bad(f"{key} uses {sorted(names - set(self.axes))}, which are no axes; axes: "
                    f"{sorted(self.axes)}")
            used |= names
        if set(self.axes) - used:
            bad(f"axes {sorted(set(self.axes) - used)} are used by neither system nor prefix")
        if not 0 < self.share <= 1:
            bad(f"share must be in (0, 1], got {self.share}")
        if not isinstance(self.keep_system, bool):
            bad(f"keep_system must be true or false, got {self.keep_system!r}")
        if self.keep_system and self.system is None:
            bad("keep_system needs a system template")

    @classmethod
    def from_json(cls, block: Any) -> "SteerSpec":
        if not isinstance(block, dict):
            raise ValueError(f"self_written.steer must be an object, got {block!r}")
        known = set(cls.__dataclass_fields__)
        if set(block) - known:
            raise ValueError(f"self_written.steer has unknown fields "
                             f"{sorted(set(block) - known)}; known: {sorted(known)}")
        return cls(**block)

    def draw(self, *where) -> Draw:
        """The steer of the candidate named by `where` (dataset seed, name, round, place)."""
        rng = random.Random(seed_of(*where, "steer"))
        if rng.random() >= self.share:
            return UNSTEERED
        labels, texts = {}, {}
        for name, options in self.axes.items():
            label, text, _ = rng.choices(options, [w for _, _, w in options])[0]
            labels[name], texts[name] = label, text
        return Draw(labels, self.system.format_map(texts) if self.system else None,
                    self.prefix.format_map(texts) if self.prefix else "")

    def first_draw(self) -> Draw:
        """The first option of every axis (the template check's example)."""
        texts = {name: options[0][1] for name, options in self.axes.items()}
        return Draw({name: options[0][0] for name, options in self.axes.items()},
                    self.system.format_map(texts) if self.system else None,
                    self.prefix.format_map(texts) if self.prefix else "")


def check_steer(renderer: ChatRenderer, steer: SteerSpec) -> None:
    """TemplateCutError when the template cannot open a user turn after a steering system
    prompt, or drops it (then the steer would change nothing the target sees)."""
    if steer.system is None:
        return
    draw = steer.first_draw()
    opening = derive_opening(renderer, draw.system)
    if draw.system not in opening.text:
        raise TemplateCutError(
            f"the chat template of {getattr(renderer.tokenizer, 'name_or_path', '') or 'the target'}"
            f" does not render the steer's system prompt {draw.system[:60]!r} (it drops or "
            "rewrites system turns): steer with `prefix` instead")
