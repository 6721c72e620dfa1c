"""The diversity figures (eagle3/prepare/diversity.py) and benchmarks/bench_diversity.py: each
figure against a count made by hand, the steer label before the keyword rules, the sample under
a seed, and the CLI's table, JSON and one-line error."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3.prepare.diversity import (
    Turn,
    classify_task,
    distinct_n,
    duplicate_rates,
    measure,
    percentile,
    user_turns,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,label", [
    ("Write a Python function that reverses a list.", "code"),
    ("What is 17 * 23?", "math"),
    ("Translate 'good morning' into French.", "translate"),
    ("Summarize the following text in two lines: ...", "extraction"),
    ("Pretend you are a pirate and greet me.", "roleplay"),
    ("Compose a short poem about rain.", "writing"),
    ("Compare tea and coffee for a morning routine.", "compare"),
    ("Give me ideas for a birthday party.", "brainstorm"),
    ("How can I sleep better?", "advice"),
    ("Why is the sky blue?", "explain"),
    ("Hello there", "other"),
])
def test_classify_task_takes_the_first_rule_that_matches(text, label):
    assert classify_task(text) == label


def test_distinct_n_counts_distinct_word_ngrams_over_all():
    texts = ["the cat sat", "The cat ran!"]
    assert distinct_n(texts, 1) == 4 / 6  # the, cat, sat, ran
    assert distinct_n(texts, 2) == 3 / 4  # the cat (twice), cat sat, cat ran
    assert distinct_n(texts, 3) == 2 / 2
    assert distinct_n(["one"], 2) == 0.0


def test_duplicate_rates_count_exact_and_near_repeats_of_earlier_turns():
    base = "please explain how the moon changes its shape every month in simple words"
    texts = [base, base.upper() + "!", base + " today", "a different request about cooking"]
    assert duplicate_rates(texts, 0.8) == {"exact_dup_rate": 0.25, "near_dup_rate": 0.5}


def test_percentile_matches_numpy():
    xs = [3, 1, 4, 1, 5, 9, 2, 6]
    for p in (5, 25, 50, 75, 95):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))


def test_measure_uses_the_steer_label_where_present_and_samples_under_a_seed():
    turns = [Turn("Why is the sky blue?", "math")] + [Turn(f"Why {i}?") for i in range(9)]
    r = measure(turns)
    assert r["task_share"] == {"explain": 0.9, "math": 0.1}
    assert r["task_labelled_by"] == {"steer": 1, "keywords": 9}
    assert r["turns"] == 10 and r["words"]["p50"] == 2
    assert measure(turns, sample=4, seed=1) == measure(turns, sample=4, seed=1)
    assert measure(turns, sample=4)["turns"] == 4


def test_user_turns_read_first_or_all_user_turns_and_name_a_bad_record():
    rec = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
           "steer": {"task": "code"}}
    assert [t.text for t in user_turns([("f:1", rec)])] == ["a", "c"]
    assert user_turns([("f:1", rec)], first_only=True) == [Turn("a", "code")]
    with pytest.raises(ValueError, match="f:2: a record needs `messages`"):
        user_turns([("f:2", {"input_ids": [1]})])


def test_cli_prints_a_row_per_set_at_the_smallest_size_and_writes_json(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_diversity")
    out = tmp_path / "div.json"
    assert bench.main([f"self={ROOT}/tests/fixtures/smollm2_chat_draft/heldout_chat.jsonl",
                       "chat=prompts/chat.jsonl", "--json-out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| self | 12 |" in table and "| chat | 12 |" in table
    data = json.loads(out.read_text())
    assert data["sample"] == 12 and set(data["results"]) == {"self", "chat"}
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    assert bench.main([f"bad={tmp_path}/bad.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.jsonl:1: a record needs `messages`" in err
