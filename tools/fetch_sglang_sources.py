"""Fetch the SGLang source files that the dump hook touches, for tests and CI (no install).

For each release, `pip download --no-deps` fetches the wheel (SGLang is never installed) and the
few files below are unzipped into a cache laid out like an installed package:

    <cache>/sglang/<version>/sglang/_version.py
    <cache>/sglang/<version>/sglang/srt/models/deepseek_v2.py        (qwen2.py, llama.py, kimi_k25.py)
    <cache>/sglang/<version>/sglang/srt/model_executor/forward_batch_info.py

so that `python -m eagle3.extract.patching --sglang-dir <cache>/sglang/<version>` works on it. The cache
is `$EAGLE3_CACHE_DIR` or `~/.cache/eagle3`; a version folder appears only once complete, and a
cached version is never fetched again unless it lacks a file of `REQUIRED_FILES` (a cache written
before that file was hooked): then it is fetched again and replaced.

    python tools/fetch_sglang_sources.py 0.5.10 0.5.13 0.5.17 0.5.23
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

# The model files the hook goes into (patches/sglang_dump_hook.toml): every release has them.
REQUIRED_FILES = (
    "sglang/srt/models/deepseek_v2.py",
    "sglang/srt/models/qwen2.py",
    "sglang/srt/models/llama.py",
)
# Files copied out of the wheel; those a release lacks (kimi_k25.py before 0.5.x) are skipped.
SOURCE_FILES = (
    "sglang/_version.py",
    *REQUIRED_FILES,
    "sglang/srt/models/kimi_k25.py",
    "sglang/srt/model_executor/forward_batch_info.py",
)
# The wheel for the CPython/Linux of CI; releases up to 0.5.10 are pure wheels and match too.
_PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
               "--abi", "cp311", "--platform", "manylinux_2_34_x86_64"]


class FetchError(RuntimeError):
    """A release could not be downloaded or lacks a model file the hook goes into."""


def default_cache_root() -> Path:
    """`$EAGLE3_CACHE_DIR` or `~/.cache/eagle3`."""
    return Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3")


def cached_sources(version: str, cache_root: Path) -> Path | None:
    """The cached folder of a release (holding `sglang/`), or None if not fetched yet."""
    folder = cache_root / "sglang" / version
    return folder if all((folder / name).is_file() for name in REQUIRED_FILES) else None


def _download_wheel(version: str, into: Path, timeout_s: float) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--retries", "1",
               "--timeout", "30", "--dest", str(into), *_PIP_TARGET, f"sglang=={version}"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        output = getattr(exc, "stderr", None) or str(exc)
        errors = [line for line in output.splitlines() if line.startswith("ERROR")]
        detail = " ".join(errors) or output.strip()[-300:]
        raise FetchError(f"pip download sglang=={version} failed: {detail}") from exc
    wheels = sorted(into.glob("sglang-*.whl"))
    if not wheels:
        raise FetchError(f"pip download sglang=={version} gave no wheel in {into}")
    return wheels[0]


def _extract(wheel: Path, folder: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        present = set(archive.namelist())
        taken = [name for name in SOURCE_FILES if name in present]
        for name in taken:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
    missing = [name for name in REQUIRED_FILES if name not in taken]
    if missing:
        raise FetchError(f"{wheel.name} has no {', '.join(missing)}")
    return taken


def fetch_sglang_sources(version: str, cache_root: Path | None = None,
                         timeout_s: float = 300.0) -> Path:
    """The cached folder of a release, downloading it first if needed; raises `FetchError`."""
    cache_root = cache_root or default_cache_root()
    cached = cached_sources(version, cache_root)
    if cached is not None:
        return cached
    (cache_root / "sglang").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root / "sglang", prefix=f".{version}-") as tmp:
        wheel = _download_wheel(version, Path(tmp) / "wheel", timeout_s)
        staging = Path(tmp) / "staging"
        taken = _extract(wheel, staging)
        folder = cache_root / "sglang" / version
        if folder.exists():  # an incomplete (older) cache: moved aside, removed with tmp
            folder.rename(Path(tmp) / "stale")
        try:
            staging.rename(folder)  # atomic: the folder is complete or absent
        except OSError:
            if cached_sources(version, cache_root) is None:  # not a concurrent fetch
                raise
        logger.info("cached SGLang %s (%s) in %s", version, ", ".join(taken), folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+", help="SGLang releases, e.g. 0.5.10 0.5.23")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default: $EAGLE3_CACHE_DIR or ~/.cache/eagle3)")
    args = parser.parse_args(argv)
    failed = 0
    for version in args.versions:
        try:
            logger.info("SGLang %s: %s", version, fetch_sglang_sources(version, args.cache_dir))
        except FetchError as exc:
            logger.error("%s", exc)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
