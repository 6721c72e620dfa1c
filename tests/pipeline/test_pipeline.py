"""The demo runs every stage end to end; manifests, re-runs and upstream checks behave."""

from __future__ import annotations

import importlib
import json
import logging

import pytest

from eagle3.core.run_summary import STAGES
from eagle3.core.stage import StageError


def test_demo_completes_every_stage_when_run_from_scratch(demo_run):
    for stage in STAGES:
        manifest = json.loads((demo_run / stage / "manifest.json").read_text())
        assert manifest["complete"] is True, stage
        assert manifest["stage"] == stage
    out = (demo_run / "demo_stdout.txt").read_text()
    assert "acceptance length @3 steps" in out  # the closing summary table


def test_demo_outputs_follow_the_stage_layout(demo_run):
    assert (demo_run / "01_prepared/sharegpt_demo/conversations.jsonl").is_file()
    assert (demo_run / "01b_generated/tools_demo/tokenized.jsonl").is_file()
    assert (demo_run / "01c_merged/train.jsonl").is_file()
    assert (demo_run / "01c_merged/eval.jsonl").is_file()
    assert list((demo_run / "02b_hidden_states/train").glob("shard_00000/data_*.pt"))
    assert (demo_run / "03_vocab/vocab_mapping.safetensors").is_file()
    assert (demo_run / "04_train/final/config.json").is_file()
    assert (demo_run / "04_train/final/model.safetensors").is_file()
    results = json.loads((demo_run / "05_benchmark/results.json").read_text())
    for m in results["prompt_sets"]["eval"]["steps"].values():
        assert m["lossless_mismatches"] == 0
        assert 1.0 <= m["acceptance_length"]


def _main(script: str):
    return importlib.import_module(script).main


def test_stage_is_a_noop_when_rerun_after_completion(demo_run, caplog):
    caplog.set_level(logging.INFO)
    before = (demo_run / "03_vocab/manifest.json").read_text()
    rc = _main("03_build_vocab_mapping")(["--workdir", str(demo_run), "--target",
                                         str(demo_run / "target"), "--draft-vocab", "256"])
    assert rc == 0
    assert "already complete" in caplog.text
    assert (demo_run / "03_vocab/manifest.json").read_text() == before


def test_stage_refuses_upstream_when_its_manifest_is_missing(tmp_path, demo_run):
    import shutil

    shutil.copytree(demo_run / "01c_merged", tmp_path / "01c_merged")
    (tmp_path / "01c_merged/manifest.json").unlink()
    argv = ["--workdir", str(tmp_path), "--target", str(demo_run / "target")]
    with pytest.raises(StageError, match="--allow-partial"):
        _main("03_build_vocab_mapping")(argv)
    assert _main("03_build_vocab_mapping")(argv + ["--allow-partial", "--draft-vocab", "64"]) == 0


def test_every_script_prints_help(capsys):
    for script in ("01_prepare_datasets", "01b_generate_synthetic",
                   "02b_extract_hidden_states_sglang", "03_build_vocab_mapping", "04_train",
                   "05_benchmark"):
        with pytest.raises(SystemExit) as e:
            _main(script)(["--help"])
        assert e.value.code == 0
        assert "--workdir" in capsys.readouterr().out
