"""The real SGLang servers of tests/sglang/: one per latent width for the whole folder.

`sglang_server` is session-scoped and parametrized by width, so pytest runs every test of the
folder against the 16-wide server, stops it, then against the 576-wide one: two server starts
(~30 s each on 2 cores), one alive at a time. Each server is the patched SGLang (the project's
dump hook applied to the venv by `patched_sglang`) with EAGLE3_DUMP_DIR set; the tests that do
not dump (01b, 05, the stand-in comparison) send rids without the dump prefix.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from sglang_helpers import (
    LATENTS,
    LAUNCH_ARGS,
    SERVER_ENV,
    log_problems,
    patch_cli,
    sglang_package_dir,
    tree_sha256,
)


@dataclass
class PatchedSglang:
    package_dir: Path
    pristine: dict  # sha256 of every file before the patch


@dataclass
class RealServer:
    url: str
    target: Path
    dump_dir: Path
    log: Path
    latent: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def patched_sglang(sglang_python) -> PatchedSglang:
    """The SGLang venv with the project's dump hook applied by its CLI; reverted at the end,
    leaving every file as it was (checked)."""
    from eagle3.extract.patching import MODEL_FILE, is_patched

    package_dir = sglang_package_dir(sglang_python)
    if is_patched((package_dir / MODEL_FILE).read_text()):  # left patched by a killed run
        assert patch_cli(package_dir, "--revert").returncode == 0
    pristine = tree_sha256(package_dir)
    applied = patch_cli(package_dir)
    assert applied.returncode == 0, applied.stderr
    yield PatchedSglang(package_dir, pristine)
    reverted = patch_cli(package_dir, "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert tree_sha256(package_dir) == pristine


@pytest.fixture(scope="session", params=list(LATENTS))
def sglang_server(request, sglang_python, patched_sglang, tmp_path_factory) -> RealServer:
    from eagle3.core.launcher import LaunchedServer, sglang_command
    from eagle3.tiny.target import TinyTargetConfig, make_tiny_target

    latent = request.param
    work = tmp_path_factory.mktemp(f"sglang_{latent}")
    target = make_tiny_target(work / "target", TinyTargetConfig(arch=LATENTS[latent]))
    dump_dir = work / "dump"
    dump_dir.mkdir(mode=0o700)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "server.log"
    command = sglang_command(sglang_python, f"--model-path {target} {LAUNCH_ARGS}", port)
    server = LaunchedServer(command, log, url, ready_timeout_s=600, stop_timeout_s=10,
                            env={**SERVER_ENV, "EAGLE3_DUMP_DIR": str(dump_dir)}).__enter__()
    try:
        yield RealServer(url, target, dump_dir, log, latent)
    finally:
        server.stop()
    assert not log_problems(log), log_problems(log)
