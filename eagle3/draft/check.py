"""Checking a draft folder as SGLang will load it (the folder `eagle3/draft/export.py` writes).

Only the safetensors header is read (shapes and dtypes), so a multi-GB draft is checked in
milliseconds. SGLang loads weights by name and silently leaves any name it does not know randomly
initialised, so every expected name and shape is checked, and which capture layers the config's
`eagle_aux_hidden_state_layer_ids` name on each release (`eagle3/draft/layers.py`).
`check_vocab_coverage`: the share of supervised eval tokens the draft vocabulary can propose,
over the target-written ones where the eval split has any (eagle3/vocab/mapping.py
`record_origin`): dataset-written text is not what serving proposes.
An MLA draft (`Eagle3DeepseekV2ForCausalLM`) is checked by its own rules too
(`eagle3/draft/check_mla.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from eagle3.core.preflight import PreflightError, Problem
from eagle3.draft.check_mla import check_mla_against_target, check_mla_config, is_mla_draft
from eagle3.draft.export import (
    CONFIG_KEYS,
    draft_captures,
    draft_config_from_sglang,
    expected_tensors,
)
from eagle3.draft.layers import LayerIdError, captures_by_rule, describe_layers, layer_ids_for

log = logging.getLogger(__name__)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Below this share of supervised eval tokens inside the draft vocabulary, every miss ends a chain
# early often enough to cost a visible part of the acceptance length.
MIN_VOCAB_COVERAGE = 0.9
EXPORT_FIX = ("write the folder with eagle3.draft.export.export_sglang, as 04_train.py does at the "
              "end of training (04_train/final)")


def read_draft_config(draft_dir: Path) -> dict:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise PreflightError(f"{path} not found: --draft must be the folder 04 writes "
                             "(<workdir>/04_train/final)")
    return json.loads(path.read_text())


def read_tensor_shapes(draft_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a draft's safetensors file(s), from the headers only."""
    from safetensors import safe_open

    draft_dir = Path(draft_dir)
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({draft_dir / f for f in weight_map.values()})
    else:
        files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise PreflightError(f"{draft_dir} holds no *.safetensors: SGLang would start the draft "
                             f"with random weights. {EXPORT_FIX}")
    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                shapes[name] = (s.get_dtype(), tuple(s.get_shape()))
    return shapes


def is_eagle3_draft(config: dict) -> bool:
    arch = config.get("architectures") or []
    return EAGLE3_ARCHITECTURE in arch or is_mla_draft(config) or bool(
        (config.get("eagle_config") or {}).get("use_aux_hidden_state"))


def check_draft(draft_dir: Path, target_hidden_size: int | None = None,
                target_vocab_size: int | None = None,
                expected_captures: list[int] | None = None,
                sglang_version: str | None = None) -> list[Problem]:
    """A draft folder as SGLang loads it: config keys, every weight name and shape, `d2t`,
    and which capture layers its `eagle_aux_hidden_state_layer_ids` name on `sglang_version`
    (both reading rules when None) against `expected_captures` (what it was trained on)."""
    config = read_draft_config(draft_dir)
    problems = _check_config(config, target_hidden_size, target_vocab_size)
    if any(p.level == "error" for p in problems):
        return problems  # shapes cannot be derived from a broken config
    shapes = read_tensor_shapes(draft_dir)
    problems += _check_weights(config, shapes, target_hidden_size)
    problems += _check_layer_ids(config, expected_captures, sglang_version)
    top = config.get("eagle_aux_hidden_state_layer_ids")  # vLLM's reading (MLA folders)
    if is_mla_draft(config) and expected_captures is not None and top != list(expected_captures):
        problems.append(Problem("error", f"top-level eagle_aux_hidden_state_layer_ids={top}: vLLM "
                                f"captures those, but the draft was trained on captures "
                                f"{list(expected_captures)}. Write them as they are there"))
    return problems


def _check_config(config: dict, target_hidden: int | None, target_vocab: int | None):
    problems = []
    arch = config.get("architectures") or []
    if is_mla_draft(config):
        problems = [Problem(level, msg) for level, msg in check_mla_config(config)]
        if problems:
            return problems
    elif EAGLE3_ARCHITECTURE not in arch:
        problems.append(Problem("error", f"config.json architectures={arch}: SGLang picks the "
                                f"draft class from it; an EAGLE-3 draft needs "
                                f"[\"{EAGLE3_ARCHITECTURE}\"]. {EXPORT_FIX}"))
    missing = [] if is_mla_draft(config) else sorted(CONFIG_KEYS - set(config))
    if missing:
        problems.append(Problem("error", f"config.json lacks {missing}. {EXPORT_FIX}"))
        return problems
    eagle = config["eagle_config"] or {}
    if not eagle.get("use_aux_hidden_state") or len(
            eagle.get("eagle_aux_hidden_state_layer_ids") or []) != 3:
        problems.append(Problem("error", "config.json eagle_config needs use_aux_hidden_state: "
                                "true and three eagle_aux_hidden_state_layer_ids, else SGLang "
                                f"feeds the draft one hidden state. {EXPORT_FIX}"))
    if target_hidden is not None and config["target_hidden_size"] != target_hidden:
        problems.append(Problem("error", f"config.json target_hidden_size="
                                f"{config['target_hidden_size']} but the target's hidden size is "
                                f"{target_hidden}: this draft was trained for another target"))
    if target_vocab is not None and config["vocab_size"] != target_vocab:
        problems.append(Problem("error", f"config.json vocab_size={config['vocab_size']} but the "
                                f"target's vocabulary has {target_vocab} ids: this draft was "
                                "trained for another target (or 03 used the wrong tokenizer)"))
    return problems


def _check_weights(config: dict, shapes: dict, target_hidden: int | None) -> list[Problem]:
    problems = []
    expected = expected_tensors(draft_config_from_sglang(config))
    hidden = target_hidden or config["target_hidden_size"]
    fc = shapes.get("fc.weight")
    fc_width_wrong = fc is not None and fc[1][-1] != 3 * hidden
    if fc_width_wrong:
        why = (" — one hidden state, not three: an EAGLE-1/2 draft or one trained on the final "
               "state only" if fc[1][-1] == hidden else "")
        problems.append(Problem("error", f"fc.weight is {list(fc[1])}: its input is "
                                f"{fc[1][-1]} wide{why}; an EAGLE-3 draft for a {hidden}-wide "
                                "target reads the 3 aux states concatenated, "
                                f"[{config['hidden_size']}, {3 * hidden}]. Retrain on 02b's aux "
                                "states (three capture layers) with 04_train.py"))
    unknown = sorted(set(shapes) - set(expected))
    for name, shape in expected.items():
        if name == "fc.weight" and fc_width_wrong:
            continue  # reported above
        if name not in shapes:
            near = [u for u in unknown if _same_tail(u, name)]
            hint = f" (found {near}: a misnamed copy)" if near else ""
            problems.append(Problem("error", f"weight {name!r} {list(shape)} is missing{hint}: "
                                    "SGLang would leave it randomly initialised without a word. "
                                    + EXPORT_FIX))
        elif shapes[name][1] != shape:
            problems.append(Problem("error", _shape_message(name, shapes[name][1], shape, config)))
    if "d2t" in shapes and shapes["d2t"][0] != "I64":
        problems.append(Problem("error", f"d2t is {shapes['d2t'][0]}, SGLang adds it to draft ids "
                                "as int64 offsets. Rebuild it with 03_build_vocab_mapping.py"))
    if unknown:
        problems.append(Problem("warning", f"tensors {unknown} are not draft weights SGLang "
                                "knows; it skips them silently"))
    return problems


def _same_tail(a: str, b: str) -> bool:
    """Names ending in the same two components ("model.norm.weight" vs "norm.weight")."""
    k = min(2, len(b.split(".")))
    return a.split(".")[-k:] == b.split(".")[-k:]


def _shape_message(name: str, found: tuple, want: tuple, config: dict) -> str:
    if name in ("d2t", "t2d"):
        key = "draft_vocab_size" if name == "d2t" else "vocab_size"
        return (f"{name} has {found[0]} entries but config.json {key} is {config[key]}: the "
                f"vocab mapping does not belong to this draft. Rebuild 03 with --draft-vocab "
                f"{config['draft_vocab_size']} (and retrain), or fix {key}")
    return (f"weight {name!r} is {list(found)}, config.json implies {list(want)}: the config "
            f"and the weights disagree. {EXPORT_FIX}")


def _check_layer_ids(config: dict, expected: list[int] | None,
                     sglang_version: str | None) -> list[Problem]:
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    try:
        reads = captures_by_rule(ids, sglang_version)
    except LayerIdError as e:
        return [Problem("error", str(e))]
    if expected is None:
        if len({tuple(r) for r in reads.values()}) > 1:
            return [Problem("warning", f"{describe_layers(ids)}: the layers depend on the SGLang "
                                       "release; pass the target (or the release) to check them")]
        return []
    wrong = {rule: got for rule, got in reads.items() if got != list(expected)}
    if not wrong:
        return []
    try:
        fix = f"write {layer_ids_for(list(expected), sglang_version)} (capture index - 1)"
    except LayerIdError as e:
        fix = str(e)
    detail = "; ".join(f"SGLang {rule} captures {got}" for rule, got in wrong.items())
    return [Problem("error", f"eagle_aux_hidden_state_layer_ids={ids}: {detail}, but the draft "
                             f"was trained on captures {list(expected)}. In config.json {fix} "
                             "(eagle3.draft.export.export_sglang writes ids every release reads "
                             "alike)")]


def load_t2d(draft_dir: Path):
    """The draft's `t2d` (bool `[target vocab]`: which target ids the draft can propose)."""
    from safetensors import safe_open

    for file in sorted(Path(draft_dir).glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            if "t2d" in f.keys():
                return f.get_tensor("t2d")
    raise PreflightError(f"{draft_dir}: no t2d tensor in its safetensors. {EXPORT_FIX}")


def check_vocab_coverage(t2d, records: Iterable[dict],
                         threshold: float = MIN_VOCAB_COVERAGE) -> tuple[float, list[Problem]]:
    """(share of supervised tokens whose id is in the draft vocabulary, warnings).

    `t2d`: bool array `[target vocab]`; `records`: tokenized records (input_ids, loss_mask).
    """
    import numpy as np

    t2d = np.asarray(t2d, dtype=bool)
    total = inside = 0
    for rec in records:
        ids = np.asarray(rec["input_ids"], dtype=np.int64)[np.asarray(rec["loss_mask"]) == 1]
        total += ids.size
        inside += int(t2d[ids].sum())
    coverage = inside / total if total else 1.0
    if coverage < threshold:
        return coverage, [Problem("warning", f"the draft vocabulary covers {coverage:.1%} of the "
                                  f"supervised eval tokens (< {threshold:.0%}): every other token "
                                  "ends a draft chain. Rebuild 03 with a larger --draft-vocab "
                                  "(03_vocab/report.json lists coverage at 8K-64K) and retrain")]
    return coverage, []


def check_draft_for_run(draft_dir: Path, target_dir: Path | None = None,
                        workdir: Path | None = None,
                        sglang_version: str | None = None) -> tuple[list[Problem], str]:
    """`check_draft` with what a pipeline run knows, and the layer report line.

    The target folder gives the hidden size, the vocabulary and SGLang's default captures
    `[2, N//2, N-3]`; the captures the draft was trained on come from the draft folder itself
    (`draft_captures`), else from `<workdir>/02b_hidden_states/manifest.json`;
    `<workdir>/01c_merged/eval.jsonl` gives the draft vocabulary's coverage of held-out
    supervised tokens.
    """
    from eagle3.core.hidden_states import read_capture_layers
    from eagle3.core.records import read_jsonl
    from eagle3.core.stage import STAGE_DIRS
    from eagle3.core.target import default_capture_layers, read_target_info

    hidden = vocab = expected = None
    if target_dir is not None:
        info = read_target_info(target_dir)
        hidden, vocab = info.hidden_size, info.vocab_size
        expected = default_capture_layers(info.num_hidden_layers)
    if workdir is not None:
        expected = read_capture_layers(workdir) or expected
    expected = draft_captures(read_draft_config(draft_dir)) or expected  # what it says itself
    problems = check_draft(draft_dir, hidden, vocab, expected, sglang_version)
    if target_dir is not None and is_mla_draft(read_draft_config(draft_dir)):
        problems += [Problem(level, msg) for level, msg in
                     check_mla_against_target(read_draft_config(draft_dir), target_dir)]
    eval_path = Path(workdir) / STAGE_DIRS["merge"] / "eval.jsonl" if workdir is not None else None
    if eval_path is not None and eval_path.is_file() and not any(
            p.level == "error" for p in problems):
        from eagle3.vocab.mapping import record_origin, regenerated_datasets

        regenerated = regenerated_datasets(workdir)
        records = list(read_jsonl(eval_path))
        written = [r for r in records if record_origin(r, regenerated) == "target"]
        basis = "target-written" if written else "(none target-written: all)"
        coverage, warnings = check_vocab_coverage(load_t2d(draft_dir), written or records)
        log.info("draft vocabulary covers %.1f%% of %s supervised eval tokens", 100 * coverage,
                 basis)
        problems += warnings
    ids = (read_draft_config(draft_dir).get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    try:
        return problems, describe_layers(ids, sglang_version) if ids else "no layer ids"
    except LayerIdError as e:
        return problems, str(e)
