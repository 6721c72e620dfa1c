"""What 04's evaluation costs the loop (BENCHMARKS.md, "The whole stage, end to end"): its rows
are loaded ahead, the target's argmax of each eval row is scored once per run, and neither
changes a figure."""

from __future__ import annotations

import json

import pytest
import torch
import train_helpers as th

from eagle3.train import acceptance, loop


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcost")
    th.write_dataset(root / "train", 40, seed=1)
    th.write_dataset(root / "eval", 6, seed=2)
    return root


def _eval_rows(out_dir):
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_eval_rows_load_ahead_and_the_target_argmax_is_scored_once(eval_data, tmp_path,
                                                                     monkeypatch):
    """Each eval but the first and the last gets rows whose loader started EVAL_LEAD_STEPS
    steps before it; the full-vocabulary argmax runs for the first eval's rows only; the eval
    figures equal those of a run that loads every eval's rows when it is due and scores the
    argmax every time."""
    steps, started, argmax_calls = {"n": 0}, [], {"n": 0}
    clip, batches, argmax = loop.clip_gradients, loop.eval_batches, acceptance.full_argmax

    def counted_clip(*a, **kw):  # called once per optimizer step
        steps["n"] += 1
        return clip(*a, **kw)

    def recorded_batches(*a, **kw):
        started.append(steps["n"])
        return batches(*a, **kw)

    def counted_argmax(*a, **kw):
        argmax_calls["n"] += 1
        return argmax(*a, **kw)

    monkeypatch.setattr(loop, "clip_gradients", counted_clip)
    monkeypatch.setattr(loop, "eval_batches", recorded_batches)
    monkeypatch.setattr(acceptance, "full_argmax", counted_argmax)
    summary, _ = th.run_tiny(eval_data, tmp_path / "ahead", eval_every=8, save_every=100,
                             epochs=3)
    n = summary["num_steps"]
    assert n > 2 * 8 + 1
    due = [s for s in range(0, n + 1, 8)] + ([n] if n % 8 else [])
    ahead = [s - loop.EVAL_LEAD_STEPS for s in due if 0 < s and s % 8 == 0]
    # the eval at step 0 and a last eval off the 8-step grid start their loaders when due
    assert started == sorted([0, *ahead] + ([n] if n % 8 else []))
    evals = _eval_rows(tmp_path / "ahead")
    assert [r["step"] for r in evals] == due
    rows_per_eval = argmax_calls["n"]
    assert rows_per_eval >= 1  # the first eval's rows only; later evals reuse them

    # reference: rows loaded when due, argmax scored every time
    monkeypatch.setattr(loop, "EVAL_LEAD_STEPS", 10 ** 9)
    monkeypatch.setattr(loop, "evaluate", lambda *a, **kw: _uncached(*a, **kw))
    argmax_calls["n"] = 0
    th.run_tiny(eval_data, tmp_path / "due", eval_every=8, save_every=100, epochs=3)
    assert argmax_calls["n"] == rows_per_eval * len(due)
    for got, want in zip(evals, _eval_rows(tmp_path / "due"), strict=True):
        assert got == want


_evaluate = loop.evaluate


def _uncached(model, batches, cfg, rt, estimate, greedy_cache=None, parts=None):
    return _evaluate(model, batches, cfg, rt, estimate, {}, parts)


def test_eval_parts_are_timed(eval_data, tmp_path):
    summary, _ = th.run_tiny(eval_data, tmp_path, eval_every=8, save_every=100, epochs=1)
    t = summary["timings"]
    assert len(t["eval_wait_s"]) == len(t["eval_estimate_s"]) == len(t["eval_s"]) >= 2
    assert all(0 <= w + e <= total for w, e, total in
               zip(t["eval_wait_s"], t["eval_estimate_s"], t["eval_s"]))
    assert torch.tensor(t["eval_estimate_s"]).sum() > 0
