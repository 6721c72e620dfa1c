"""Inject, check and revert the hidden-state dump hook in SGLang's model files.

The hook (`patches/sglang_dump_hook.toml`, explained in `patches/README.md`) adds a few lines to
each model file it names, `sglang/srt/models/deepseek_v2.py` (DeepSeek-V3, Kimi-K2.5),
`qwen2.py` (Qwen2.5) and `llama.py` (Llama, SmolLM2), that call `eagle3/extract/sglang_dump.py`
when `EAGLE3_DUMP_DIR` is set. Each hunk is inserted as whole lines between marker comments next
to an exact anchor inside the file's class (`DeepseekV2ForCausalLM`, `Qwen2ForCausalLM`,
`LlamaForCausalLM`), so that:

- applying is idempotent by content (re-applying the same hook is a no-op; a hook from an older
  version or another checkout is replaced),
- reverting removes exactly the marked lines and gives back every original file byte for byte,
- an SGLang older than 0.5.10, or one where any model file lacks an anchor, is refused with the
  reason, per file, and nothing is written: the files are patched all together or not at all.

A copy of each original file is kept next to it as `<file>.eagle3-orig` while patched.

Usage (no SGLang import; uses the SGLang that this Python would import, or `--sglang-dir`):

    python -m eagle3.extract.patching                  # apply to every model file
    python -m eagle3.extract.patching --check          # exit 0 all patched, 1 unpatched/outdated,
                                                       # 2 unsupported (or no SGLang)
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

HOOK_SPEC_PATH = Path(__file__).resolve().parents[2] / "patches" / "sglang_dump_hook.toml"
DUMP_MODULE_PATH = Path(sglang_dump.__file__).resolve()
MODELS_DIR = Path("srt/models")  # relative to the sglang package directory
BACKUP_SUFFIX = ".eagle3-orig"
_BEGIN = "# >>> eagle3 dump hook: {name} (python -m eagle3.extract.patching --revert removes it) >>>"
_END = "# <<< eagle3 dump hook: {name} <<<"
_MARKER_RE = re.compile(r"^[ \t]*# (>>>|<<<) eagle3 dump hook: (\w+)")
# enable_capture calls it on the hooked model: every hooked class must define it.
_SET_CAPTURE_RE = re.compile(r"(?m)^    def set_eagle3_layers_to_capture\(")
_EXIT_CODES = {"patched": 0, "unpatched": 1, "outdated": 1, "unsupported": 2}


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
class Requirement:
    """A feature the dump relies on beyond the anchors: `pattern` must match in `file`."""

    file: str  # relative to the sglang package directory
    pattern: str  # a regular expression
    meaning: str  # what it means, for the message


@dataclass(frozen=True)
class ModelFile:
    """One hooked model file and its class."""

    path: Path  # relative to the sglang package directory, e.g. srt/models/qwen2.py
    class_name: str  # whose __init__ and forward are hooked, e.g. Qwen2ForCausalLM
    requires: tuple[Requirement, ...] = ()  # features needed by this file's targets only


@dataclass(frozen=True)
class HookSpec:
    """The whole hook, as read from patches/."""

    min_version: str
    requires: tuple[Requirement, ...]  # of the whole release
    model_files: tuple[ModelFile, ...]
    hunks: tuple[Hunk, ...]  # the same in every model file


@dataclass(frozen=True)
class FileStatus:
    """What `check_patch` found in one model file."""

    state: str  # "patched" | "outdated" | "unpatched" | "unsupported"
    model_file: Path
    reasons: tuple[str, ...] = ()  # why unsupported / outdated


@dataclass(frozen=True)
class PatchStatus:
    """What `check_patch` found in a whole SGLang."""

    version: str | None  # None when the package carries no version (a source checkout)
    release_reasons: tuple[str, ...]  # why the whole release is unsupported
    files: tuple[FileStatus, ...]

    @property
    def state(self) -> str:
        """"unsupported" if the release or any file is, "patched" if every file is, else
        "outdated" if any file holds another hook, else "unpatched"."""
        states = {f.state for f in self.files}
        if self.release_reasons or "unsupported" in states:
            return "unsupported"
        if states == {"patched"}:
            return "patched"
        return "outdated" if "outdated" in states else "unpatched"

    @property
    def reasons(self) -> tuple[str, ...]:
        """The release's reasons, then each file's, prefixed with the file's name."""
        return self.release_reasons + tuple(f"{f.model_file.name}: {reason}"
                                            for f in self.files for reason in f.reasons)


def _read(path: Path) -> str:
    # Bytes, not read_text(): universal newlines would break the byte-for-byte revert.
    return path.read_bytes().decode("utf-8")


def _write_atomic(path: Path, text: str) -> None:
    """Replace a file's content in one rename, keeping its mode (never a half-written module)."""
    with atomic_writer(path, keep_mode=True) as f:
        f.write(text.encode("utf-8"))


def backup_path(model_file: Path) -> Path:
    """Where the original of a patched model file is kept: `<file>.eagle3-orig`."""
    return model_file.with_name(model_file.name + BACKUP_SUFFIX)


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
        if (candidate / MODELS_DIR).is_dir():
            return candidate.resolve()
    raise SglangNotFoundError(
        f"no {MODELS_DIR} under {sglang_dir}, {sglang_dir}/sglang or {sglang_dir}/python/sglang; "
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


def _requirements(items: list[dict]) -> tuple[Requirement, ...]:
    return tuple(Requirement(item["file"], item["pattern"], item["meaning"]) for item in items)


def load_hook_spec(path: Path = HOOK_SPEC_PATH, dump_module: Path = DUMP_MODULE_PATH) -> HookSpec:
    """Read the model files and hunks from patches/ and fill the hunks' placeholders."""
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
    model_files = tuple(ModelFile(Path(item["path"]), item["class_name"],
                                  _requirements(item.get("requires", [])))
                        for item in raw["model_files"])
    return HookSpec(raw["min_version"], _requirements(raw.get("requires", [])), model_files,
                    tuple(hunks))


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


def render_patched(original: str, spec: HookSpec, class_name: str) -> str:
    """The original source with every hunk inserted in `class_name`; raises
    `UnsupportedSglangError` when the class, an anchor or `set_eagle3_layers_to_capture` is
    missing."""
    lines = original.splitlines(keepends=True)
    span = _class_span(lines, class_name)
    if not _SET_CAPTURE_RE.search("".join(lines[span[0]:span[1]])):
        raise UnsupportedSglangError(f"class {class_name} defines no "
                                     "set_eagle3_layers_to_capture (no EAGLE-3 aux capture)")
    inserts = []
    for hunk in spec.hunks:
        at = span[0] if hunk.where == "before_class" else _find_anchor(lines, span, hunk,
                                                                       class_name)
        inserts.append((at, _block(hunk)))
    for at, block in sorted(inserts, key=lambda item: item[0], reverse=True):
        lines[at:at] = block
    return "".join(lines)


def strip_hook(source: str, name: str = "the model file") -> str:
    """The source without any hook block; raises `CorruptPatchError` on unbalanced markers
    (`name`: the file's name, for the message)."""
    kept, open_name = [], None
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = _MARKER_RE.match(line)
        if marker and marker.group(1) == ">>>" and open_name is None:
            open_name = marker.group(2)
        elif marker and marker.group(1) == "<<<" and open_name == marker.group(2):
            open_name = None
        elif marker:
            raise CorruptPatchError(f"{name}: unbalanced eagle3 hook marker on line {number}; "
                                    f"restore the file from {name}{BACKUP_SUFFIX}")
        elif open_name is None:
            kept.append(line)
    if open_name is not None:
        raise CorruptPatchError(f"{name}: eagle3 hook block '{open_name}' is never closed; "
                                f"restore the file from {name}{BACKUP_SUFFIX}")
    return "".join(kept)


def is_patched(source: str) -> bool:
    """Whether the source holds any eagle3 hook marker."""
    return any(_MARKER_RE.match(line) for line in source.splitlines())


# ---------------------------------------------------------------------------------------------
# Support, check, apply, revert


def _missing(package_dir: Path, requires: tuple[Requirement, ...]) -> list[str]:
    missing = []
    for req in requires:
        path = package_dir / req.file
        if not path.is_file() or not re.search(req.pattern, _read(path)):
            missing.append(f"missing {req.meaning} (looked for /{req.pattern}/ in {req.file})")
    return missing


def release_reasons(package_dir: Path, spec: HookSpec) -> list[str]:
    """Why this SGLang release as a whole cannot take the hook; empty when it can."""
    reasons = []
    version = read_sglang_version(package_dir)
    try:
        if version is not None and Version(version) < Version(spec.min_version):
            reasons.append(f"SGLang {version} is older than {spec.min_version}; upgrade with "
                           f"pip install 'sglang>={spec.min_version}'")
    except InvalidVersion:
        logger.warning("unparsable SGLang version %r; checking features only", version)
    return reasons + _missing(package_dir, spec.requires)


def check_file(package_dir: Path, spec: HookSpec, model: ModelFile) -> FileStatus:
    """Whether one model file is patched, unpatched, outdated or cannot take the hook."""
    path = package_dir / model.path
    if not path.is_file():
        return FileStatus("unsupported", path, (f"no {model.path} in this SGLang",))
    source = _read(path)
    reasons = _missing(package_dir, model.requires)
    try:
        expected = render_patched(strip_hook(source, path.name), spec, model.class_name)
    except (UnsupportedSglangError, CorruptPatchError) as exc:
        reasons.append(str(exc))
    if reasons:
        return FileStatus("unsupported", path, tuple(reasons))
    if not is_patched(source):
        return FileStatus("unpatched", path)
    if source != expected:
        return FileStatus("outdated", path, ("the hook differs from this checkout's; re-apply",))
    return FileStatus("patched", path)


def check_patch(package_dir: Path, spec: HookSpec | None = None) -> PatchStatus:
    """Report, per model file, whether the SGLang at `package_dir` is patched."""
    spec = spec or load_hook_spec()
    files = tuple(check_file(package_dir, spec, model) for model in spec.model_files)
    return PatchStatus(read_sglang_version(package_dir),
                       tuple(release_reasons(package_dir, spec)), files)


def apply_patch(package_dir: Path, spec: HookSpec | None = None) -> PatchStatus:
    """Insert the hook in every model file (replacing an older one); a no-op for the files
    already patched. Writes nothing unless every file can take it."""
    spec = spec or load_hook_spec()
    status = check_patch(package_dir, spec)
    if status.state == "unsupported":
        raise UnsupportedSglangError(
            f"SGLang {status.version or '(unknown version)'} at {package_dir} cannot take the "
            "dump hook (no file changed): " + "; ".join(status.reasons))
    for model, found in zip(spec.model_files, status.files, strict=True):
        if found.state == "patched":
            logger.info("%s is already patched; nothing to do", found.model_file)
            continue
        original = strip_hook(_read(found.model_file), found.model_file.name)
        backup = backup_path(found.model_file)
        if not backup.is_file() or _read(backup) != original:
            _write_atomic(backup, original)
        _write_atomic(found.model_file, render_patched(original, spec, model.class_name))
        logger.info("patched %s (%s, SGLang %s); original kept as %s", found.model_file,
                    model.class_name, status.version, backup.name)
    return check_patch(package_dir, spec)


def revert_patch(package_dir: Path, spec: HookSpec | None = None) -> list[Path]:
    """Remove the hook from every model file, restoring each byte for byte; returns the files
    reverted (empty: none was patched). A file with broken markers stops it before any write."""
    spec = spec or load_hook_spec()
    originals = {}
    for model in spec.model_files:
        path = package_dir / model.path
        if path.is_file() and is_patched(source := _read(path)):
            originals[path] = strip_hook(source, path.name)
        else:
            logger.info("%s is not patched; nothing to revert", path)
    for path, original in originals.items():
        _write_atomic(path, original)
        backup = backup_path(path)
        if backup.is_file() and _read(backup) == original:
            backup.unlink()
        elif backup.is_file():
            logger.warning("%s differs from the reverted file (SGLang changed?); kept", backup)
        logger.info("reverted %s", path)
    return list(originals)


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
    action.add_argument("--revert", action="store_true", help="remove the hook from every file")
    return parser.parse_args(argv)


def _log_status(package_dir: Path, status: PatchStatus) -> None:
    release = "".join(f"\n  - {reason}" for reason in status.release_reasons)
    logger.info("SGLang %s at %s: %s%s", status.version or "(unknown version)", package_dir,
                status.state, release)
    for found in status.files:
        detail = "".join(f"\n      - {reason}" for reason in found.reasons)
        logger.info("  %s: %s%s", found.model_file.relative_to(package_dir), found.state, detail)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        package_dir = find_sglang_package(args.sglang_dir)
        if args.revert:
            revert_patch(package_dir)
            return 0
        status = check_patch(package_dir)
        if not args.check and status.state != "unsupported":
            status = apply_patch(package_dir)
    except PatchError as exc:
        logger.error("%s", exc)
        return 2
    _log_status(package_dir, status)
    if status.state == "unsupported" and not args.check:
        logger.error("this SGLang cannot take the dump hook (reasons above); no file changed")
    return _EXIT_CODES[status.state]


if __name__ == "__main__":
    sys.exit(main())
