"""Which target layers a draft config's `eagle_aux_hidden_state_layer_ids` make SGLang capture.

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` from the draft config.json and turns
them into capture indices (index i = the residual stream entering decoder layer i,
docs/PIPELINE.md).
The rule changed between releases; `SGLANG_LAYER_RULES` is the one table of it, used by the
export (04), the draft check (05, reference/) and the docs. Writing "capture index - 1"
([1, 29, 57] for captures [2, 30, 58]) names the same captures on every release, as long as the
first capture is 2 (SGLang's default); other layouts depend on the release and are refused
unless a release is named.
"""

from __future__ import annotations

from dataclasses import dataclass

# The key of a draft config's `eagle_config` that names the captures the draft was trained on
# (04 writes it; SGLang and vLLM ignore it; eagle3.draft.export.draft_captures reads it).
TRAINED_CAPTURES = "trained_capture_layers"


class LayerIdError(ValueError):
    """Layer ids no SGLang release (or not the named one) reads as the wanted captures."""


@dataclass(frozen=True)
class LayerRule:
    name: str  # the releases it covers, as the docs and reports write them
    first: tuple[int, int, int]  # first release (major, minor, patch) that reads ids this way
    example: str  # a release of the range, as a version string
    shift_only_when_first_is_1: bool  # False: always add 1; True: add 1 only if ids[0] == 1


# Oldest first. Before the first entry (0.5.4.post2) the draft config's ids are not read at all.
SGLANG_LAYER_RULES = (
    LayerRule("0.5.4.post2-0.5.12", (0, 5, 4), "0.5.12", shift_only_when_first_is_1=False),
    LayerRule(">= 0.5.13", (0, 5, 13), "0.5.13", shift_only_when_first_is_1=True),
)


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release string; suffixes like ".post2" or "rc1" are dropped."""
    parts = version.split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:3])  # type: ignore


def rule_for(version: str) -> LayerRule:
    """The rule an SGLang release applies to the draft config's layer ids."""
    v = parse_version(version)
    for rule in reversed(SGLANG_LAYER_RULES):
        if v >= rule.first:
            return rule
    raise LayerIdError(f"SGLang {version} predates 0.5.4.post2: EAGLE-3 aux layer ids from the "
                       "draft config are not supported; upgrade SGLang (>= 0.5.10 for Kimi-K2.5)")


def sglang_capture_layers(layer_ids: list[int], version: str) -> list[int]:
    """The capture indices an SGLang release derives from `eagle_aux_hidden_state_layer_ids`."""
    rule = rule_for(version)
    if rule.shift_only_when_first_is_1 and not (layer_ids and layer_ids[0] == 1):
        return list(layer_ids)
    return [i + 1 for i in layer_ids]


def layer_ids_for(capture_layers: list[int], sglang_version: str | None = None) -> list[int]:
    """Ids to write so that SGLang captures `capture_layers`.

    Without a version, the ids must work on every release; with one, for that release only.
    """
    candidate = [i - 1 for i in capture_layers]
    versions = ([sglang_version] if sglang_version
                else [rule.example for rule in SGLANG_LAYER_RULES])
    for attempt in (candidate, list(capture_layers)):
        if all(sglang_capture_layers(attempt, v) == list(capture_layers) for v in versions):
            return attempt
    raise LayerIdError(
        f"no layer ids make every SGLang release capture {capture_layers} (only a first capture "
        "layer of 2 is read the same by 0.5.4.post2-0.5.12 and >= 0.5.13): pass "
        "--sglang-version with the release that will serve the draft"
    )


def captures_by_rule(layer_ids: list[int], sglang_version: str | None = None) -> dict[str, list]:
    """{rule name or the release: capture indices} for one release, or for every rule."""
    if sglang_version:
        return {sglang_version: sglang_capture_layers(layer_ids, sglang_version)}
    return {rule.name: sglang_capture_layers(layer_ids, rule.example)
            for rule in SGLANG_LAYER_RULES}


def describe_layers(layer_ids: list[int], sglang_version: str | None = None) -> str:
    """Which target layers a draft reads, on one SGLang release or under every rule."""
    if sglang_version:
        got = sglang_capture_layers(layer_ids, sglang_version)
        return (f"eagle_aux_hidden_state_layer_ids={layer_ids}: SGLang {sglang_version} captures "
                f"{got} (the residual entering those layers = outputs of layers "
                f"{[i - 1 for i in got]})")
    reads = ", ".join(f"SGLang {rule} captures {got}"
                      for rule, got in captures_by_rule(layer_ids).items())
    return f"eagle_aux_hidden_state_layer_ids={layer_ids}: {reads}"
