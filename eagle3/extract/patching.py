"""Inject, check and revert the hidden-state dump hook in SGLang's `deepseek_v2.py`.

The hook (hunks in `patches/sglang_deepseek_v2_dump.toml`, explained in `patches/README.md`)
adds a few lines to `sglang/srt/models/deepseek_v2.py` that call `eagle3/extract/sglang_dump.py` when
`EAGLE3_DUMP_DIR` is set. Each hunk is inserted as whole lines between marker comments next to
an exact anchor inside `class DeepseekV2ForCausalLM`, so that:

- applying is idempotent by content (re-applying the same hook is a no-op; a hook from an older
  version or another checkout is replaced),
- reverting removes exactly the marked lines and gives back the original file byte for byte,
- a file whose anchors are missing, or an SGLang older than 0.5.10, is refused with the reason.

A copy of the original file is kept next to it as `deepseek_v2.py.eagle3-orig` while patched.

Usage (no SGLang import; uses the SGLang that this Python would import, or `--sglang-dir`):

    python -m eagle3.extract.patching                  # apply
    python -m eagle3.extract.patching --check          # exit 0 patched, 1 unpatched/outdated, 2 unsupported
    python -m eagle3.extract.patching --revert
    python -m eagle3.extract.patching --sglang-dir /path/to/site-packages   # or .../sglang, or a git
                                                                    # checkout (its python/sglang)
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.version import InvalidVersion, Version

from eagle3.core.stage import atomic_writer
from eagle3.extract import sglang_dump

logger = logging.getLogger(__name__)

HOOK_SPEC_PATH = Path(__file__).resolve().parents[2] / "patches" / "sglang_deepseek_v2_dump.toml"
DUMP_MODULE_PATH = Path(sglang_dump.__file__).resolve()
MODEL_FILE = Path("srt/models/deepseek_v2.py")  # relative to the sglang package directory
BACKUP_SUFFIX = ".eagle3-orig"
_BEGIN = "# >>> eagle3 dump hook: {name} (python -m eagle3.extract.patching --revert removes it) >>>"
_END = "# <<< eagle3 dump hook: {name} <<<"
_MARKER_RE = re.compile(r"^[ \t]*# (>>>|<<<) eagle3 dump hook: (\w+)")
# Features the dump relies on, beyond the hook's anchors: (file, regex, what it means).
_FEATURES = [
    ("srt/model_executor/forward_batch_info.py", r"(?m)^\s+rids: ",
     "ForwardBatch.rids (request ids in the forward pass)"),
    ("srt/models/deepseek_v2.py", r"def set_eagle3_layers_to_capture\(",
     "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"),
    ("srt/models/kimi_k25.py", r"def set_eagle3_layers_to_capture\(",
     "Kimi-K2.5 (KimiK25ForConditionalGeneration) aux hidden-state capture"),
]


class PatchError(RuntimeError):
    """Base class of patching errors."""


class SglangNotFoundError(PatchError):
    """No SGLang package where we looked."""


class UnsupportedSglangError(PatchError):
    """The SGLang found cannot take the hook (too old, or anchors missing)."""


class CorruptPatchError(PatchError):
    """Unbalanced hook markers: a hand-edited file."""


@dataclass(frozen=True)
class Hunk:
    """One block of hook lines and where it goes."""

    name: str
    where: str  # "before_class": before the class line; "after": after the anchor lines
    text: str  # the lines to insert (newline-terminated), indented as they must appear
    anchor: str = ""  # exact lines (newline-terminated) inside the class body; "after" only


@dataclass(frozen=True)
class HookSpec:
    """The whole hook, as read from patches/."""

    min_version: str
    class_name: str
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class PatchStatus:
    """What `check_patch` found."""

    state: str  # "patched" | "outdated" | "unpatched" | "unsupported"
    model_file: Path
    version: str | None  # None when the package carries no version (a source checkout)
    reasons: tuple[str, ...] = ()  # why unsupported / outdated


def _read(path: Path) -> str:
    # Bytes, not read_text(): universal newlines would break the byte-for-byte revert.
    return path.read_bytes().decode("utf-8")


def _write_atomic(path: Path, text: str) -> None:
    """Replace a file's content in one rename, keeping its mode (never a half-written module)."""
    with atomic_writer(path, keep_mode=True) as f:
        f.write(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Finding SGLang


def find_sglang_package(sglang_dir: Path | None = None) -> Path:
    """The `sglang` package directory: from `sglang_dir` or where this Python would import it.

    `sglang_dir` may be the package itself, a directory holding it (site-packages) or a source
    checkout (holding `python/sglang`). SGLang is located, never imported.
    """
    if sglang_dir is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise SglangNotFoundError(
                "SGLang is not importable from this Python; pass --sglang-dir <site-packages or "
                "sglang checkout>")
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    for candidate in (sglang_dir, sglang_dir / "sglang", sglang_dir / "python" / "sglang"):
        if (candidate / MODEL_FILE).is_file():
            return candidate.resolve()
    raise SglangNotFoundError(
        f"no {MODEL_FILE} under {sglang_dir}, {sglang_dir}/sglang or {sglang_dir}/python/sglang; "
        "pass the sglang package directory, its site-packages or an SGLang checkout")


def read_sglang_version(package_dir: Path) -> str | None:
    """The version from `sglang/_version.py` or a sibling `sglang-*.dist-info`, else None."""
    version_file = package_dir / "_version.py"
    if version_file.is_file():
        found = re.search(r"(?m)^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
                          _read(version_file))
        if found:
            return found.group(1)
    for metadata in sorted(package_dir.parent.glob("sglang-*.dist-info/METADATA")):
        found = re.search(r"(?m)^Version:\s*(\S+)", metadata.read_text())
        if found:
            return found.group(1)
    return None


# ---------------------------------------------------------------------------------------------
# The hook


def load_hook_spec(path: Path = HOOK_SPEC_PATH, dump_module: Path = DUMP_MODULE_PATH) -> HookSpec:
    """Read the hunks from patches/ and fill their placeholders."""
    raw = tomllib.loads(path.read_text())
    hunks = []
    for item in raw["hunks"]:
        if item["where"] not in ("before_class", "after") or (item["where"] == "after") != bool(
                item.get("anchor")):
            raise ValueError(f"{path}: hunk {item['name']!r} needs where = 'before_class', or "
                             "where = 'after' with an anchor")
        text = item["text"].replace("{env_var}", sglang_dump.ENV_DUMP_DIR)
        text = text.replace("{dump_module}", repr(str(dump_module)))
        hunks.append(Hunk(item["name"], item["where"], text, item.get("anchor", "")))
    return HookSpec(raw["min_version"], raw["class_name"], tuple(hunks))


def _class_span(lines: list[str], class_name: str) -> tuple[int, int]:
    """[start, end) line indices of the top-level class body."""
    heads = [i for i, line in enumerate(lines) if line.startswith(f"class {class_name}(")]
    if len(heads) != 1:
        raise UnsupportedSglangError(f"expected one line starting 'class {class_name}(', "
                                     f"found {len(heads)}")
    end = heads[0] + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    return heads[0], end


def _find_anchor(lines: list[str], span: tuple[int, int], hunk: Hunk, class_name: str) -> int:
    """Index of the line after the hunk's anchor, which must occur once in the class body."""
    anchor = hunk.anchor.splitlines(keepends=True)
    size = len(anchor)
    hits = [i for i in range(span[0], span[1] - size + 1) if lines[i:i + size] == anchor]
    if len(hits) != 1:
        raise UnsupportedSglangError(
            f"hunk '{hunk.name}': expected the lines {hunk.anchor.rstrip()!r} once in class "
            f"{class_name}, found {len(hits)}")
    return hits[0] + size


def _block(hunk: Hunk) -> list[str]:
    first = hunk.text.splitlines()[0]
    indent = first[: len(first) - len(first.lstrip())]
    return ([indent + _BEGIN.format(name=hunk.name) + "\n"]
            + hunk.text.splitlines(keepends=True)
            + [indent + _END.format(name=hunk.name) + "\n"])


def render_patched(original: str, spec: HookSpec) -> str:
    """The original source with every hunk inserted; raises `UnsupportedSglangError`."""
    lines = original.splitlines(keepends=True)
    span = _class_span(lines, spec.class_name)
    inserts = []
    for hunk in spec.hunks:
        at = span[0] if hunk.where == "before_class" else _find_anchor(lines, span, hunk,
                                                                       spec.class_name)
        inserts.append((at, _block(hunk)))
    for at, block in sorted(inserts, key=lambda item: item[0], reverse=True):
        lines[at:at] = block
    return "".join(lines)


def strip_hook(source: str) -> str:
    """The source without any hook block; raises `CorruptPatchError` on unbalanced markers."""
    kept, open_name = [], None
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = _MARKER_RE.match(line)
        if marker and marker.group(1) == ">>>" and open_name is None:
            open_name = marker.group(2)
        elif marker and marker.group(1) == "<<<" and open_name == marker.group(2):
            open_name = None
        elif marker:
            raise CorruptPatchError(f"unbalanced eagle3 hook marker on line {number}; restore "
                                    f"the file from {MODEL_FILE.name}{BACKUP_SUFFIX}")
        elif open_name is None:
            kept.append(line)
    if open_name is not None:
        raise CorruptPatchError(f"eagle3 hook block '{open_name}' is never closed; restore the "
                                f"file from {MODEL_FILE.name}{BACKUP_SUFFIX}")
    return "".join(kept)


def is_patched(source: str) -> bool:
    """Whether the source holds any eagle3 hook marker."""
    return any(_MARKER_RE.match(line) for line in source.splitlines())


# ---------------------------------------------------------------------------------------------
# Support, check, apply, revert


def unsupported_reasons(package_dir: Path, spec: HookSpec) -> list[str]:
    """Why this SGLang cannot take the hook; empty when it can."""
    reasons = []
    version = read_sglang_version(package_dir)
    try:
        if version is not None and Version(version) < Version(spec.min_version):
            reasons.append(f"SGLang {version} is older than {spec.min_version}; upgrade with "
                           f"pip install 'sglang>={spec.min_version}'")
    except InvalidVersion:
        logger.warning("unparsable SGLang version %r; checking features only", version)
    for rel, pattern, meaning in _FEATURES:
        path = package_dir / rel
        if not path.is_file() or not re.search(pattern, _read(path)):
            reasons.append(f"missing {meaning} (looked for /{pattern}/ in {rel})")
    try:
        render_patched(strip_hook(_read(package_dir / MODEL_FILE)), spec)
    except UnsupportedSglangError as exc:
        reasons.append(str(exc))
    return reasons


def check_patch(package_dir: Path, spec: HookSpec | None = None) -> PatchStatus:
    """Report whether the SGLang at `package_dir` is patched, unpatched, outdated or unsupported."""
    spec = spec or load_hook_spec()
    model_file = package_dir / MODEL_FILE
    version = read_sglang_version(package_dir)
    reasons = unsupported_reasons(package_dir, spec)
    if reasons:
        return PatchStatus("unsupported", model_file, version, tuple(reasons))
    source = _read(model_file)
    if not is_patched(source):
        return PatchStatus("unpatched", model_file, version)
    if source != render_patched(strip_hook(source), spec):
        return PatchStatus("outdated", model_file, version,
                           ("the hook differs from this checkout's; re-apply",))
    return PatchStatus("patched", model_file, version)


def apply_patch(package_dir: Path, spec: HookSpec | None = None) -> PatchStatus:
    """Insert the hook (replacing an older one); a no-op when already patched."""
    spec = spec or load_hook_spec()
    status = check_patch(package_dir, spec)
    if status.state == "unsupported":
        raise UnsupportedSglangError(
            f"SGLang {status.version or '(unknown version)'} at {package_dir} cannot take the "
            "dump hook: " + "; ".join(status.reasons))
    if status.state == "patched":
        logger.info("%s is already patched; nothing to do", status.model_file)
        return status
    original = strip_hook(_read(status.model_file))
    backup = status.model_file.with_name(status.model_file.name + BACKUP_SUFFIX)
    if not backup.is_file() or _read(backup) != original:
        _write_atomic(backup, original)
    _write_atomic(status.model_file, render_patched(original, spec))
    logger.info("patched %s (SGLang %s); original kept as %s", status.model_file,
                status.version, backup.name)
    return check_patch(package_dir, spec)


def revert_patch(package_dir: Path) -> bool:
    """Remove the hook; returns False when there was none. Restores the file byte for byte."""
    model_file = package_dir / MODEL_FILE
    source = _read(model_file)
    backup = model_file.with_name(model_file.name + BACKUP_SUFFIX)
    if not is_patched(source):
        logger.info("%s is not patched; nothing to revert", model_file)
        return False
    original = strip_hook(source)
    _write_atomic(model_file, original)
    if backup.is_file() and _read(backup) == original:
        backup.unlink()
    elif backup.is_file():
        logger.warning("%s differs from the reverted file (SGLang changed?); kept", backup)
    logger.info("reverted %s", model_file)
    return True


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eagle3.extract.patching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-dir", type=Path, default=None,
                        help="sglang package, its site-packages or a checkout (default: the "
                             "SGLang this Python would import)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="report; change nothing")
    action.add_argument("--revert", action="store_true", help="remove the hook")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        package_dir = find_sglang_package(args.sglang_dir)
        if args.revert:
            revert_patch(package_dir)
            return 0
        status = check_patch(package_dir) if args.check else apply_patch(package_dir)
    except PatchError as exc:
        logger.error("%s", exc)
        return 2
    detail = "".join(f"\n  - {reason}" for reason in status.reasons)
    logger.info("SGLang %s at %s: %s%s", status.version or "(unknown version)", package_dir,
                status.state, detail)
    return {"patched": 0, "unpatched": 1, "outdated": 1}.get(status.state, 2)


if __name__ == "__main__":
    sys.exit(main())
