"""The check of a converted target folder, as the pipeline will load it (no `gguf_file`).

Run by eagle3/targets/gguf.py before the folder is renamed into place, so a transformers
version that reads a GGUF differently fails the conversion instead of the stages after it:
- config.json: the preset's shape (eagle3/core/presets.py: hidden, layers, vocab, heads, MLP)
  and the table's fields (eagle3/targets/packaged.py: model type, KV heads, tied head, rope
  base), no `quantization_config`, eos the end of turn;
- the tokenizer: as many tokens as the GGUF, eos the end of turn (the same id as config.json's),
  a pad token, every control and user-defined token of the GGUF one id of its own;
- the chat template: the GGUF's, rendering a user turn and the generation prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.targets.packaged import PackagedTarget, PackagedTargetError


def config_problems(folder: Path, target: PackagedTarget) -> list[str]:
    """How config.json differs from the preset and the table (empty when it does not)."""
    from eagle3.core.presets import get_preset
    from eagle3.core.target import read_target_info

    info = read_target_info(folder)
    raw = json.loads((folder / "config.json").read_text())
    preset = get_preset(target.name)
    want = {k: getattr(preset, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                            "num_attention_heads", "intermediate_size")}
    want.update(target.config)
    got = {k: info.rope_theta if k == "rope_theta" else raw.get(k) for k in want}
    problems = [f"config.json {k}: {got[k]!r}, expected {v!r}" for k, v in want.items()
                if got[k] != v]
    if raw.get("quantization_config") is not None:
        problems.append("config.json still has a quantization_config")
    return problems


def tokenizer_problems(folder: Path, target: PackagedTarget, vocab) -> list[str]:
    """How the saved tokenizer differs from what the GGUF (`vocab`, a GGUFVocab) says."""
    from eagle3.core.target import load_tokenizer

    tok = load_tokenizer(folder)
    raw = json.loads((folder / "config.json").read_text())
    problems = []
    if len(tok) != len(vocab.tokens):
        problems.append(f"the tokenizer has {len(tok)} tokens, the GGUF {len(vocab.tokens)}")
    eos_ids = raw.get("eos_token_id")
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    if tok.eos_token != target.end_of_turn or tok.eos_token_id not in eos_ids:
        problems.append(f"eos {tok.eos_token!r} (id {tok.eos_token_id}; config.json "
                        f"{raw.get('eos_token_id')}), expected {target.end_of_turn!r}")
    if tok.pad_token is None:
        problems.append("no pad token")
    for token_id, token, _ in vocab.added:
        ids = tok.encode(token, add_special_tokens=False)
        if ids != [token_id]:
            problems.append(f"{token!r} encodes to {ids[:4]}, not [{token_id}]")
    if tok.chat_template != vocab.chat_template:
        problems.append("the chat template is not the GGUF's")
    else:
        turn = [{"role": "user", "content": "Hi"}]
        text = tok.apply_chat_template(turn, tokenize=False)
        prompt = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        if "Hi" not in text or target.end_of_turn not in text or not (
                prompt.startswith(text) and len(prompt) > len(text)):
            problems.append(f"the chat template renders {text!r}, with the generation prompt "
                            f"{prompt!r}")
    return problems


def check_folder(folder: Path, target: PackagedTarget, vocab) -> None:
    """PackagedTargetError listing every way the folder is not the target, if any."""
    problems = config_problems(folder, target) + tokenizer_problems(folder, target, vocab)
    if problems:
        raise PackagedTargetError(f"the folder converted from {target.gguf_name} is not "
                                  f"{target.name}: " + "; ".join(problems))
