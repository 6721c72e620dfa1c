"""The target model: its config, capture layers, and the few tensors the draft borrows from it.

The embedding and `lm_head` are read straight from the target's safetensors files (through
`model.safetensors.index.json` when sharded), one tensor at a time, so a 1 TB checkpoint costs
only the bytes of those two tensors.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


class TargetError(ValueError):
    """The target folder lacks something the pipeline needs; the message says what."""


@dataclass
class TargetInfo:
    """What the pipeline needs to know of a target, from its config.json."""

    path: Path
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


def read_target_info(path: Path) -> TargetInfo:
    """Read config.json (a multimodal wrapper's `text_config` is used when present)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise TargetError(f"{cfg_path} not found: --target must be a Hugging Face model folder")
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    rope = cfg.get("rope_parameters") or {}
    return TargetInfo(
        path=Path(path),
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
        num_attention_heads=cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
    )


def default_capture_layers(num_hidden_layers: int) -> list[int]:
    """SGLang's default EAGLE-3 capture indices `[2, N//2, N-3]` ([2, 30, 58] for 61 layers).

    Index i is the residual stream entering decoder layer i, i.e. HF `output_hidden_states[i]`.
    """
    layers = [2, num_hidden_layers // 2, num_hidden_layers - 3]
    if len(set(layers)) != 3 or layers != sorted(layers):
        raise TargetError(f"a {num_hidden_layers}-layer target gives no 3 distinct capture layers")
    return layers


def _locate(path: Path, names: tuple[str, ...]) -> tuple[str, Path]:
    """(name, file) of the first of `names` in the checkpoint, found through the index when
    sharded (no shard is opened) or in the single `model.safetensors`."""
    found = _find(path, names)
    if not found:
        raise TargetError(f"{path}: none of the tensors {names} is in the checkpoint")
    return found[0]


def _find(path: Path, names: tuple[str, ...]) -> list[tuple[str, Path]]:
    """[(name, file)] of those of `names` the checkpoint holds, in the order of `names`."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        found = [(n, path / weight_map[n]) for n in names if n in weight_map]
    else:
        single = path / "model.safetensors"
        if not single.exists():
            raise TargetError(f"{path} has neither model.safetensors nor its index")
        with safe_open(single, "pt") as f:
            keys = set(f.keys())
        found = [(n, single) for n in names if n in keys]
    return found


def load_target_tensor(path: Path, names: tuple[str, ...],
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor (first of `names` present) from the target's safetensors files, or only its
    `rows` (sorted ascending), read as contiguous runs so the rest never leaves the disk."""
    from safetensors import safe_open

    name, file = _locate(path, names)
    with safe_open(file, "pt") as f:
        if rows is None:
            tensor = f.get_tensor(name)
        else:
            sl = f.get_slice(name)
            rows = torch.as_tensor(rows, dtype=torch.int64)
            if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
                raise TargetError(f"rows of {name} must be unique and ascending")
            breaks = (torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1).tolist()
            starts = [0] + breaks
            ends = breaks + [rows.numel()]
            tensor = torch.cat([sl[int(rows[a]):int(rows[b - 1]) + 1]
                                for a, b in zip(starts, ends)])
    log.info("loaded %s %s from %s", name, tuple(tensor.shape), file.name)
    return tensor


def load_embedding(path: Path) -> torch.Tensor:
    """The target's token embedding `[vocab, H]`."""
    return load_target_tensor(path, EMBED_NAMES)


def ties_embeddings(path: Path) -> bool | None:
    """`tie_word_embeddings` of the target's config.json (a multimodal wrapper's `text_config`
    first), or None when the config does not say (or there is no config.json)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    for section in (cfg.get("text_config") or {}, cfg):
        if isinstance(section.get("tie_word_embeddings"), bool):
            return section["tie_word_embeddings"]
    return None


def load_lm_head(path: Path, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's output head `[vocab, H]`, or its `rows`. A checkpoint without one is read
    as tied (the embedding): quietly when config.json says `tie_word_embeddings: true` (SmolLM2),
    with a warning when it does not say; a config that says false makes it an error."""
    if _find(path, LM_HEAD_NAMES):
        return load_target_tensor(path, LM_HEAD_NAMES, rows)
    tied = ties_embeddings(path)
    if tied is False:
        raise TargetError(f"{path}: the checkpoint holds no lm_head ({' or '.join(LM_HEAD_NAMES)})"
                          " and config.json says tie_word_embeddings: false, so the output head "
                          "is missing, not the embedding: check the download is complete")
    if tied:
        log.info("no lm_head in %s: its embeddings are tied (tie_word_embeddings), using the "
                 "embedding", path)
    else:
        log.warning("no lm_head in %s and its config.json does not say tie_word_embeddings: "
                    "using the embedding as the output head", path)
    return load_target_tensor(path, EMBED_NAMES, rows)


TRUST_HELP = ("run the Python code the target folder ships (`auto_map` in its config.json or "
              "tokenizer_config.json), as transformers' trust_remote_code, SGLang's and vLLM's "
              "--trust-remote-code do; Kimi-K2.5 needs it. Off, such a target is refused")


def remote_code_entry(path: Path, auto_classes: tuple[str, ...]) -> str | None:
    """The `auto_map` entry of the target folder that makes transformers import the folder's own
    Python for one of `auto_classes` (`"AutoTokenizer"`, ...), or None."""
    for name in ("config.json", "tokenizer_config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        auto_map = json.loads(file.read_text()).get("auto_map") or {}
        for cls in auto_classes:
            ref = auto_map.get(cls)
            refs = ref if isinstance(ref, list) else [ref]
            if any(isinstance(r, str) and r for r in refs):
                return f"{name} auto_map {cls} = {ref!r}"
    return None


AUTO_CLASSES = ("AutoConfig", "AutoTokenizer", "AutoModel", "AutoModelForCausalLM")


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Refuse (TargetError, a ValueError: a usage error in the scripts) a target folder that
    ships code for transformers to run unless `--trust-remote-code` was given."""
    _refuse_remote_code(path, AUTO_CLASSES, trust_remote_code)


def _refuse_remote_code(path: Path, auto_classes: tuple[str, ...], trust: bool) -> None:
    # transformers without trust_remote_code silently loads a built-in class instead of the one
    # a folder names (a different tokenizer than the target's): refuse instead.
    entry = remote_code_entry(path, auto_classes)
    if entry is not None and not trust:
        raise TargetError(f"target {path} ships its own code ({entry}); loading it runs that "
                          "code: pass --trust-remote-code if you trust the folder")


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The target's tokenizer and chat template from its local folder.

    A folder that ships its tokenizer as code (Kimi-K2.5's is tiktoken-based Python, named by
    `auto_map`) loads only with `trust_remote_code` (the scripts' `--trust-remote-code`); without
    it, such a folder is a TargetError naming the flag.
    """
    from transformers import AutoTokenizer

    _refuse_remote_code(path, ("AutoTokenizer",), trust_remote_code)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_hf_model(path: Path, dtype: str = "float32", device: str = "cpu",
                  trust_remote_code: bool = False):
    """The whole target through transformers (small targets, the demo, tests); remote code
    only with `trust_remote_code`, as `load_tokenizer`."""
    from transformers import AutoModelForCausalLM

    _refuse_remote_code(path, ("AutoConfig", "AutoModel", "AutoModelForCausalLM"),
                        trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()
