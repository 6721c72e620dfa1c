"""benchmarks/bench_stream.py: its CPU smoke run on the demo's merged data (offline 02b then 04,
02b --stream beside 04 --stream, a one-prompt 05 of each draft), its figures read back against
the manifests the stages wrote; and its nvidia-smi parsing, which only a GPU host runs for real.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from stream_helpers import stream_workdir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_stream.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_stream", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(demo_run, tmp_path_factory) -> tuple[Path, dict]:
    w = stream_workdir(demo_run, tmp_path_factory.mktemp("bench_stream") / "w")
    out = w.parent / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workdir", str(w), "--device", "cpu",
                           "--out", str(out), "--eval-prompts", "1", "--eval-max-new", "4",
                           "--sample-s", "0.25"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return w, json.loads((out / "bench_stream.json").read_text())


def test_bench_stream_times_both_modes_and_bounds_the_stream_disk(bench):
    w, r = bench
    for key in ("device", "inputs", "flags", "spool", "offline", "stream", "eval", "comparison",
                "commands"):
        assert key in r, key
    assert r["device"]["name"] == "cpu"
    off, st = r["offline"], r["stream"]
    assert off["ok"] and st["ok"]
    assert off["02b"]["wall_s"] > 0 and off["04"]["wall_s"] > 0
    assert off["wall_s"] == pytest.approx(off["02b"]["wall_s"] + off["04"]["wall_s"], abs=0.02)
    assert st["wall_s"] == max(st["02b"]["wall_s"], st["04"]["wall_s"])
    assert set(r["commands"]) == {"offline 02b", "offline 04", "stream 02b", "stream 04",
                                  "offline 05", "stream 05"}
    assert "--stream" in r["commands"]["stream 02b"] and "--stream" in r["commands"]["stream 04"]

    # disk: offline holds every train file; stream at most the budget beside the eval split
    budget = r["spool"]["budget_bytes"]
    assert off["disk"]["peak_bytes"] >= off["disk"]["final_bytes"] > 0
    assert 0 < st["disk"]["peak_bytes"] <= budget + st["disk"]["eval_split_bytes"]
    assert st["disk"]["peak_bytes"] < off["disk"]["peak_bytes"]

    # 02b's manifest says stream, with the budget it was given
    manifest = json.loads((w / "stream/02b_hidden_states/manifest.json").read_text())
    assert manifest["outputs"]["train"]["stream"] is True
    assert st["manifest_stream"] == manifest["stream"]
    assert manifest["stream"]["budget_bytes"] == budget
    assert 0 < manifest["stream"]["peak_bytes"] <= budget
    assert manifest["stream"]["prefill_passes"] >= 1.0

    for side in (off, st):
        assert side["train"]["tok_s"] > 0 and 0 <= side["train"]["data_wait"] <= 1
        assert side["gpu"] == {"sampled": False, "reason": "--device cpu: no GPU to sample"}
    assert off["train"]["num_steps"] == st["train"]["num_steps"]


def test_bench_stream_reports_acceptance_with_loop_share_for_both_drafts(bench):
    w, r = bench
    for side in ("offline", "stream"):
        e = r["eval"][side]
        assert e["rc"] in (0, 1)
        (figures,) = e["sets"].values()
        m = figures["steps"]["3"]
        assert m["acceptance_length"] >= 1.0
        assert 0 <= m["loop_share"] <= 1 and m["loop_free_acceptance"] is not None
        res = json.loads((w / side / "05_benchmark/results.json").read_text())
        (ps,) = res["prompt_sets"].values()
        assert m["acceptance_length"] == ps["steps"]["3"]["acceptance_length"]
    out = Path(r["argv"][r["argv"].index("--out") + 1])
    md = (out / "bench_stream.md").read_text()
    assert "acceptance @3" in md and "peak disk" in md
    with tarfile.open(out / "bench_stream_logs.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"stream_02b.log", "stream_04.log", "offline_05.log",
            "stream_02b_hidden_states_manifest.json"} <= names


def test_nvidia_smi_output_is_mapped_to_the_02b_and_04_process_trees():
    bs = _module()
    pmon = ("# gpu         pid   type     sm    mem    enc    dec    jpg    ofa     fb   ccpm"
            "    command\n"
            "# Idx           #    C/G      %      %      %      %      %      %     MB     MB"
            "    name\n"
            "    0        101     C     62     20      -      -      -      -   2300      0"
            "    python3\n"
            "    0        202     C      -      -      -      -      -      -    900      0"
            "    python3\n"
            "    0        999     C     10      1      -      -      -      -    100      0"
            "    other\n")
    rows = bs.parse_pmon(pmon)
    assert [(x["pid"], x["sm"], x["fb_mib"]) for x in rows] == [
        (101, 62.0, 2300.0), (202, None, 900.0), (999, 10.0, 100.0)]
    assert bs.parse_pmon("# gpu pid type sm mem command\n# Idx # C/G % % name\n"
                         "    0      -     -      -      -   -\n") == []
    assert bs.parse_apps("101, 2300\n202, 900\n") == [{"pid": 101, "mem_mib": 2300.0},
                                                      {"pid": 202, "mem_mib": 900.0}]
    assert bs.parse_gpu("87, 4000\n") == [{"util": 87.0, "mem_mib": 4000.0}]

    sampler = bs.Sampler([], 1.0, None)
    sampler.sides = {"02b": 100, "04": 200}
    owner = {101: "02b", 202: "04"}
    for sm in (62.0, 40.0):
        sampler.samples.append({
            "t": 0, "disk": {}, "alive": ["02b", "04"], "gpu": [{"util": 90.0, "mem_mib": 1}],
            "apps": [{"pid": 101, "mem_mib": 2300.0, "side": "02b"},
                     {"pid": 202, "mem_mib": 900.0, "side": "04"}],
            "pmon": [{**x, "sm": sm if x["pid"] == 101 else x["sm"],
                      "side": owner.get(x["pid"], "other")} for x in rows]})
    g = sampler.gpu_summary()
    assert g["02b"]["sm_pct"]["mean"] == 51.0 and g["02b"]["gpu_mem_mib_max"] == 2300.0
    assert g["04"]["sm_pct"]["mean"] == 0.0  # listed without a sample: no kernel then
    assert g["gpu_util_pct"]["p50"] == 90.0 and "note" not in g
    for s in sampler.samples:  # pids of another namespace: nothing maps
        s["apps"] = [{**a, "side": "other"} for a in s["apps"]]
        s["pmon"] = [{**x, "side": "other"} for x in s["pmon"]]
    assert "none of them in the 02b / 04 process trees" in sampler.gpu_summary()["note"]


def test_locate_accepts_the_reference_root_or_its_main_run(tmp_path):
    bs = _module()
    root = tmp_path / "refs"
    merged = root / "main" / "01c_merged"
    merged.mkdir(parents=True)
    (merged / "manifest.json").write_text(json.dumps({"complete": True}))
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text("{}")
    (root / "heldout").mkdir()
    for given in (root, root / "main"):
        assert bs.locate(given, None) == (root / "main", root / "target", root)
    with pytest.raises(SystemExit, match="not a complete merged split"):
        bs.locate(tmp_path / "nothing", None)
