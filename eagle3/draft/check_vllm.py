"""A draft folder as vLLM serves it: which folder of 04's, its weights, and the layers vLLM
will capture for it against those 02b dumped (05 `--backend vllm`, eagle3/bench/vllm.py).

Layers (vLLM 0.32, `gpu_model_runner._get_eagle3_aux_layers_from_config` and
`interfaces.get_eagle3_default_aux_hidden_state_layers`): the draft config's top-level
`eagle_aux_hidden_state_layer_ids`, else `eagle_config.eagle_aux_hidden_state_layer_ids`, taken
as they are, sorted and deduplicated (`EagleModelMixin._set_aux_hidden_state_layers`); id i is
the state entering layer i (`hidden_states + residual` before layer i in `llama.py` and
`deepseek_v2.py`, HF `output_hidden_states[i]`). With neither, vLLM silently uses
`(2, L//2, L-3)`. So 04's SGLang folder (`final/`, ids = captures - 1) makes vLLM capture the
wrong layers; `final_speculators/` names the captures themselves. The speculative server's log
line "Using auxiliary layers from speculative config: (...)" is read back and checked too.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.core.hidden_states import read_capture_layers
from eagle3.core.preflight import Problem
from eagle3.core.stage import STAGE_DIRS, StageError, read_manifest
from eagle3.core.target import default_capture_layers, read_target_info
from eagle3.draft.check import read_draft_config, read_tensor_shapes
from eagle3.draft.export import draft_captures, draft_config_from_sglang, expected_tensors
from eagle3.draft.model import DraftConfig
from eagle3.draft.speculators import speculators_name


def default_vllm_draft(workdir: Path) -> Path:
    """The folder of 04's draft in `workdir` that vLLM serves: `final_speculators/` for the
    Llama-style draft, `final/` for the MLA one (04 writes no speculators folder for it: its
    DeepseekV2 folder is vLLM's too, eagle3/draft/mla_export.py). The architecture is read from
    04's manifest (`args.draft_arch`; manifests older than the option are Llama-style)."""
    stage_dir = Path(workdir) / STAGE_DIRS["04"]
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise StageError(f"{stage_dir}/manifest.json is missing, so 05 cannot tell which "
                                "draft folder 04 wrote for vLLM: run 04, or pass --draft")
    arch = (manifest.get("args") or {}).get("draft_arch", "llama")
    if arch not in ("llama", "mla"):
        raise StageError(f"{stage_dir}/manifest.json: draft_arch {arch!r} is neither llama nor "
                         "mla: pass --draft")
    return stage_dir / ("final" if arch == "mla" else "final_speculators")


def vllm_capture_layers(draft_config: dict, num_target_layers: int) -> tuple[list[int], str]:
    """(capture indices vLLM 0.32 uses for this draft config, "config" or "default")."""
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return sorted(set(int(i) for i in ids)), "config"
    n = num_target_layers
    return [2, n // 2, n - 3], "default"


def check_vllm_layers(draft_config: dict, num_target_layers: int,
                      expected: list[int] | None) -> tuple[list[Problem], str]:
    """An error when vLLM would capture other layers than the draft was trained on; the layer
    report line."""
    layers, source = vllm_capture_layers(draft_config, num_target_layers)
    report = (f"vLLM captures {layers} (" + ("eagle_aux_hidden_state_layer_ids of the config"
              if source == "config" else "no ids in the config: its default (2, L//2, L-3)") + ")")
    if expected is None or layers == sorted(expected):
        return [], report
    return [Problem("error", f"vLLM would capture layers {layers} ({source}) but the draft was "
                             f"trained on captures {list(expected)} (02b). vLLM reads the ids as "
                             "capture indices (state entering layer i): serve 04's "
                             "final_speculators/ folder, or write eagle_aux_hidden_state_layer_ids"
                             f" = {list(expected)} in the draft's config.json")], report


def _draft_shape_config(config: dict):
    """The DraftConfig of a draft config.json in the speculators or the SGLang layout (shapes
    only: capture layers are checked by check_vllm_layers)."""
    if config.get("speculators_model_type") != "eagle3":
        return draft_config_from_sglang(config)
    layer = config["transformer_layer_config"]
    return DraftConfig(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"])


def check_vllm_draft(draft_dir: Path, target_dir: Path, workdir: Path | None
                     ) -> tuple[list[Problem], str, list[int]]:
    """A draft folder as vLLM loads it (speculators layout, or SGLang's LlamaForCausalLMEagle3):
    every weight name and shape, and the layers vLLM will capture against those the draft was
    trained on (the folder's own `draft_captures`, else `<workdir>/02b_hidden_states/
    manifest.json`, else the default `[2, N//2, N-3]`).
    Returns (problems, layer report, the captures the draft was trained on)."""
    config = read_draft_config(draft_dir)
    info = read_target_info(target_dir)
    expected = default_capture_layers(info.num_hidden_layers)
    if workdir is not None:
        expected = read_capture_layers(workdir) or expected
    expected = draft_captures(config) or expected  # what the folder says it was trained on
    shapes = read_tensor_shapes(draft_dir)
    speculators = config.get("speculators_model_type") == "eagle3"
    problems = []
    for name, shape in expected_tensors(_draft_shape_config(config)).items():
        name = speculators_name(name) if speculators else name
        if name not in shapes:
            problems.append(Problem("error", f"{draft_dir}: no tensor {name}"))
        elif shapes[name][1] != shape:
            problems.append(Problem("error", f"{draft_dir}: {name} has shape {shapes[name][1]}, "
                                             f"vLLM expects {shape}"))
    if shapes.get("fc.weight", (None, (0, 0)))[1][1] != 3 * info.hidden_size:
        problems.append(Problem("error", f"{draft_dir}: fc.weight must take 3 x the target's "
                                         f"hidden size ({3 * info.hidden_size})"))
    layer_problems, report = check_vllm_layers(config, info.num_hidden_layers, expected)
    return problems + layer_problems, report, list(expected)
