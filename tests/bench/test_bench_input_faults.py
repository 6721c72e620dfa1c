"""Stage 05 with bad input files, a full disk and a SIGTERM:

| fault                                             | expected                                   |
|---------------------------------------------------|--------------------------------------------|
| prompt JSONL: bad JSON, torn line, not an object, | skipped into skipped.jsonl and counted     |
| no prompt, empty prompt                           | (--max-bad; past it TooManyBad)            |
| prompt JSONL with no usable line                  | InputFileError naming the file             |
| draft: cut model.safetensors, config.json not     | InputFileError naming the file, before any |
| JSON or lacking keys, d2t of the wrong size, a    | folder is made or server started; with     |
| NaN in a weight                                   | --check-only one line, exit 1              |
| ENOSPC writing results / report / plots           | DiskError naming the folder and bytes; no  |
|                                                   | partial file; a re-run completes           |
| SIGTERM mid-benchmark                             | partial results.json, exit 143, resume     |
|                                                   | line; the launched server is stopped       |
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_fake_server import FakeBenchServer
from bench_helpers import fake_sglang_shim, free_port, make_tiny_draft, port_is_open
from fault_helpers import fill_disk, small_disk, truncate_copy

from eagle3.bench.prompts import load_prompt_set
from eagle3.core.faults import BadRecords, DiskError, InputFileError, TooManyBad
from eagle3.core.stage import is_temp_name

ROOT = Path(__file__).resolve().parents[2]
SPEC_INFO = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


def _tokenized(rid: str, ids: list[int]) -> str:
    return json.dumps({"id": rid, "input_ids": ids, "n_prompt_tokens": len(ids)})


def _bad_prompt_file(path: Path) -> Path:
    lines = [_tokenized("good1", [5, 6, 7]), "{not json", "[1, 2]", json.dumps({"id": "x"}),
             json.dumps({"id": "e", "messages": []}), "", _tokenized("good2", [8, 9])]
    path.write_text("\n".join(lines) + "\n" + '{"id": "torn", "input_ids": [1, 2')
    return path


def test_prompt_set_skips_and_lists_each_bad_line(tmp_path):
    path = _bad_prompt_file(tmp_path / "mine.jsonl")
    bad = BadRecords(tmp_path / "stage", max_bad=-1)
    ps = load_prompt_set(str(path), tmp_path, None, None, bad)
    bad.close()
    assert ps.ids == ["good1", "good2"] and ps.prompts == [[5, 6, 7], [8, 9]]
    rows = [json.loads(x) for x in bad.path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["mine:2", "mine:3", "mine:4", "mine:5", "mine:8"]
    assert [r["reason"].split(":")[0] for r in rows] == [
        "bad JSON", "bad JSON", "no prompt", "no prompt", "torn line"]
    assert all(r["file"] == str(path) for r in rows)
    assert bad.summary()["skipped"] == 5


def test_prompt_set_stops_at_max_bad_and_names_the_line_without_a_skip_list(tmp_path):
    path = _bad_prompt_file(tmp_path / "mine.jsonl")
    with pytest.raises(TooManyBad, match="--max-bad 0"):
        load_prompt_set(str(path), tmp_path, None, None, BadRecords(tmp_path / "s", 0))
    with pytest.raises(InputFileError, match=r"mine.jsonl:2: bad JSON"):
        load_prompt_set(str(path), tmp_path, None)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputFileError, match="empty.jsonl: holds no usable prompt"):
        load_prompt_set(str(tmp_path / "empty.jsonl"), tmp_path, None, None,
                        BadRecords(tmp_path / "s2", -1))


# ---------------------------------------------------------------- the draft folder


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir, tmp_path_factory):
    return make_tiny_draft(tiny_target_dir, tmp_path_factory.mktemp("draft") / "final")


def _bench(argv):
    return importlib.import_module("05_benchmark").main(argv)


def _argv(workdir, target, draft, *extra):
    return ["--workdir", str(workdir), "--target", str(target), "--draft", str(draft),
            "--backend", "sglang", "--prompt-sets", "math", "--num-prompts", "2",
            "--max-new-tokens", "16", "--concurrency", "1", *extra]


def _cut_safetensors(d: Path) -> None:
    truncate_copy(d / "model.safetensors", 0.7)


def _config_not_json(d: Path) -> None:
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')


def _config_without_key(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    del config["draft_vocab_size"]
    (d / "config.json").write_text(json.dumps(config))


def _d2t_wrong_size(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["d2t"] = tensors["d2t"][:-5].clone()
    save_file(tensors, d / "model.safetensors")


def _nan_weight(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["fc.weight"][3, 5] = float("nan")
    save_file(tensors, d / "model.safetensors")


DAMAGES = [(_cut_safetensors, "model.safetensors", "truncated"),
           (_config_not_json, "config.json", "not valid JSON"),
           (_config_without_key, "config.json", "lacks ['draft_vocab_size']"),
           (_d2t_wrong_size, "model.safetensors", "d2t has shape"),
           (_nan_weight, "model.safetensors", "weight fc.weight [64, 192] holds 1 NaN/Inf")]


@pytest.mark.parametrize("damage,file,problem", DAMAGES)
def test_benchmark_refuses_a_damaged_draft_file_before_starting_anything(
        tmp_path, tiny_target_dir, tiny_draft, damage, file, problem):
    bad = Path(shutil.copytree(tiny_draft, tmp_path / "bad"))
    damage(bad)
    argv = _argv(tmp_path, tiny_target_dir, bad, "--launch-args", "--model-path m")
    with pytest.raises(InputFileError) as e:
        _bench(argv)
    assert e.value.path == str(bad / file) and problem in e.value.problem
    assert not (tmp_path / "05_benchmark").exists()


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("damage,file,problem", DAMAGES)
def test_check_only_refuses_a_damaged_draft_file_in_one_line(
        tmp_path, tiny_target_dir, tiny_draft, damage, file, problem, backend, capsys):
    from eagle3.core.faults import script_main

    bad = Path(shutil.copytree(tiny_draft, tmp_path / "bad"))
    damage(bad)
    argv = ["--check-only", "--backend", backend, "--workdir", str(tmp_path), "--target",
            str(tiny_target_dir), "--draft", str(bad), "--steps", "3"]
    assert script_main(lambda: _bench(argv), "05") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"05: error: {bad / file}: " in err and problem in err


# ---------------------------------------------------------------- a full disk


def test_benchmark_stops_on_a_full_disk_and_completes_once_space_is_back(
        tmp_path, tiny_target_dir, tiny_draft):
    with small_disk(tmp_path / "disk", kib=1024) as disk:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        filler = fill_disk(disk, leave=24 * 1024, name="filler")  # room for requests, not plots
        with FakeBenchServer({}, step_s=0.0) as base, \
                FakeBenchServer(SPEC_INFO, tokens_per_verify=3, step_s=0.0) as spec:
            argv = _argv(disk / "run", tiny_target_dir, tiny_draft, "--baseline-url", base,
                         "--spec-url", spec)
            with pytest.raises(DiskError) as e:
                _bench(argv)
            out = disk / "run" / "05_benchmark"
            assert str(out) in str(e.value) and "bytes" in str(e.value)
            assert not [p for p in out.iterdir() if is_temp_name(p.name)]  # nothing partial
            assert not (out / "manifest.json").exists()
            filler.unlink()
            assert _bench(argv) == 0
        assert json.loads((out / "manifest.json").read_text())["complete"]
        assert (out / "speedup_vs_concurrency.png").stat().st_size > 1000


# ---------------------------------------------------------------- SIGTERM


def _start(argv, env_path: str, tmp_path: Path) -> subprocess.Popen:
    """05 in a process of its own; its stderr (the log) goes to tmp_path/stderr.txt."""
    env = {**os.environ, "PYTHONPATH": f"{env_path}:{ROOT}"}
    with (tmp_path / "stderr.txt").open("w") as err:
        return subprocess.Popen([sys.executable, str(ROOT / "05_benchmark.py"), *argv],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def _wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_sigterm_mid_benchmark_writes_partial_results_and_stops_the_launched_server(
        tmp_path, tiny_target_dir, tiny_draft):
    port = free_port()
    argv = _argv(tmp_path, tiny_target_dir, tiny_draft, "--launch-args",
                 "--model-path m --load-seconds 0.2", "--port", str(port),
                 "--ready-timeout-s", "60", "--concurrency", "1", "2", "--num-prompts", "4",
                 "--max-new-tokens", "24")
    proc = _start(argv, fake_sglang_shim(tmp_path), tmp_path)
    stderr_file = tmp_path / "stderr.txt"
    # The baseline's first level is done (its log line): SIGTERM during its second.
    _wait_for(lambda: "baseline math c=1:" in stderr_file.read_text(), 90)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    stderr = stderr_file.read_text()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in stderr and "re-run the same command" in stderr
    assert "Traceback" not in stderr
    out = tmp_path / "05_benchmark"
    results = json.loads((out / "results.json").read_text())
    assert results["partial"] and results["stopped_by"] == "SIGTERM"
    assert list(results["baseline_only"]["math"]) == ["1"]  # the finished level, nothing more
    assert results["prompt_sets"] == {}
    assert "PARTIAL" in (out / "report.md").read_text()
    assert not (out / "manifest.json").exists()  # never presented as a full run
    assert not port_is_open(port)


def test_sigterm_while_a_launched_server_loads_stops_at_once(tmp_path, tiny_target_dir,
                                                            tiny_draft):
    port = free_port()
    argv = _argv(tmp_path, tiny_target_dir, tiny_draft, "--launch-args",
                 "--model-path m --load-seconds 120", "--port", str(port),
                 "--ready-timeout-s", "600")
    proc = _start(argv, fake_sglang_shim(tmp_path), tmp_path)
    log = tmp_path / "05_benchmark" / "server_baseline.log"
    _wait_for(lambda: log.exists() and "starting" in log.read_text(), 60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 30
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
    _wait_for(lambda: f"--port {port}" not in _process_list(), 15)  # the server is gone


def _process_list() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
