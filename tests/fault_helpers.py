"""Fault injection shared by the stages' fault tests: a small real disk that fills up or turns
read-only (a tmpfs mount where the machine allows it), a write shim where it does not, and
damaged copies of files, and a server that accepts connections and never answers.

    with small_disk(tmp_path / "disk", kib=256) as disk:   # a real tmpfs, or None
        ...
        fill_disk(disk, leave=8_000)                      # a ballast file: ~8 kB stay free
    with full_disk_shim(monkeypatch, after_bytes=1000):   # every file write past 1000 B: ENOSPC
        ...
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path


def _mount(*args: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextmanager
def small_disk(path: Path, kib: int = 256):
    """A tmpfs of `kib` KiB mounted at `path` (yields the path), or None where mounting is not
    allowed (not root, no mount): the caller then uses `full_disk_shim`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)):
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(disk: Path, leave: int, name: str = "ballast") -> Path:
    """Write `disk/name` until about `leave` bytes stay free, as another process filling the disk
    would. The stage may be writing at the same moment, so the space seen before the ballast is
    written can be gone by the time it is: the ballast then stops at ENOSPC (a disk fuller than
    asked) instead of failing the test with the stage's error."""
    path = Path(disk) / name
    stat = os.statvfs(disk)
    todo = max(0, stat.f_bavail * stat.f_frsize - leave)
    chunk = bytes(1 << 16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while todo > 0:
            todo -= os.write(fd, chunk[:min(todo, len(chunk))])
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return path


def make_read_only(mountpoint: Path) -> bool:
    """Remount a `small_disk` read-only; False where that is not allowed."""
    return _mount("-o", "remount,ro", str(mountpoint))


def make_writable(mountpoint: Path) -> bool:
    return _mount("-o", "remount,rw", str(mountpoint))


class _FullFile(io.FileIO):
    """A file whose writes fail with ENOSPC once `budget[0]` bytes have been written in all."""

    budget: list[int]

    def write(self, b) -> int:
        n = len(memoryview(b))
        if n > self.budget[0]:
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        self.budget[0] -= n
        return super().write(b)


@contextmanager
def full_disk_shim(monkeypatch, after_bytes: int = 0, under: Path | None = None):
    """Within the block, writes to files opened for writing (under `under`, if given) fail with
    ENOSPC once `after_bytes` bytes have been written in all: the disk-full case where no small
    disk can be mounted. Covers `open`, `Path.open` and `os.fdopen` (the atomic writers)."""
    budget = [after_bytes]
    real_open, real_fdopen = builtins.open, os.fdopen

    def wanted(file, mode) -> bool:
        if not any(c in mode for c in "wax+"):
            return False
        if under is None or isinstance(file, int):
            return True
        return Path(file).resolve().is_relative_to(Path(under).resolve())

    def wrap(raw, mode, buffering):
        cls = type("FullFile", (_FullFile,), {"budget": budget})
        f = cls(raw, mode.replace("b", "").replace("t", "") or "w", closefd=True)
        if buffering == 0:
            return f
        buf = io.BufferedWriter(f, buffer_size=buffering if buffering > 1 else 8192)
        return buf if "b" in mode else io.TextIOWrapper(buf, encoding="utf-8")

    def fake_open(file, mode="r", buffering=-1, *a, **kw):
        if not wanted(file, mode):
            return real_open(file, mode, buffering, *a, **kw)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
        if "+" in mode:
            flags = (flags & ~os.O_WRONLY) | os.O_RDWR
        return wrap(os.open(file, flags, 0o644), mode, buffering)

    def fake_fdopen(fd, mode="r", buffering=-1, *a, **kw):
        if not wanted(fd, mode):
            return real_fdopen(fd, mode, buffering, *a, **kw)
        return wrap(fd, mode, buffering)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "fdopen", fake_fdopen)
    try:
        yield budget
    finally:
        monkeypatch.setattr(builtins, "open", real_open)
        monkeypatch.setattr(io, "open", real_open)
        monkeypatch.setattr(os, "fdopen", real_fdopen)


def truncate_copy(path: Path, fraction: float = 0.5) -> None:
    """Cut a file to `fraction` of its size (a copy interrupted by a full disk)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:int(len(data) * fraction)])


def flip_bytes(path: Path, n: int = 64, offset_fraction: float = 0.6) -> None:
    """Invert `n` bytes in the middle of a file (bit rot that keeps its size)."""
    data = bytearray(Path(path).read_bytes())
    start = int(len(data) * offset_fraction)
    for i in range(start, min(start + n, len(data))):
        data[i] ^= 0xFF
    Path(path).write_bytes(bytes(data))


@contextmanager
def silent_server():
    """The URL of a server that accepts every connection and never answers: a socket on
    127.0.0.1 that listens and never reads (the kernel completes each handshake into its
    backlog), as a hung process does. Yields `http://127.0.0.1:<port>`."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
