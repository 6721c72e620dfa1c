"""Stream mode with the sglang backend: 02b's dump-server client (against the stand-in SGLang
server, which computes each request's own forward pass) streams to a 04 --stream, and the draft
equals the one trained offline on hf files of each record alone."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from extract_helpers import build_vocab, copy_merged, main_02b, write_merged
from fake_dump_server import FakeDumpServer, Faults

from eagle3.core.target import default_capture_layers, read_target_info

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--epochs", "2", "--lr", "1e-3", "--max-seq-len", "256", "--pack-tokens", "256",
         "--num-workers", "1", "--eval-every", "100", "--log-every", "50", "--save-every", "4"]


def _train_cmd(w: Path, target: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "04_train.py"), "--workdir", str(w), "--target",
            str(target), *TRAIN, *extra]


@pytest.fixture(scope="module")
def offline(tiny_target_dir, tmp_path_factory) -> Path:
    w = write_merged(tmp_path_factory.mktemp("offline") / "w")
    build_vocab(w, tiny_target_dir)
    assert main_02b()(["--workdir", str(w), "--target", str(tiny_target_dir), "--backend", "hf",
                       "--max-batch-size", "1"]) == 0
    subprocess.run(_train_cmd(w, tiny_target_dir), cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return w


def test_stream_with_the_sglang_client_trains_the_offline_draft(offline, tiny_target_dir,
                                                               target_model, tmp_path):
    w = copy_merged(offline, tmp_path / "w")
    importlib.import_module("shutil").copytree(offline / "03_vocab", w / "03_vocab")
    layers = default_capture_layers(read_target_info(tiny_target_dir).num_hidden_layers)
    log = (tmp_path / "04.log").open("wb")
    trainer = subprocess.Popen(_train_cmd(w, tiny_target_dir, "--stream"), cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    with FakeDumpServer(target_model, tmp_path / "dump", layers, faults=Faults()) as server:
        rc = main_02b()(["--workdir", str(w), "--target", str(tiny_target_dir), "--server-url",
                         server.url, "--dump-dir", str(server.dump_config.dump_dir),
                         "--dump-wait-s", "0.3", "--stream", "--spool-gb", "1"])
    assert rc == 0
    assert trainer.wait(timeout=300) == 0, (tmp_path / "04.log").read_text()[-3000:]
    want = (offline / "04_train/final/model.safetensors").read_bytes()
    assert (w / "04_train/final/model.safetensors").read_bytes() == want
    manifest = json.loads((w / "02b_hidden_states/manifest.json").read_text())
    assert manifest["backend"] == "sglang" and manifest["stream"]["prefill_passes"] == 1.0
    assert manifest["outputs"]["train"]["extracted"] == 20
    assert list(server.dump_config.dump_dir.iterdir()) == []  # every dump was picked up
