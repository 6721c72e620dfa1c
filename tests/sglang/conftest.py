"""The real SGLang servers of tests/sglang/: one per tiny target for the whole folder.

`sglang_server` is session-scoped and parametrized by target (`sglang_helpers.TARGETS`: the tiny
DeepSeek-V3 of both latent widths, the tiny Llama, the tiny Qwen2), so pytest runs every test of
the folder against one server, stops it, then against the next: one server start per target
(~30 s each on 2 cores), one alive at a time. A test that applies to some targets only names
them with `@pytest.mark.sglang_targets(...)` (it is not collected for the others, never skipped).
Each server is the patched SGLang (the project's dump hook applied to the venv's deepseek_v2.py,
qwen2.py and llama.py by `patched_sglang`) with EAGLE3_DUMP_DIR set; the tests that do not dump
(01b, 05, the stand-in comparison) send rids without the dump prefix.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from sglang_helpers import (
    LAUNCH_ARGS,
    SERVER_ENV,
    TARGETS,
    ServedTarget,
    log_problems,
    patch_cli,
    sglang_package_dir,
    tree_sha256,
)


@dataclass
class PatchedSglang:
    package_dir: Path
    pristine: dict  # sha256 of every file before the patch
    model_files: tuple[str, ...]  # the hooked files, relative to the package


@dataclass
class RealServer:
    url: str
    target: Path
    dump_dir: Path
    log: Path
    name: str  # the key of sglang_helpers.TARGETS
    served: ServedTarget


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "sglang_targets(*names): the TARGETS the test runs on "
                                       "(default: all)")


def pytest_generate_tests(metafunc):
    if "sglang_server" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("sglang_targets")
        names = list(marker.args) if marker else list(TARGETS)
        assert set(names) <= set(TARGETS), names
        metafunc.parametrize("sglang_server", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def patched_sglang(sglang_python) -> PatchedSglang:
    """The SGLang venv with the project's dump hook applied by its CLI; reverted at the end,
    leaving every file as it was (checked)."""
    from eagle3.extract.patching import is_patched, load_hook_spec

    package_dir = sglang_package_dir(sglang_python)
    model_files = tuple(str(model.path) for model in load_hook_spec().model_files)
    if any(is_patched((package_dir / rel).read_text()) for rel in model_files):
        assert patch_cli(package_dir, "--revert").returncode == 0  # left by a killed run
    pristine = tree_sha256(package_dir)
    applied = patch_cli(package_dir)
    assert applied.returncode == 0, applied.stderr
    yield PatchedSglang(package_dir, pristine, model_files)
    reverted = patch_cli(package_dir, "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert tree_sha256(package_dir) == pristine


@pytest.fixture(scope="session")
def sglang_server(request, sglang_python, patched_sglang, tmp_path_factory) -> RealServer:
    from eagle3.core.launcher import LaunchedServer, sglang_command
    from eagle3.tiny.target import TinyTargetConfig, make_tiny_target

    name = request.param
    served = TARGETS[name]
    work = tmp_path_factory.mktemp(f"sglang_{name}")
    target = make_tiny_target(work / "target", TinyTargetConfig(arch=served.arch))
    dump_dir = work / "dump"
    dump_dir.mkdir(mode=0o700)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "server.log"
    command = sglang_command(sglang_python, f"--model-path {target} {LAUNCH_ARGS}", port)
    server = LaunchedServer(command, log, url, ready_timeout_s=600, stop_timeout_s=10,
                            env={**SERVER_ENV, "EAGLE3_DUMP_DIR": str(dump_dir)}).__enter__()
    try:
        yield RealServer(url, target, dump_dir, log, name, served)
    finally:
        server.stop()
    assert not log_problems(log, served), log_problems(log, served)
