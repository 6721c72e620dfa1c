"""benchmarks/gpu_pipeline.py's pieces without a GPU or a server: every step's command parses
with its script, the recipe it scales, the deadline that skips steps, the record a re-run
keeps; the two-session route with a fake launcher and fake steps (session A stops after 04,
session B serves a given draft), and benchmarks/gpu_sglang.sh's draft on its way back and into
session B's stream, run by bash on small files. The route itself runs on CPU against the real
SGLang with `python benchmarks/gpu_pipeline.py --profile cpu-qwen2-smoke` (BENCHMARKS.md, the
pipeline on Qwen2.5-Coder)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
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
                                        fixed=True, draft=gp.trained_draft(work))),
                ("05", gp.offline_command(profile, work, target, tmp_path / "o",
                                          draft=gp.trained_draft(work)))]
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


class _FakeServer:
    """What run_pipeline and serve use of a LaunchedServer, starting nothing."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def start(self):
        pass

    def wait(self):
        pass

    def stop(self):
        pass


@pytest.fixture
def fake_route(monkeypatch, tmp_path):
    """A fake `launch` and run_step: the servers launched (name, flags) and the steps run
    (step, argv, limit_s), each step recorded as done in 0 s."""
    launched, ran = [], []

    def launch(name, port, flags, dump_dir=None):
        launched.append((name, list(flags)))
        return _FakeServer(f"http://127.0.0.1:{port}")

    def run_step(log, step, argv, log_dir, manifest=None, check=True, limit_s=None):
        ran.append((step, argv, limit_s))
        log.record(step, rc=0, wall_s=0.0)
        return True

    monkeypatch.setattr(gp, "run_step", run_step)
    (tmp_path / "out").mkdir()  # pipeline.json's folder, as the callers make it
    return launch, launched, ran


def test_stop_after_04_gives_04_the_deadline_less_the_return_share_and_skips_serving(
        tmp_path, fake_route):
    launch, launched, ran = fake_route
    profile = gp.PROFILES["h100-qwen-coder"]
    est = profile.estimates
    t0 = time.time()
    deadline = t0 + 3000
    record = gp.run_pipeline(profile, tmp_path / "target", tmp_path / "work", tmp_path / "out",
                             deadline, launch, stop_after="04")
    t1 = time.time()
    assert [name for name, _ in launched] == ["data"]  # no serving server
    assert [step for step, _, _ in ran] == ["01", "01b", "merge", "02b", "03", "04"]
    # what was left when 04 started less the return share, not less the serving's (270 s more)
    share = est["draft_return"]
    assert deadline - t1 - share <= ran[-1][2] <= deadline - t0 - share
    saved = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert saved["route"] == record["route"] == "train"
    assert set(saved["skipped"]) == set(gp.SERVE_STEPS)
    assert all("serve in the next session" in why for why in saved["skipped"].values())
    with pytest.raises(ValueError, match="stop_after='03'"):
        gp.run_pipeline(profile, tmp_path / "target", tmp_path / "work", tmp_path / "out",
                        deadline, launch, stop_after="03")


def _draft_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_serve_only_route_serves_the_given_draft_and_runs_no_data_step(tmp_path, fake_route):
    launch, launched, ran = fake_route
    profile = gp.PROFILES["h100-qwen-coder"]
    draft = _draft_folder(tmp_path / "draft_in" / "final")
    work = tmp_path / "work"
    record = gp.serve_draft(profile, tmp_path / "target", draft, work, tmp_path / "out",
                            time.time() + 3000, launch)
    assert [name for name, _ in launched] == ["plain", *[s.name for s in profile.settings]]
    for name, flags in launched[1:]:  # every speculative server drafts with the given draft
        assert flags[flags.index("--speculative-draft-model-path") + 1] == str(draft), name
    assert [step for step, _, _ in ran] == ["serve_natural", "serve_fixed", "offline"]
    for step, argv, _ in ran:
        assert argv[argv.index("--draft") + 1] == str(draft), step
        sets = argv[argv.index("--prompt-sets") + 1:][:len(profile.prompt_sets)]
        assert sets == [str(ROOT / name) for name in profile.prompt_sets], step
    saved = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert saved["route"] == record["route"] == "serve" and saved["draft"] == str(draft)
    assert set(saved["steps"]) == {"serve_start", "serve_natural", "serve_fixed", "offline"}
    assert not saved["skipped"] and not (work / "recipe.json").exists()


def test_serve_only_route_names_what_is_missing_before_any_server_starts(tmp_path, fake_route):
    launch, launched, ran = fake_route
    profile = dataclasses.replace(gp.PROFILES["h100-qwen-coder"],
                                  prompt_sets=("prompts/human_code.jsonl", "heldout:qwen_code"))
    draft = _draft_folder(tmp_path / "final")
    with pytest.raises(FileNotFoundError, match=r"heldout:qwen_code is 01's held-out prompts"):
        gp.serve_draft(profile, tmp_path / "target", draft, tmp_path / "work", tmp_path / "out",
                       time.time() + 3000, launch)
    (draft / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        gp.serve_draft(gp.PROFILES["h100-qwen-coder"], tmp_path / "target", draft,
                       tmp_path / "work", tmp_path / "out", time.time() + 3000, launch)
    assert not launched and not ran and not (tmp_path / "out" / "pipeline.json").exists()


# benchmarks/gpu_sglang.sh on small files: a copy in a temp repository (split rewrites .gpu/
# there), its machine folder under GS_DIR

def _sh(repo: Path, *args: str, gs: Path | None = None, **env: str):
    env = {**os.environ, **env, **({"GS_DIR": str(gs)} if gs else {})}
    return subprocess.run(["bash", "benchmarks/gpu_sglang.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def returned_draft(tmp_path):
    """Session A's draft brought back by collect (`fetch 0`): the repository copy, the draft's
    weights, and the two calls' folders (draft.sha256 in both, one part in each)."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_sglang.sh", repo / "benchmarks")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    final = _draft_folder(tmp_path / "a" / "work" / "pipeline" / "run" / "04_train" / "final")
    weights = os.urandom(16_000_000)  # collect's parts are 15 MB: two of them
    (final / "model.safetensors").write_bytes(weights)
    out = tmp_path / "out_a"
    out.mkdir()
    r = _sh(repo, "fetch", "0", gs=tmp_path / "a", OUT=str(out))
    assert r.returncode == 0, r.stderr
    calls = []
    for i in range(2):
        call = tmp_path / f"call{i}"
        call.mkdir()
        shutil.copy(out / "draft.sha256", call)
        shutil.copy(out / f"draft.tar.part0{i}", call)
        calls.append(call)
    assert not list(out.glob("draft.tar.part02"))
    return repo, weights, calls


def test_join_draft_names_a_missing_or_damaged_part_and_joins_the_rest(tmp_path,
                                                                       returned_draft):
    repo, weights, (call0, call1) = returned_draft
    tar = tmp_path / "draft.tar"
    r = _sh(repo, "join-draft", str(tar), str(call0))
    assert r.returncode != 0 and "draft.tar.part01: in none of" in r.stderr
    bad = tmp_path / "bad"
    shutil.copytree(call1, bad)
    part = bad / "draft.tar.part01"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    r = _sh(repo, "join-draft", str(tar), str(call0), str(bad))
    assert r.returncode != 0 and "draft.tar.part01: damaged" in r.stderr
    assert "part00" not in r.stderr and not tar.exists()
    r = _sh(repo, "join-draft", str(tar), str(call0), str(bad), str(call1))  # fetched again
    assert r.returncode == 0, r.stderr
    assert tar.read_bytes() == (call0 / "draft.tar.part00").read_bytes() + (
        call1 / "draft.tar.part01").read_bytes()


def test_split_with_a_draft_puts_it_in_the_manifest_and_unpack_gives_it_back(tmp_path,
                                                                            returned_draft):
    repo, weights, calls = returned_draft
    tar = tmp_path / "draft.tar"
    assert _sh(repo, "join-draft", str(tar), *map(str, calls)).returncode == 0
    bundle, gguf = tmp_path / "site.tar.xz", tmp_path / "target.gguf"
    bundle.write_bytes(os.urandom(3_000))
    gguf.write_bytes(os.urandom(5_000))
    r = _sh(repo, "split", str(bundle), str(gguf), "qwen2.5-coder-1.5b", str(tar),
            PART="1000000")
    assert r.returncode == 0, r.stderr
    manifest = dict(line.split() for line in (repo / ".gpu" / "manifest").read_text().splitlines())
    assert int(manifest["draft_bytes"]) == tar.stat().st_size
    assert manifest["draft_sha256"] == hashlib.sha256(tar.read_bytes()).hexdigest()
    assert int(manifest["gguf_bytes"]) == 5_000 and int(manifest["bundle_bytes"]) == 3_000
    gs = tmp_path / "b"  # session B's machine
    for n in range(1, int(manifest["parts"]) + 1):
        assert _sh(repo, "part", str(n), gs=gs).returncode == 0
    r = _sh(repo, "unpack", gs=gs)
    assert r.returncode == 0, r.stderr
    assert (gs / "target.gguf").read_bytes() == gguf.read_bytes()
    assert (gs / "draft_in" / "final" / "model.safetensors").read_bytes() == weights
    assert (gs / "draft_in" / "final" / "config.json").read_text() == "{}"
    assert not list((gs / "parts").glob("part*"))  # the disk back; the manifest stays


def test_start_pipeline_serve_refuses_parts_without_a_draft(tmp_path, returned_draft):
    repo = returned_draft[0]
    bundle, gguf = tmp_path / "site.tar.xz", tmp_path / "target.gguf"
    bundle.write_bytes(os.urandom(3_000))
    gguf.write_bytes(os.urandom(5_000))
    assert _sh(repo, "split", str(bundle), str(gguf), "qwen2.5-coder-1.5b",
               PART="4096").returncode == 0
    assert "draft" not in (repo / ".gpu" / "manifest").read_text()
    gs = tmp_path / "b"
    for n in (1, 2):
        assert _sh(repo, "part", str(n), gs=gs).returncode == 0
    r = _sh(repo, "start", "pipeline-serve", gs=gs)
    assert r.returncode == 1 and "none in the parts" in r.stderr
    assert len(list((gs / "parts").glob("part*"))) == 2  # nothing unpacked
