"""Stage folders, manifests, atomic writes and quarantine files (docs/PIPELINE.md, "Stages").

Every stage writes into `<workdir>/<stage folder>/` and ends by writing `manifest.json` with
`"complete": true`. A stage refuses an upstream folder without a complete manifest unless told
`--allow-partial`; a complete stage re-run is a no-op unless `--force`.

Temp files: every writer of a stage's outputs writes through a hidden temp name in the same
folder, `.NAME.*.tmp` (`atomic_writer`, `hidden_states.save`) or a `.tmp_*` folder (04's
checkpoints), then renames. A kill can leave such a temp behind; `sweep_temp_files` removes
them, and every stage runs it on its folder when it opens (`open_stage`) and again when it
completes (`Stage.finish`), so a killed and resumed stage holds exactly what an uninterrupted
one does.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class StageError(RuntimeError):
    """A stage cannot run as asked; the message says which folder or flag and the fix."""


class DiskError(StageError):
    """A write that the disk refused (full, over quota, read-only): eagle3/core/faults.py."""


# errno values that mean "the disk cannot take this write", not "the code is wrong"
DISK_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system"}


def is_disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def disk_error(exc: OSError, path: Path | str, needed_bytes: int | None = None) -> DiskError:
    """The DiskError for `exc` raised while writing `path`: names its folder and the bytes the
    write needed (at least; None when unknown)."""
    folder = Path(path).parent
    need = f"; the write needed {needed_bytes:,} bytes" if needed_bytes else ""
    try:
        free = os.statvfs(folder)
        room = f", {free.f_bavail * free.f_frsize:,} bytes free there"
    except OSError:
        room = ""
    fix = ("make the folder writable" if exc.errno == errno.EROFS
           else "free space (or move --workdir)")
    return DiskError(f"cannot write {path}: {DISK_ERRNOS[exc.errno]} in {folder}{need}{room}. "
                     f"Nothing partial was kept; {fix}, then re-run the same command to resume")


# The stage folders under the workdir (docs/PIPELINE.md, "Stages and what they exchange"), keyed
# by the stage's short name as the scripts are numbered; every script and report looks its folder
# up here.
STAGE_DIRS = {"01": "01_prepared", "01b": "01b_generated", "merge": "01c_merged",
              "02b": "02b_hidden_states", "03": "03_vocab", "04": "04_train", "05": "05_benchmark"}


# ---------------------------------------------------------------- atomic writes


# The one home of atomic writes (temp file in the same folder, fsync, rename). The exception is
# eagle3/extract/sglang_dump.py, which runs inside SGLang and imports nothing from eagle3.


@contextmanager
def atomic_writer(path: Path, keep_mode: bool = False,
                  expected_bytes: int | None = None) -> Iterator[BinaryIO]:
    """A binary file whose content replaces `path` only if the block ends without error.

    The streaming counterpart of `atomic_write_bytes` (temp file in the same folder, fsync,
    rename), for outputs too large to hold in memory. A killed writer leaves only a
    `.<name>.*.tmp` file. `keep_mode`: the new file keeps the old one's permissions (a new file
    gets the umask default instead of the temp file's 0600). A full or read-only disk raises
    `eagle3.core.faults.DiskError` naming the folder and the bytes needed (`expected_bytes`, else
    what was written when it failed), with the temp file removed.
    """
    path = Path(path)
    tmp = None
    written = 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            finally:
                written = f.tell()
        if keep_mode:
            _copy_mode(path, Path(tmp))
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if is_disk_error(e):
            raise disk_error(e, path, expected_bytes or written or None) from e
        raise


def _copy_mode(src: Path, dst: Path) -> None:
    if src.exists():
        shutil.copymode(src, dst)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(dst, 0o666 & ~umask)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder, fsync, then rename."""
    with atomic_writer(path, expected_bytes=len(data)) as f:
        f.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def atomic_save_safetensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """`safetensors.torch.save_file` made atomic (no half-written or temp file left behind)."""
    from safetensors.torch import save

    atomic_write_bytes(path, save(tensors, metadata=metadata))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save` made atomic (temp file + rename)."""
    import torch

    with atomic_writer(path) as f:
        torch.save(obj, f)


def is_temp_name(name: str) -> bool:
    """A name only the atomic writers use: `.NAME.*.tmp` files, `.tmp_*` folders."""
    return name.startswith(".") and (name.endswith(".tmp") or name.startswith(".tmp_"))


def sweep_temp_files(root: Path) -> int:
    """Delete every temp file or folder a killed writer left under `root`; returns how many.

    Call it only while no writer of `root` runs (a stage's start and end)."""
    root = Path(root)
    removed = 0
    for folder, dirs, files in os.walk(root):
        for name in [d for d in dirs if is_temp_name(d)]:
            shutil.rmtree(Path(folder) / name, ignore_errors=True)
            dirs.remove(name)
            removed += 1
        for name in files:
            if is_temp_name(name):
                (Path(folder) / name).unlink(missing_ok=True)
                removed += 1
    if removed:
        log.info("%s: removed %d temp files left by a killed run", root, removed)
    return removed


# ---------------------------------------------------------------- hashing and inputs


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_input(path: Path) -> dict:
    """Manifest entry for an input: a file (hash, lines) or a stage folder (its manifest hash)."""
    path = Path(path)
    if path.is_dir():
        m = path / MANIFEST
        return {"path": str(path), "manifest_sha256": file_sha256(m) if m.exists() else None}
    entry = {"path": str(path), "sha256": file_sha256(path), "bytes": path.stat().st_size}
    if path.suffix == ".jsonl":
        from eagle3.core.records import count_jsonl

        entry["records"] = count_jsonl(path)
    return entry


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------- stages


def read_manifest(stage_dir: Path) -> dict | None:
    m = Path(stage_dir) / MANIFEST
    return json.loads(m.read_text()) if m.exists() else None


def require_upstream(stage_dir: Path, allow_partial: bool = False) -> dict | None:
    """The manifest of an upstream stage folder; refuses a missing or incomplete one."""
    stage_dir = Path(stage_dir)
    if not stage_dir.is_dir():
        raise StageError(f"upstream folder {stage_dir} does not exist: run its stage first")
    manifest = read_manifest(stage_dir)
    if manifest is None or not manifest.get("complete"):
        what = "has no manifest.json" if manifest is None else "is incomplete"
        if not allow_partial:
            raise StageError(
                f"upstream folder {stage_dir} {what}: finish that stage (re-run its command) "
                "or pass --allow-partial to use what is there"
            )
        log.warning("using partial upstream %s (%s) because of --allow-partial", stage_dir, what)
    return manifest


@dataclass
class Stage:
    """One run of one stage: its folder, arguments, and the manifest written at the end."""

    name: str
    dir: Path
    args: dict
    started: float = field(default_factory=time.time)
    inputs: list = field(default_factory=list)

    def add_input(self, path: Path) -> None:
        self.inputs.append(describe_input(path))

    def finish(self, outputs: dict, extra: dict | None = None) -> dict:
        """Sweep temp files, then write the complete manifest; returns it."""
        sweep_temp_files(self.dir)
        manifest = {
            "stage": self.name,
            "args": self.args,
            "argv": sys.argv,
            "inputs": self.inputs,
            "outputs": outputs,
            "started": _iso(self.started),
            "finished": _iso(time.time()),
            "seconds": round(time.time() - self.started, 2),
            "disk_bytes": dir_bytes(self.dir),
            "complete": True,
        }
        manifest.update(extra or {})
        atomic_write_json(self.dir / MANIFEST, manifest)
        return manifest


@dataclass
class StageResult:
    """What a stage's `run` hands back to its script: the summary table's rows (None: nothing to
    show), the exit code, and an error for stderr."""

    rows: dict | None
    exit_code: int = 0
    error: str = ""


def open_stage(workdir: Path, folder: str, args: dict, force: bool = False) -> Stage | None:
    """Start a stage in `<workdir>/<folder>`; None when it is already complete (no-op).

    A folder with an incomplete manifest (or none) is kept so the stage can resume from it;
    `force` deletes the folder first.
    """
    stage_dir = Path(workdir) / folder
    manifest = read_manifest(stage_dir)
    if manifest and manifest.get("complete") and not force:
        log.info("%s is already complete (%s); nothing to do. Pass --force to redo it.",
                 stage_dir, manifest.get("finished"))
        return None
    if force and stage_dir.exists():
        log.info("--force: removing %s", stage_dir)
        try:
            shutil.rmtree(stage_dir)
        except OSError as e:  # rmtree names the entry relative to the folder it was emptying
            if not is_disk_error(e):
                raise
            raise DiskError(f"--force cannot remove {stage_dir} ({e.filename}: "
                            f"{DISK_ERRNOS[e.errno]}). Make the work directory writable, then "
                            "re-run the same command") from e
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / MANIFEST).unlink(missing_ok=True)  # a resumed stage is incomplete until it ends
    sweep_temp_files(stage_dir)  # what a killed run was writing
    return Stage(name=folder, dir=stage_dir, args=_jsonable(args))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def _jsonable(value: Any) -> Any:
    """Paths to strings, recursively, so that a config dataclass goes into JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


# ---------------------------------------------------------------- quarantine


class Quarantine:
    """Append-only JSONL of rejected records with the reason each was rejected."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.count = 0
        self.reasons: dict[str, int] = {}
        self._out = None

    def add(self, record_id: str | None, reason: str, record: Any = None) -> None:
        from eagle3.core.records import JsonlAppender

        if self._out is None:
            self._out = JsonlAppender(self.path)
        kind = reason.split(":")[0]
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
        self.count += 1
        self._out.write({"id": record_id, "reason": reason, "record": record})
        log.debug("quarantined %s: %s", record_id, reason)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
