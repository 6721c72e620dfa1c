"""Stage 05's first look at the draft folder's files, before any check reads them or any server
starts: each problem is an `InputFileError` naming the file and what is wrong.

- `config.json` parses, is a JSON object, and holds the keys its layout needs (SGLang's
  `LlamaForCausalLMEagle3`: `eagle3.draft.export.CONFIG_KEYS`; the speculators layout vLLM
  serves: `transformer_layer_config` and the vocabulary sizes; an MLA draft's keys are checked
  by `eagle3/draft/check_mla.py`).
- every `*.safetensors` file is whole: an 8-byte header length, a JSON header, and exactly the
  tensor bytes the header promises (a copy cut short by a full disk fails here, not inside
  safetensors or the server's loader); safetensors itself then reads every tensor (offsets,
  dtypes), and every floating-point weight must be finite: a NaN or Inf in a weight makes the
  draft's every proposal garbage while the server serves on. This reads the whole draft once
  (measured on 2 CPU cores beside other work: 0.54 GB of bf16 in 2.3 s; the 21.5 MB reference
  SmolLM2 draft in 0.27 s).
- `d2t` has `draft_vocab_size` entries and `t2d` `vocab_size` (config.json's values).

A folder without config.json or without safetensors is left to the preflight
(`eagle3/draft/check.py`), whose message says which folder --draft must name.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.core.faults import InputFileError
from eagle3.draft.check_mla import is_mla_draft
from eagle3.draft.export import CONFIG_KEYS

SPECULATORS_KEYS = ("transformer_layer_config", "draft_vocab_size", "target_hidden_size")
LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size")
FIX = "copy the folder again, or re-export it from 04's checkpoint (04_train.py writes it)"


def check_draft_files(draft_dir: Path) -> None:
    """Raise InputFileError for the first unusable file of the draft folder."""
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise InputFileError(draft_dir, "no such folder: --draft must be the folder 04 writes "
                                        "(<workdir>/04_train/final)")
    config = read_config(draft_dir / "config.json")
    shapes: dict[str, tuple[Path, list[int]]] = {}
    for file in sorted(draft_dir.glob("*.safetensors")):
        shapes.update({name: (file, shape) for name, shape in read_header(file).items()})
        check_finite(file)
    if config is not None:
        check_vocab_tensors(config, shapes, draft_dir / "config.json")


def read_config(path: Path) -> dict | None:
    """config.json as a dict with its layout's keys; None when it does not exist."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputFileError(path, f"not valid JSON ({e}); {FIX}") from None
    if not isinstance(config, dict):
        raise InputFileError(path, f"holds a JSON {type(config).__name__}, not an object; {FIX}")
    if is_mla_draft(config):
        return config
    if config.get("speculators_model_type") == "eagle3":
        layer = config.get("transformer_layer_config")
        missing = [k for k in SPECULATORS_KEYS if k not in config] + (
            [f"transformer_layer_config.{k}" for k in LAYER_KEYS if k not in layer]
            if isinstance(layer, dict) else [])
    else:
        missing = sorted(CONFIG_KEYS - set(config))
        eagle = config.get("eagle_config")
        if "eagle_config" in config and not (
                isinstance(eagle, dict) and "eagle_aux_hidden_state_layer_ids" in eagle):
            missing.append("eagle_config.eagle_aux_hidden_state_layer_ids")
    if missing:
        raise InputFileError(path, f"lacks {missing}; {FIX}")
    return config


def read_header(path: Path) -> dict[str, list[int]]:
    """{tensor name: shape} of a safetensors file whose size matches its header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputFileError(path, f"{size} bytes: too short for a safetensors file; {FIX}")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise InputFileError(path, f"truncated: its header length says {n:,} bytes, the "
                                       f"file holds {size:,}; {FIX}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputFileError(path, f"corrupt safetensors header ({e}); {FIX}") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} \
        if isinstance(header, dict) else None
    try:
        end = max((t["data_offsets"][1] for t in tensors.values()), default=0)
        shapes = {name: list(t["shape"]) for name, t in tensors.items()}
    except (AttributeError, KeyError, IndexError, TypeError):
        raise InputFileError(path, f"corrupt safetensors header (no shapes or offsets); {FIX}") \
            from None
    if 8 + n + end != size:
        state = "truncated" if 8 + n + end > size else "longer than its header says"
        raise InputFileError(path, f"{state}: the header promises {8 + n + end:,} bytes, the "
                                   f"file holds {size:,}; {FIX}")
    return shapes


def check_finite(path: Path) -> None:
    """Every tensor of a safetensors file readable, every floating-point one finite; one tensor
    in memory at a time."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    continue
                finite = torch.isfinite(t.float() if t.element_size() == 1 else t)
                if not bool(finite.all()):  # counted only then
                    bad = int((~finite).sum())
                    raise InputFileError(path, f"weight {name} {list(t.shape)} holds {bad:,} "
                                               "NaN/Inf values: the draft would propose garbage. "
                                               "Re-export it from a finite checkpoint of 04's "
                                               "(its last one before the loss went non-finite)")
    except SafetensorError as e:
        raise InputFileError(path, f"unreadable safetensors ({e}); {FIX}") from None


def check_vocab_tensors(config: dict, shapes: dict[str, tuple[Path, list[int]]],
                        config_path: Path) -> None:
    """d2t and t2d as long as config.json's draft_vocab_size and vocab_size."""
    layer = config.get("transformer_layer_config")
    vocab = (layer if isinstance(layer, dict) else config).get("vocab_size")
    for name, key, want in (("d2t", "draft_vocab_size", config.get("draft_vocab_size")),
                            ("t2d", "vocab_size", vocab)):
        if name in shapes and want is not None and shapes[name][1] != [want]:
            file, shape = shapes[name]
            raise InputFileError(file, f"{name} has shape {shape}, but {config_path} says "
                                       f"{key} {want}: the vocabulary mapping belongs to another "
                                       "draft (rebuild it with 03_build_vocab_mapping.py and "
                                       "retrain, or use the matching config.json)")
