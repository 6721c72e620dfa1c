"""Checks of an MLA draft folder (`Eagle3DeepseekV2ForCausalLM`, eagle3/draft/mla_export.py).

What goes wrong silently or late, read from the engines' sources (SGLang 0.5.23
kimi_k25_eagle3.py, vLLM 0.32 deepseek_eagle3.py and config/speculative.py):
- `model_type: deepseek_v3`: vLLM rewrites the draft config to its MTP class and fails at start;
- no `q_lora_rank`: SGLang raises ("Eagle3 MLA layer requires q_lora_rank");
- `num_hidden_layers` != 1: SGLang raises ("EAGLE3 currently only supports 1 layer");
- a latent (`kv_lora_rank + qk_rope_head_dim`) other than the target's: vLLM needs one KV page
  size for the target and the draft (on CPU, the only MLA latent it has is 576); the draft
  exists to share the target's MLA cache layout;
- a top-level `eagle_aux_hidden_state_layer_ids` that disagrees with `eagle_config`'s (read as
  SGLang reads them): vLLM and SGLang would feed the draft different target layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.draft.mla import MLA_FIELDS
from eagle3.draft.mla_export import MLA_ARCHITECTURE, MLA_MODEL_TYPE

MLA_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "hidden_size", "num_attention_heads", "intermediate_size",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "num_hidden_layers",
    "tie_word_embeddings", "draft_vocab_size", "target_hidden_size", "eagle_config",
    *MLA_FIELDS,
})
FIX = ("write the folder with eagle3.draft.export.export_sglang of an MLA draft, as "
       "04_train.py --draft-arch mla does (04_train/final)")


def is_mla_draft(config: dict) -> bool:
    return MLA_ARCHITECTURE in (config.get("architectures") or [])


def check_mla_config(config: dict) -> list[tuple[str, str]]:
    """(level, message) problems of an MLA draft config.json on its own."""
    problems = []
    missing = sorted(k for k in MLA_CONFIG_KEYS if config.get(k) is None)
    if missing:
        why = (" (SGLang raises \"Eagle3 MLA layer requires q_lora_rank\")"
               if "q_lora_rank" in missing else "")
        return [("error", f"config.json lacks {missing}{why}. {FIX}")]
    if config["model_type"] != MLA_MODEL_TYPE:
        why = (": vLLM rewrites a deepseek_v3 draft config to its MTP draft "
               "(Eagle3DeepSeekMTPModel) and fails" if config["model_type"] == "deepseek_v3"
               else "")
        problems.append(("error", f"config.json model_type={config['model_type']!r}{why}; an "
                                  f"MLA EAGLE-3 draft needs {MLA_MODEL_TYPE!r}. {FIX}"))
    if config["num_hidden_layers"] != 1:
        problems.append(("error", f"config.json num_hidden_layers={config['num_hidden_layers']}:"
                                  " SGLang's EAGLE-3 MLA draft has exactly 1 layer (it raises "
                                  f"otherwise). {FIX}"))
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is None:
        problems.append(("error", "config.json has no top-level eagle_aux_hidden_state_layer_ids: "
                                  "vLLM then captures its default layers, not the trained ones. "
                                  + FIX))
    return problems


def target_mla_dims(target_dir: Path) -> dict | None:
    """The target's MLA sizes, or None for a target without MLA."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return {k: cfg[k] for k in MLA_FIELDS} if all(cfg.get(k) for k in MLA_FIELDS) else None


def check_mla_against_target(config: dict, target_dir: Path) -> list[tuple[str, str]]:
    """An MLA draft against its target: the target uses MLA with the same latent layout."""
    dims = target_mla_dims(target_dir)
    if dims is None:
        return [("error", f"the target {target_dir} does not use multi-latent attention: an MLA "
                          "draft shares the target's MLA cache layout; train --draft-arch llama")]
    cache = ("kv_lora_rank", "qk_rope_head_dim")
    wrong = {k: (config.get(k), dims[k]) for k in cache if config.get(k) != dims[k]}
    if not wrong:
        return []
    detail = ", ".join(f"{k}={d} (target {t})" for k, (d, t) in wrong.items())
    return [("error", f"draft {detail}: the draft's latent "
                      f"({config.get('kv_lora_rank', 0) + config.get('qk_rope_head_dim', 0)}) "
                      f"differs from the target's MLA cache "
                      f"({dims['kv_lora_rank'] + dims['qk_rope_head_dim']}); vLLM needs one KV "
                      "page size for both. Retrain with the target's sizes (04 --draft-arch mla "
                      "takes them from the target by default)")]
