"""benchmarks/gpu_pipeline.py's pieces without a GPU or a server: every step's command parses
with its script, the recipe it scales, the deadline that skips steps, the record a re-run
keeps. The route itself runs on CPU against the real SGLang with `python
benchmarks/gpu_pipeline.py --profile cpu-qwen2-smoke` (BENCHMARKS.md, the pipeline on
Qwen2.5-Coder)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from eagle3.core.cli import parse_config
from eagle3.prepare.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_pipeline", ROOT / "benchmarks/gpu_pipeline.py")
gp = sys.modules["gpu_pipeline"] = importlib.util.module_from_spec(_spec)  # dataclasses look
_spec.loader.exec_module(gp)  # their module up while it executes


def _script_config(script: str):
    """The config dataclass a numbered script parses its flags into."""
    from reference.stages import script_module

    stage = {v: k for k, v in gp.SCRIPTS.items()}[script]
    (cls,) = {v for v in vars(script_module(stage)).values()
              if dataclasses.is_dataclass(v) and v.__name__.endswith("Config")
              and "workdir" in {f.name for f in dataclasses.fields(v)}}
    return cls


@pytest.mark.parametrize("name", sorted(gp.PROFILES))
def test_every_step_command_parses_with_its_script(name, tmp_path):
    profile = gp.PROFILES[name]
    target = tmp_path / "target"
    target.mkdir()
    for f in ("config.json", "tokenizer_config.json"):  # what the parsers look for
        (target / f).write_text("{}")
    work = tmp_path / "run"
    recipe = gp.scaled_recipe(profile, tmp_path / "recipe.json")
    url = "http://127.0.0.1:30050"
    commands = [*gp.data_commands(profile, work, target, url, recipe),
                *gp.train_commands(profile, work, target),
                ("05", gp.bench_command(profile, work, target, tmp_path / "b", url,
                                        [url.replace("50", "61"), url.replace("50", "62")],
                                        fixed=True)),
                ("05", gp.offline_command(profile, work, target, tmp_path / "o"))]
    for step, argv in commands:
        script = next(s for s in gp.SCRIPTS.values() if argv[1].endswith(s))
        cfg = parse_config(_script_config(script), argv[2:])
        assert Path(cfg.workdir) in (work, tmp_path / "b", tmp_path / "o"), step
    bench = parse_config(_script_config("05_benchmark.py"), commands[-2][1][2:])
    assert bench.ignore_eos and len(bench.spec_url) == 2 and bench.temperature == 0
    assert bench.draft == work / "04_train" / "final"
    extract = parse_config(_script_config("02b_extract_hidden_states_sglang.py"),
                           commands[3][1][2:])
    assert extract.backend == "sglang" and str(extract.dump_dir) == profile.dump_dir


def test_gpu_profile_serves_each_setting_once_and_names_its_preset():
    from eagle3.core.presets import get_preset

    p = gp.PROFILES["h100-qwen-coder"]
    assert get_preset(p.preset).hidden_size == 1536
    flags = [tuple(s.flags) for s in p.settings]
    assert len(set(flags)) == len(flags) == len({s.name for s in p.settings})
    assert gp.chain(7).flags == ("--speculative-num-steps", "7", "--speculative-eagle-topk",
                                 "1", "--speculative-num-draft-tokens", "8")
    for s in p.settings:  # the data server's flags never leak into a served one
        assert "--disable-radix-cache" not in p.serve_server + s.flags


def test_scaled_recipe_scales_the_self_written_counts_and_keeps_the_other_sources(tmp_path):
    profile = gp.PROFILES["cpu-qwen2-smoke"]
    path = gp.scaled_recipe(profile, tmp_path / "r.json")
    shipped = load_recipe(ROOT / "datasets" / profile.recipe)
    scaled = load_recipe(path)
    for a, b in zip(shipped.datasets, scaled.datasets, strict=True):
        assert a.name == b.name
        if a.self_written is None:
            assert a.path == b.path and a.path.is_file()  # the human-written prompts, unscaled
        else:
            assert b.count == max(4, round(a.count * profile.count_scale)) < a.count
            assert b.self_written.heldout < a.self_written.heldout
    full = dataclasses.replace(profile, count_scale=1.0)
    assert gp.scaled_recipe(full, tmp_path / "x.json") == ROOT / "datasets" / profile.recipe


def test_steps_past_the_deadline_are_skipped_and_a_rerun_keeps_the_record(tmp_path):
    log = gp.StepLog(tmp_path, time.time() + 100, {"target": "t"})
    assert log.fits("01", 50)
    log.record("01", wall_s=1.0, rc=0)
    assert not log.fits("04", 500)
    data = json.loads((tmp_path / "pipeline.json").read_text())
    assert data["steps"]["01"]["rc"] == 0 and "needs ~500 s" in data["skipped"]["04"]
    again = gp.StepLog(tmp_path, time.time() + 1000, {"target": "t"})
    assert again.data["steps"]["01"]["wall_s"] == 1.0 and again.fits("04", 500)


def test_a_failed_step_records_its_log_tail_and_stops_unless_told_not_to(tmp_path):
    log = gp.StepLog(tmp_path, time.time() + 100, {})
    bad = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="step x exited 3"):
        gp.run_step(log, "x", bad, tmp_path / "logs")
    gp.run_step(log, "y", bad, tmp_path / "logs", check=False)
    steps = json.loads((tmp_path / "pipeline.json").read_text())["steps"]
    assert steps["x"]["rc"] == steps["y"]["rc"] == 3 and steps["x"]["log_tail"] == ["boom"]
