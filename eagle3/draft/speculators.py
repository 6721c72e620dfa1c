"""The draft in the `speculators` format (vLLM: `--speculative-config '{"model": DIR}'`).

Layout of speculators 0.9 (`Eagle3DraftModel`, `speculators_model_type: "eagle3"`): `config.json`
with a Llama `transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` and a `speculators_config` (algorithm, greedy proposal of
`speculative_tokens`, verifier); `model.safetensors` with `fc.weight`, `layers.0.*` (our
`midlayer.*`), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. No embedding: the verifier's is
loaded at serving time.

Layer ids: speculators and vLLM name the capture index directly (the residual stream entering
layer i, i.e. transformers' `output_hidden_states[i]`; the default is `[2, N//2, N-3]`), so the
capture layers are written as they are — unlike SGLang's config (see export.py). The speculators
package is not needed to write this folder; tests load it with that package's own loader.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3.core.stage import atomic_save_safetensors, atomic_write_json
from eagle3.draft.model import DraftConfig, Eagle3Draft

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"  # the release whose format and loader this is checked against


def speculators_name(name: str) -> str:
    """Our (SGLang) tensor name -> the speculators name."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def speculators_config(cfg: DraftConfig, verifier: str | None, steps: int,
                       verifier_architectures: list[str] | None = None) -> dict:
    """config.json of a speculators Eagle-3 draft (Llama layer only)."""
    if cfg.arch != "llama":
        raise ValueError(f"no speculators format for a {cfg.arch!r} draft: vLLM's speculators "
                         "reader maps only Llama/Qwen3 layers (update_eagle3); vLLM serves the "
                         "MLA draft's SGLang folder itself (eagle3/draft/mla_export.py)")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": verifier_architectures or ["DeepseekV3ForCausalLM"]},
        },
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,  # transformers < 5 and readers of the flat key
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.capture_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,  # EAGLE-3.1: vLLM's update_eagle3 copies both switches
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "torch_dtype": "bfloat16",
    }


def export_speculators(draft: Eagle3Draft, out_dir: Path, verifier: str | None,
                       steps: int) -> Path:
    """Write config.json + model.safetensors (bf16 weights, int64 d2t, bool t2d)."""
    import json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    architectures = None
    if verifier is not None and (Path(verifier) / "config.json").is_file():
        architectures = json.loads((Path(verifier) / "config.json").read_text()).get(
            "architectures")
    tensors = {}
    for name, t in draft.state_dict().items():
        t = t.detach().cpu()
        tensors[speculators_name(name)] = (t.to(torch.bfloat16) if t.is_floating_point()
                                           else t).contiguous()
    atomic_save_safetensors(tensors, out_dir / "model.safetensors", {"format": "pt"})
    atomic_write_json(out_dir / "config.json",
                      speculators_config(draft.cfg, verifier, steps, architectures))
    log.info("exported the speculators-format draft to %s (eagle_aux_hidden_state_layer_ids=%s)",
             out_dir, list(draft.cfg.capture_layers))
    return out_dir
