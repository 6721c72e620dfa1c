"""What the real-SGLang tests share: the server's flags and environment, the patch on the SGLang
venv, and the HF reference they are compared with (tests/sglang/conftest.py starts the servers).

The server is the real `python -m sglang.launch_server` of the SGLang venv (`make install-sglang`:
.venv-sglang/, or EAGLE3_SGLANG_PYTHON), on CPU, with `tests/sglang_support/` as its only
PYTHONPATH entry (the import-only stand-ins and the MLA fix: that folder's
`eagle3_sglang_test_support/__init__.py` says why each exists).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_support.eagle3_sglang_test_support.import_only import STANDIN_USED_MARK
from sglang_support.eagle3_sglang_test_support.mla_plugin import LOADED_MARK

ROOT = Path(__file__).resolve().parent.parent
SUPPORT_DIR = ROOT / "tests" / "sglang_support"

# torch_native: the CPU attention backend that needs no kernel library. float32 like the HF
# reference. A small KV pool (the default sizes it from free memory: 15 GB and 20 s at start-up).
# --chunked-prefill-size 8: prompts longer than 8 tokens prefill in several passes, and short
# ones share a pass (what the dump must reassemble). --disable-radix-cache and
# --skip-server-warmup: the dump server's flags (patches/README.md); the other tests (01b, 05)
# share the server and do not mind them.
LAUNCH_ARGS = ("--device cpu --attention-backend torch_native --dtype float32 "
               "--max-total-tokens 4096 --chunked-prefill-size 8 --disable-radix-cache "
               "--skip-server-warmup --host 127.0.0.1")
# SGLang's CPU platform is on only with SGLANG_USE_CPU_ENGINE=1 (sglang.srt.utils.is_cpu):
# without it the CPU rope falls through to a vLLM kernel import and the server dies.
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SUPPORT_DIR)}


@dataclass(frozen=True)
class ServedTarget:
    """A tiny target the session serves (eagle3/tiny/archs.py) and what its server log shows."""

    arch: str  # TinyTargetConfig.arch
    model_class: str  # the SGLang class that serves it, as the dump hook logs it
    needs_mla_fix: bool  # DeepSeek MLA: the test support's torch_native plugin must load


# The targets of tests/sglang/, one server each: the two latent widths of the tiny DeepSeek-V3,
# kv_lora_rank 16 (+ 8 rope; the default tiny target) and kv_lora_rank 512 + qk_rope_head_dim 64
# = 576 (Kimi-K2.5's), both hooked in deepseek_v2.py; the tiny Llama (SmolLM2's class, llama.py)
# and the tiny Qwen2 (Qwen2.5-Coder's layout, qwen2.py). SGLang 0.5.23 serves the last two on
# CPU with torch_native as it serves any dense model: no config field, env var or plugin.
TARGETS = {
    "latent16": ServedTarget("deepseek_v3", "DeepseekV3ForCausalLM", needs_mla_fix=True),
    "latent576": ServedTarget("deepseek_v3_vllm", "DeepseekV3ForCausalLM", needs_mla_fix=True),
    "llama": ServedTarget("llama", "LlamaForCausalLM", needs_mla_fix=False),
    "qwen2": ServedTarget("qwen2", "Qwen2ForCausalLM", needs_mla_fix=False),
}
DEEPSEEK_TARGETS = ("latent16", "latent576")


def sglang_package_dir(python: str) -> Path:
    """The `sglang` package of the venv's python (located, not imported)."""
    out = subprocess.run([python, "-c", "import importlib.util as u; "
                          "print(u.find_spec('sglang').submodule_search_locations[0])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def patch_cli(package_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python -m eagle3.extract.patching --sglang-dir <site-packages> [flags]` (the project's
    CLI, run by the pipeline's python on the SGLang venv's files)."""
    return subprocess.run([sys.executable, "-m", "eagle3.extract.patching", "--sglang-dir",
                           str(package_dir.parent), *flags], cwd=ROOT, capture_output=True,
                          text=True)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_sha256(package_dir: Path) -> dict[str, str]:
    """sha256 of every file of the package but bytecode caches (written by imports)."""
    return {str(p.relative_to(package_dir)): file_sha256(p) for p in sorted(package_dir.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def recorded_sha256(package_dir: Path, rel: str) -> str:
    """The sha256 pip recorded at install for `sglang/<rel>` (RECORD of sglang's dist-info)."""
    import base64

    (record,) = package_dir.parent.glob("sglang-*.dist-info/RECORD")
    for line in record.read_text().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == f"sglang/{rel}":
            algo, b64 = digest.split("=", 1)
            assert algo == "sha256"
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    raise KeyError(rel)


def hf_states(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(every HF `output_hidden_states` entry [T, H], final post-norm state [T, H]), float32."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    states = [h[0] for h in out.hidden_states]
    return states, states[-1]


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A bf16 state equal to a float32 reference up to bf16 storage: the float32 server and
    transformers differ by float32 rounding (~1e-6 relative), which can move a value across a
    bf16 rounding boundary: one bf16 step (2^-7 relative at most) from the reference rounded to
    bf16; atol for values near 0, whose bf16 step is below float32 noise."""
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2 ** -7, atol=1e-5,
                               msg=lambda m: f"{what}: {m}")


def log_problems(log: Path, target: ServedTarget) -> list[str]:
    """What a server log must not hold (a call into a stand-in, a plugin that failed), and
    what it must: the dump hook switched on in the target's class, and for a DeepSeek target
    the MLA fix loaded."""
    text = log.read_text(errors="replace")
    bad = [line for line in text.splitlines()
           if STANDIN_USED_MARK in line or "Failed to execute general plugin" in line
           or "Failed to load plugin" in line]
    if target.needs_mla_fix and LOADED_MARK not in text:
        bad.append(f"the MLA fix never loaded ({LOADED_MARK!r} missing)")
    hooked = f"eagle3 dump: {target.model_class} capturing layers"
    if hooked not in text:
        bad.append(f"the dump hook never ran in {target.model_class} ({hooked!r} missing)")
    return bad


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def post_generate(url: str, body: dict) -> dict:
    """The server's JSON answer to one `/generate` request."""
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())
