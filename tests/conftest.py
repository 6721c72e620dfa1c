"""Shared fixtures: the tiny target (built once per session) and one demo run of the pipeline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    from eagle3.tiny.target import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def target_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture(scope="session")
def demo_target_model(demo_run):
    """The demo's own target (pretrained on the demo text, unlike `target_model`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_run / "target").eval()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """The README's demo (demo.sh) run once into a temp work directory."""
    workdir = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run(["bash", str(ROOT / "demo.sh"), str(workdir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"demo.sh failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    (workdir / "demo_stdout.txt").write_text(proc.stdout)
    return workdir


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of a vLLM venv (`make install-vllm`: .venv-vllm/; EAGLE3_VLLM_PYTHON points
    elsewhere, e.g. /opt/vllm-venv/bin/python). In CI (CI=true) a missing vLLM fails the test."""
    import os

    python = os.environ.get("EAGLE3_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    if not Path(python).is_file():
        message = (f"no vLLM python at {python}: run `make install-vllm` or set "
                   "EAGLE3_VLLM_PYTHON")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory) -> Path:
    """The demo (demo.sh) on the tiny Llama target, run once: 01 -> 05 (hf)."""
    import os

    workdir = tmp_path_factory.mktemp("llama") / "run"
    proc = subprocess.run(["bash", str(ROOT / "demo.sh"), str(workdir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "EAGLE3_TINY_ARCH": "llama"})
    if proc.returncode != 0:
        raise AssertionError(f"demo.sh (llama) failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    (workdir / "demo_stdout.txt").write_text(proc.stdout)
    return workdir
