"""Stage 01 end to end: broken rows, bad flags, sampling, sources, the 01b contract, kill/resume."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from dataset_helpers import FIXTURE_DIR, chatml_target
from stage_helpers import assert_same_folder

from eagle3.core.chat import ChatRenderer, split_for_generation
from eagle3.core.records import read_jsonl
from eagle3.core.target import load_tokenizer
from eagle3.prepare.sources import LocalSource, SourceError, open_source

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_FILES = ("conversations.jsonl", "tokenized.jsonl", "quarantine.jsonl", "done.json")


def _main():
    return importlib.import_module("01_prepare_datasets").main


def write_recipe(path: Path, datasets: list[dict], defaults: dict | None = None) -> Path:
    path.write_text(json.dumps({"name": "t", "defaults": defaults or {}, "datasets": datasets}))
    return path


def run(tmp_path: Path, recipe: Path, target: Path, *flags: str) -> int:
    return _main()(["--recipe", str(recipe), "--target", str(target), "--workdir",
                    str(tmp_path / "w"), "--num-workers", "1", *flags])


def prepared(tmp_path: Path, name: str) -> Path:
    return tmp_path / "w" / "01_prepared" / name


# ---------------------------------------------------------------- broken rows


def test_prepare_quarantines_every_broken_row_and_keeps_every_good_one(
        tmp_path, tiny_target_dir, capsys):
    expected = json.loads((FIXTURE_DIR / "broken_rows.expected.json").read_text())
    recipe = write_recipe(tmp_path / "r.json", [{
        "name": "mix", "adapter": "openai", "path": str(FIXTURE_DIR / "broken_rows.jsonl"),
        "id_field": "id", "regenerate": False, "max_seq_len": 1024}])
    assert run(tmp_path, recipe, tiny_target_dir, "--chunk-size", "7") == 0
    out = prepared(tmp_path, "mix")
    good = [c["id"] for c in read_jsonl(out / "conversations.jsonl")]
    assert good == [f"mix/{i}" for i in expected["good_ids"]]
    got = {q["row"].split(":")[1]: q["reason"].split(":")[0]
           for q in read_jsonl(out / "quarantine.jsonl")}
    assert got == expected["bad"]
    assert len(set(expected["bad"].values())) >= 20
    tokenized = {r["id"].split("#")[0] for r in read_jsonl(out / "tokenized.jsonl")}
    assert tokenized == set(good)
    printed = capsys.readouterr().out
    assert f"quarantined {len(expected['bad'])}" in printed and "too long 1" in printed


def test_prepare_fails_at_once_naming_the_file_when_a_dataset_file_is_missing(
        tmp_path, tiny_target_dir, capsys):
    recipe = write_recipe(tmp_path / "r.json", [{"name": "a", "adapter": "sharegpt",
                                                 "path": "nowhere/data.jsonl"}])
    assert run(tmp_path, recipe, tiny_target_dir) == 2
    assert "nowhere/data.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "w" / "01_prepared").exists()


@pytest.mark.parametrize("entry,message", [
    ({"name": "a", "adapter": "sharegpt", "path": "x.jsonl", "cnt": 5}, "unknown fields ['cnt']"),
    ({"name": "a", "adapter": "vicuna", "path": "x.jsonl"}, "adapter 'vicuna' is unknown"),
    ({"name": "a", "adapter": "sharegpt"}, "exactly one of `path`"),
    ({"name": "a", "adapter": "sharegpt", "path": "x.jsonl", "regenerate": False,
      "prompt_only": True}, "prompt_only needs regenerate"),
])
def test_prepare_fails_at_once_naming_the_field_when_recipe_entry_is_wrong(
        tmp_path, tiny_target_dir, capsys, entry, message):
    recipe = write_recipe(tmp_path / "r.json", [entry])
    assert run(tmp_path, recipe, tiny_target_dir) == 2
    err = capsys.readouterr().err
    assert message in err and "dataset 0 (a)" in err


@pytest.mark.parametrize("flags,message", [
    (["--num-workers", "-1"], "--num-workers"),
    (["--chunk-size", "0"], "--chunk-size"),
])
def test_prepare_refuses_a_wrong_flag_naming_it(tmp_path, tiny_target_dir, capsys, flags,
                                                  message):
    recipe = write_recipe(tmp_path / "r.json", [{"name": "a", "adapter": "sharegpt",
                                                 "path": "x.jsonl"}])
    with pytest.raises(SystemExit) as e:
        run(tmp_path, recipe, tiny_target_dir, *flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_prepare_refuses_a_target_without_tokenizer(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.json", [{"name": "a", "adapter": "sharegpt",
                                                 "path": "x.jsonl"}])
    with pytest.raises(SystemExit):
        run(tmp_path, recipe, tmp_path)
    assert "--target" in capsys.readouterr().err


# ---------------------------------------------------------------- contract with 01b


def test_prepare_writes_the_samples_01b_renders_when_replies_are_kept(tmp_path, tiny_target_dir):
    from eagle3.generate.jobs import tokenize_kept

    recipe = write_recipe(tmp_path / "r.json", [
        {"name": n.split(".")[0], "adapter": a, "path": str(FIXTURE_DIR / n), "regenerate": False}
        for n, a in [("openhands_traces.jsonl", "openai"), ("sharegpt_vicuna.jsonl", "sharegpt"),
                     ("glaive_function_calling_v2.json", "glaive"),
                     ("ultrachat_200k.parquet", "openai")]], {"max_seq_len": 4096})
    assert run(tmp_path, recipe, tiny_target_dir) == 0
    renderer = ChatRenderer(load_tokenizer(tiny_target_dir), {"thinking": True})
    manifest = json.loads((tmp_path / "w/01_prepared/manifest.json").read_text())
    for name, entry in manifest["outputs"]["datasets"].items():
        assert entry["regenerate"] is False and entry["max_seq_len"] == 4096
        convs = list(read_jsonl(prepared(tmp_path, name) / "conversations.jsonl"))
        ours = list(read_jsonl(prepared(tmp_path, name) / "tokenized.jsonl"))
        theirs = [r for c in convs for r in tokenize_kept(c, renderer, 4096)]
        assert ours == theirs and ours, name


def test_prepare_keeps_prompt_only_records_regenerable_from_the_whole_conversation(
        tmp_path, tiny_target_dir):
    recipe = write_recipe(tmp_path / "r.json", [{
        "name": "prompts", "adapter": "sharegpt", "path": str(FIXTURE_DIR / "prompts_only.jsonl"),
        "id_field": "id", "regenerate": True, "prompt_only": True, "max_seq_len": 512}])
    assert run(tmp_path, recipe, tiny_target_dir) == 0
    convs = list(read_jsonl(prepared(tmp_path, "prompts") / "conversations.jsonl"))
    assert [[m["role"] for m in c["messages"]] for c in convs] == [["user"],
                                                                  ["user", "assistant", "user"]]
    for c in convs:
        assert split_for_generation(c["messages"]) == (c["messages"], None)
    entry = json.loads((tmp_path / "w/01_prepared/manifest.json").read_text())[
        "outputs"]["datasets"]["prompts"]
    assert entry["regenerate"] is True and entry["max_seq_len"] == 512
    assert not (prepared(tmp_path, "prompts") / "tokenized.jsonl").exists()


def test_prepare_cuts_a_conversation_after_its_last_turn_that_fits_when_too_long(
        tmp_path, tiny_target_dir):
    rows = [{"id": "long", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "word " * 600}]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = write_recipe(tmp_path / "r.json", [{
        "name": "d", "adapter": "openai", "path": "d.jsonl", "id_field": "id",
        "regenerate": False, "max_seq_len": 256}])
    assert run(tmp_path, recipe, tiny_target_dir) == 0
    (c,) = read_jsonl(prepared(tmp_path, "d") / "conversations.jsonl")
    assert [m["content"] for m in c["messages"]] == ["hi", "hello"]
    (r,) = read_jsonl(prepared(tmp_path, "d") / "tokenized.jsonl")
    assert r["seq_len"] <= 256
    assert json.loads((prepared(tmp_path, "d") / "done.json").read_text())["truncated"] == 1


# ---------------------------------------------------------------- sampling and sources


def _sharegpt_rows(n: int, bad_every: int = 0) -> str:
    lines = []
    for i in range(n):
        if bad_every and i % bad_every == 0:
            lines.append('{"id": "broken", ')
            continue
        lines.append(json.dumps({"id": f"r{i}", "conversations": [
            {"from": "human", "value": f"Tell me about item {i}."},
            {"from": "gpt", "value": f"Item {i} is fine. " * (1 + i % 4)}]}))
    return "\n".join(lines) + "\n"


def test_prepare_takes_count_distinct_good_rows_in_seeded_order(tmp_path, tiny_target_dir):
    (tmp_path / "d.jsonl").write_text(_sharegpt_rows(60, bad_every=7))

    def ids(sample, seed, tag):
        recipe = write_recipe(tmp_path / f"{tag}.json", [{
            "name": "d", "adapter": "sharegpt", "path": "d.jsonl", "id_field": "id",
            "count": 12, "sample": sample, "seed": seed, "regenerate": True}])
        shutil.rmtree(tmp_path / "w", ignore_errors=True)
        assert run(tmp_path, recipe, tiny_target_dir, "--chunk-size", "5") == 0
        return [c["id"] for c in read_jsonl(prepared(tmp_path, "d") / "conversations.jsonl")]

    head = ids("head", 0, "a")
    assert head == [f"d/r{i}" for i in range(60) if i % 7][:12]
    first, again, other = ids("random", 1, "b"), ids("random", 1, "c"), ids("random", 2, "d")
    assert first == again and len(first) == len(set(first)) == 12
    assert first != other and set(first) != set(head)


def test_local_source_reads_a_folder_of_jsonl_json_parquet_and_gz_files(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(FIXTURE_DIR / "magicoder.jsonl", folder / "a.jsonl")
    shutil.copy(FIXTURE_DIR / "xlam_function_calling.json", folder / "b.json")
    shutil.copy(FIXTURE_DIR / "ultrachat_200k.parquet", folder / "c.parquet")
    (folder / "d.jsonl.gz").write_bytes(gzip.compress((FIXTURE_DIR / "codefeedback.jsonl")
                                                      .read_bytes()))
    (folder / "notes.txt").write_text("ignored")
    src = LocalSource(folder)
    assert [p.name for p in src.files] == ["a.jsonl", "b.json", "c.parquet", "d.jsonl.gz"]
    assert len(src) == 2 + 2 + 2 + 1
    keys = [k for k, _ in src.rows([6, 0, 3, 4])]
    assert keys == ["d.jsonl.gz:1", "a.jsonl:1", "b.json:[1]", "c.parquet:0"]
    assert len(LocalSource(tmp_path / "data" / "*.json*")) == 2 + 2 + 1  # a glob
    with pytest.raises(SourceError, match="unsupported format"):
        LocalSource(tmp_path / "data" / "notes.txt")


def test_hf_source_names_the_missing_package_when_datasets_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    from eagle3.prepare.sources import HFSpec

    with pytest.raises(SourceError, match="pip install datasets"):
        open_source(None, HFSpec("HuggingFaceH4/ultrachat_200k", split="train_sft"))


def test_prepare_reads_a_hugging_face_dataset_id_through_datasets(
        tmp_path, tiny_target_dir, monkeypatch):
    rows = [json.loads(line) for line in (FIXTURE_DIR / "magicoder.jsonl").read_text().split("\n")
            if line]
    calls = []

    class FakeDataset(list):
        def select(self, idx):
            return FakeDataset(self[i] for i in idx)

        def to_list(self):
            return list(self)

    def load_dataset(name, config, split, revision, streaming):
        calls.append((name, config, split, revision, streaming))
        return FakeDataset(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    recipe = write_recipe(tmp_path / "r.json", [{
        "name": "magic", "adapter": "instruction_response", "hf_id": "ise-uiuc/Magicoder",
        "split": "train", "revision": "abc123", "regenerate": False}])
    assert run(tmp_path, recipe, tiny_target_dir) == 0
    assert calls == [("ise-uiuc/Magicoder", None, "train", "abc123", False)]
    convs = list(read_jsonl(prepared(tmp_path, "magic") / "conversations.jsonl"))
    assert [c["messages"][0]["content"] for c in convs] == [r["instruction"] for r in rows]


# ---------------------------------------------------------------- killed and resumed


def _kill_recipe(tmp_path: Path) -> Path:
    (tmp_path / "chat.jsonl").write_text(_sharegpt_rows(240, bad_every=11))
    (tmp_path / "more.jsonl").write_text(_sharegpt_rows(160))
    return write_recipe(tmp_path / "r.json", [
        {"name": "chat", "adapter": "sharegpt", "path": "chat.jsonl", "regenerate": False},
        {"name": "more", "adapter": "sharegpt", "path": "more.jsonl", "count": 100,
         "sample": "random", "seed": 5, "regenerate": False},
        {"name": "mix", "adapter": "openai", "path": str(FIXTURE_DIR / "broken_rows.jsonl"),
         "id_field": "id", "regenerate": False, "max_seq_len": 1024}])


def _start(recipe: Path, target: Path, workdir: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "01_prepare_datasets.py"), "--recipe", str(recipe),
           "--target", str(target), "--workdir", str(workdir), "--num-workers", "2",
           "--chunk-size", "9", "--verify-every", "3", "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own group: kill the workers too


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists() and proc.poll() is None:
        time.sleep(0.05)


def test_prepare_output_is_identical_when_killed_at_random_moments_and_rerun(
        tmp_path, tiny_target_dir):
    recipe = _kill_recipe(tmp_path)
    started = tmp_path / "{}/01_prepared/chat/plan.json"  # written when the work begins
    proc = _start(recipe, tiny_target_dir, tmp_path / "ref")
    _wait_for(Path(str(started).format("ref")), proc)
    t0 = time.monotonic()
    assert proc.wait(timeout=300) == 0
    work = time.monotonic() - t0
    rng = random.Random(7)
    killed = 0
    for _ in range(3):  # kill at a random moment of the work, then again, then let it finish
        proc = _start(recipe, tiny_target_dir, tmp_path / "run")
        _wait_for(Path(str(started).format("run")), proc)
        try:
            proc.wait(timeout=rng.uniform(0.0, 1.0) * work)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed += 1
    assert killed >= 2
    assert _start(recipe, tiny_target_dir, tmp_path / "run").wait(timeout=300) == 0
    for name in ("chat", "more", "mix"):
        for f in OUTPUT_FILES:
            ref = tmp_path / "ref/01_prepared" / name / f
            assert (tmp_path / "run/01_prepared" / name / f).read_bytes() == ref.read_bytes(), \
                (name, f)
        assert not (tmp_path / "run/01_prepared" / name / "parts").exists()
    assert json.loads((tmp_path / "run/01_prepared/manifest.json").read_text())["complete"]
    # the whole folder: no temp copy of an output, no stray file, the same manifest
    assert_same_folder(tmp_path / "run/01_prepared", tmp_path / "run",
                       tmp_path / "ref/01_prepared", tmp_path / "ref")


def test_shipped_recipes_load_and_the_kimi_mix_is_about_ten_sources_of_100k(tmp_path):
    from eagle3.prepare.recipes import load_recipe

    demo = load_recipe(ROOT / "datasets" / "demo.json")
    assert all(s.path.is_file() for s in demo.datasets)
    mix = load_recipe(ROOT / "datasets" / "kimi_k25_mix.json")
    raw = json.loads((ROOT / "datasets" / "kimi_k25_mix.json").read_text())
    assert len(mix.datasets) >= 10 and 90_000 <= sum(s.count for s in mix.datasets) <= 110_000
    for entry in raw["datasets"]:  # each says adapter and count; defaults give the rest
        assert {"name", "adapter", "count"} <= set(entry)
    assert all(s.max_seq_len >= 8192 and s.regenerate for s in mix.datasets)
    assert not (ROOT / "datasets" / "__init__.py").exists()


def test_prepare_quarantines_tool_use_when_the_target_template_cannot_render_it(
        tmp_path, tiny_target_dir):
    """A target without tool-call tokens (SmolLM2's ChatML template): records with tools or
    tool calls are quarantined with the reason; plain chats pass."""
    target = chatml_target(tiny_target_dir, tmp_path / "target")
    recipe = ROOT / "datasets" / "demo.json"
    assert run(tmp_path, recipe, target) == 0
    out = tmp_path / "w" / "01_prepared"
    bad = read_jsonl(out / "tools_demo" / "quarantine.jsonl")
    assert bad and all(b["reason"].startswith("tool use: the target's chat template renders no")
                       for b in bad)
    assert not (out / "tools_demo" / "conversations.jsonl").read_text().strip()
    assert read_jsonl(out / "sharegpt_demo" / "conversations.jsonl")
