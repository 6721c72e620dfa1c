"""tools/commit_draft.py lays out a committed draft folder (final/, 04's manifest, the
held-out prompts, manifest.json, SHA256SUMS), and the committed reference draft matches its list.

The fake 04 folder is a small random Llama-style draft exported by 04's own exporters.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


commit_draft = _load("tools/commit_draft.py", "commit_draft")
bench_serve_vllm = _load("benchmarks/bench_serve_vllm.py", "bench_serve_vllm")
REFERENCE_DRAFT = bench_serve_vllm.REFERENCE_DRAFT


@pytest.fixture(scope="module")
def stage04(tmp_path_factory) -> Path:
    """A 04 stage folder as 04 writes it (final/, final_speculators/ for its target and
    TTT steps, a complete manifest.json, a checkpoint)."""
    from draft_helpers import llama_draft

    from eagle3.draft.export import export_sglang
    from eagle3.draft.speculators import export_speculators

    folder = tmp_path_factory.mktemp("run") / "04_train"
    draft = llama_draft()
    export_sglang(draft, folder / "final")
    target = folder.parent / "target"  # what 04 names as the verifier (its architectures)
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    export_speculators(draft, folder / "final_speculators", str(target), 5)  # --ttt-steps 5
    (folder / "checkpoints/step_000010").mkdir(parents=True)
    (folder / "checkpoints/step_000010/model.pt").write_bytes(b"not for git")
    manifest = {"stage": "04_train", "complete": True, "started": "2026-12-05T10:00:00",
                "seconds": 12.5, "world_size": 1, "inputs": [{"path": "x", "manifest_sha256": "y"}],
                "args": {"epochs": 3, "lr": 1e-3, "target": str(target), "draft_arch": "llama",
                         "ttt_steps": 5},
                "outputs": {"num_steps": 10, "tokens": 5000, "eval_sim_accept": 1.5},
                "draft_config": {"hidden_size": 32}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_commit_draft_lays_out_the_folder_and_its_sha256_list(stage04, tmp_path):
    out = tmp_path / "draft"
    rc = commit_draft.main([str(out), "--from", str(stage04), "--prompts",
                            str(ROOT / "prompts/chat.jsonl"), "--source", "a test"])
    assert rc == 0
    assert commit_draft.folder_files(out) == [
        "final/config.json", "final/model.safetensors", "heldout_chat.jsonl", "manifest.json",
        "train_manifest.json"]  # no checkpoint, no second copy of the weights
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "a test"
    assert manifest["prompts"] == {"file": "heldout_chat.jsonl", "records": 12}
    assert manifest["train"]["outputs"]["eval_sim_accept"] == 1.5
    assert manifest["train"]["args"]["epochs"] == 3
    assert manifest["bytes"] == sum(manifest["files"].values()) > 0
    assert manifest["files"]["final/model.safetensors"] == (
        stage04 / "final/model.safetensors").stat().st_size
    assert commit_draft.check_sha256_list(out) == []
    # the list is sha256sum's format: the standard tool agrees
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=out).returncode == 0


def test_check_sha256_list_names_a_changed_a_missing_and_an_unlisted_file(stage04, tmp_path):
    out = tmp_path / "draft"
    commit_draft.lay_out(out, "a test", stage04, ROOT / "prompts/chat.jsonl")
    weights = out / "final/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (out / "heldout_chat.jsonl").unlink()
    (out / "notes.txt").write_text("x")
    problems = commit_draft.check_sha256_list(out)
    assert problems == ["final/model.safetensors: sha256 differs from SHA256SUMS",
                        "heldout_chat.jsonl: listed in SHA256SUMS, missing",
                        "notes.txt: not listed in SHA256SUMS"]
    proc = subprocess.run([sys.executable, "tools/commit_draft.py", str(out), "--check"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "3 problems" in proc.stdout


def test_commit_draft_refuses_a_folder_without_the_draft(stage04, tmp_path, capsys):
    src = tmp_path / "04_train"
    (src / "final_speculators").mkdir(parents=True)
    rc = commit_draft.main([str(tmp_path / "draft"), "--from", str(src), "--prompts",
                            str(ROOT / "prompts/chat.jsonl"), "--source", "a test"])
    assert rc == 1
    assert "final: missing" in capsys.readouterr().err


def test_the_benchmark_serves_the_tensors_04_exported_for_vllm(stage04, tmp_path):
    """The committed folder holds final/ only; the vLLM layout the benchmark writes from it
    holds 04's final_speculators/ tensors, bit for bit."""
    from safetensors.torch import load_file

    out = tmp_path / "draft"
    commit_draft.lay_out(out, "a test", stage04, ROOT / "prompts/chat.jsonl")
    folder = bench_serve_vllm.read_draft_folder(out, tmp_path / "work",
                                                stage04.parent / "target")
    assert folder.vllm == tmp_path / "work/final_speculators"
    ours = load_file(folder.vllm / "model.safetensors")
    theirs = load_file(stage04 / "final_speculators/model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    config = json.loads((folder.vllm / "config.json").read_text())
    assert config == json.loads((stage04 / "final_speculators/config.json").read_text())


def test_the_committed_reference_draft_matches_its_sha256_list():
    assert commit_draft.check_sha256_list(REFERENCE_DRAFT) == []
    manifest = json.loads((REFERENCE_DRAFT / "manifest.json").read_text())
    assert manifest["bytes"] == sum((REFERENCE_DRAFT / f).stat().st_size for f in manifest["files"])
