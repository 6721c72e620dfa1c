"""What 04's evaluation costs the loop (BENCHMARKS.md, "Training stage (04), start to exit"): its rows
are loaded once per run and kept, the target's argmax of each eval row is scored once per run,
and neither changes a figure."""

from __future__ import annotations

import json

import pytest
import torch
import train_helpers as th

from eagle3.train import acceptance, loop


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    return th.write_splits(tmp_path_factory.mktemp("evalcost"), 40, 6)


def _eval_rows(out_dir):
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_eval_rows_are_loaded_once_and_the_target_argmax_is_scored_once(eval_data, tmp_path,
                                                                        monkeypatch):
    """The first eval loads its rows through the loader and keeps them in host memory; later
    evals read them from there and reuse the full-vocabulary argmax of each row; the eval
    figures equal those of a run that loads every eval's rows and scores the argmax every
    time (EVAL_CACHE_BYTES 0)."""
    loaders, argmax_calls = {"n": 0}, {"n": 0}
    batches, argmax = loop.eval_batches, acceptance.full_argmax

    def counted_batches(*a, **kw):
        loaders["n"] += 1
        return batches(*a, **kw)

    def counted_argmax(*a, **kw):
        argmax_calls["n"] += 1
        return argmax(*a, **kw)

    monkeypatch.setattr(loop, "eval_batches", counted_batches)
    monkeypatch.setattr(acceptance, "full_argmax", counted_argmax)
    summary, _ = th.run_tiny(eval_data, tmp_path / "kept", eval_every=8, save_every=100,
                             epochs=3)
    n = summary["num_steps"]
    due = list(range(0, n + 1, 8)) + ([n] if n % 8 else [])
    evals = _eval_rows(tmp_path / "kept")
    assert [r["step"] for r in evals] == due and len(due) >= 3
    assert loaders["n"] == 1
    rows_per_eval = argmax_calls["n"]
    assert rows_per_eval >= 1
    waits = summary["timings"]["eval_wait_s"]
    assert len(waits) == len(due)

    # reference: nothing kept, the argmax scored every time
    monkeypatch.setattr(loop, "EVAL_CACHE_BYTES", 0)
    monkeypatch.setattr(loop, "evaluate", lambda *a, **kw: _uncached(*a, **kw))
    loaders["n"] = argmax_calls["n"] = 0
    th.run_tiny(eval_data, tmp_path / "loaded", eval_every=8, save_every=100, epochs=3)
    assert loaders["n"] == len(due)
    assert argmax_calls["n"] == rows_per_eval * len(due)
    for got, want in zip(evals, _eval_rows(tmp_path / "loaded"), strict=True):
        assert got == want


_evaluate = loop.evaluate


def _uncached(model, batches, cfg, rt, estimate, greedy_cache=None, parts=None, keep=None):
    return _evaluate(model, batches, cfg, rt, estimate, {}, parts, keep)


def test_eval_parts_are_timed(eval_data, tmp_path):
    summary, _ = th.run_tiny(eval_data, tmp_path, eval_every=8, save_every=100, epochs=1)
    t = summary["timings"]
    assert len(t["eval_wait_s"]) == len(t["eval_estimate_s"]) == len(t["eval_s"]) >= 2
    assert all(0 <= w + e <= total for w, e, total in
               zip(t["eval_wait_s"], t["eval_estimate_s"], t["eval_s"]))
    assert torch.tensor(t["eval_estimate_s"]).sum() > 0
