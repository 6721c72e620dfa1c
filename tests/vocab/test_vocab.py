"""Draft vocabulary selection and the d2t / t2d mapping on a hand-computed example."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3.vocab.mapping import (
    VocabError,
    build_mapping,
    count_supervised,
    coverage,
    hot_ids_from_d2t,
    select_hot_ids,
)


def test_mapping_matches_hand_computed_example_when_counts_are_known(tmp_path):
    # target vocab 10; supervised tokens: 7 x3, 2 x2, 9 x2, 4 x1; unsupervised 5 never counts
    rec = {"id": "a", "input_ids": [5, 7, 7, 2, 9, 5, 7, 2, 9, 4],
           "loss_mask": [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    counts = count_supervised(path, 10)
    assert counts.tolist() == [0, 0, 2, 0, 1, 0, 0, 3, 0, 2]
    hot = select_hot_ids(counts, 3)  # 7 (3), then 2 and 9 tie at 2: both kept; 4 drops
    assert hot.tolist() == [2, 7, 9]
    m = build_mapping(hot, 10)
    assert m["d2t"].tolist() == [2, 6, 7]  # target = draft + d2t: 0+2, 1+6, 2+7
    assert m["t2d"].tolist() == [False, False, True, False, False, False, False, True, False,
                                 True]
    assert hot_ids_from_d2t(m["d2t"]).tolist() == [2, 7, 9]


def test_hot_ids_are_padded_with_lowest_unused_ids_when_few_are_seen():
    counts = np.array([0, 0, 5, 0, 0, 1])
    hot = select_hot_ids(counts, 4)
    assert hot.tolist() == [0, 1, 2, 5]
    ids = hot_ids_from_d2t(build_mapping(hot, 6)["d2t"])
    assert torch.equal(ids, torch.tensor([0, 1, 2, 5]))
    assert (ids[1:] > ids[:-1]).all()  # unique and ascending


def test_ties_break_toward_the_lower_id():
    assert select_hot_ids(np.array([1, 1, 1, 1]), 2).tolist() == [0, 1]


def test_select_refuses_when_draft_vocab_exceeds_target():
    with pytest.raises(VocabError, match="--draft-vocab"):
        select_hot_ids(np.zeros(5, dtype=np.int64), 6)


def test_coverage_counts_share_inside_top_k():
    cov = coverage(np.array([6, 3, 1, 0]), sizes=(1, 2, 8))
    assert cov == {1: 0.6, 2: 0.9, 8: 1.0}


def test_demo_mapping_has_unique_ascending_hot_ids(demo_run):
    from safetensors.torch import load_file

    m = load_file(str(demo_run / "03_vocab/vocab_mapping.safetensors"))
    ids = hot_ids_from_d2t(m["d2t"])
    assert ids.numel() == 256 and (ids[1:] > ids[:-1]).all()
    assert m["t2d"].sum() == 256 and m["t2d"][ids].all()


def test_counting_streams_in_bounded_memory_when_the_file_is_large(tmp_path):
    import tracemalloc

    rng = np.random.default_rng(0)
    path = tmp_path / "train.jsonl"
    with path.open("w") as f:
        for i in range(20000):  # 600K tokens: 4.8 MB as int64 if held at once
            ids = rng.integers(0, 1000, 30).tolist()
            f.write(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [1] * 30}) + "\n")
    tracemalloc.start()
    counts = count_supervised(path, 1000, chunk_tokens=4096)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert counts.sum() == 600_000
    assert peak < 1_000_000, peak  # the counter (8 KB), one chunk and one record


def test_counting_refuses_a_record_whose_mask_length_differs(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"id": "bad", "input_ids": [1, 2, 3], "loss_mask": [1, 1]}) + "\n")
    with pytest.raises(VocabError, match="record bad"):
        count_supervised(path, 10)


def test_report_gives_coverage_at_each_size_and_the_top_tokens():
    from eagle3.vocab.mapping import report

    class Tok:
        def convert_ids_to_tokens(self, i):
            return f"<{i}>"

    counts = np.zeros(70000, dtype=np.int64)
    counts[:70000] = 1
    counts[5] = 30000  # one very frequent token
    rep = report(counts, select_hot_ids(counts, 8192), Tok(), top=3)
    total = 30000 + 69999
    assert rep["supervised_tokens"] == total
    assert rep["coverage"] == pytest.approx((30000 + 8191) / total)
    assert rep["coverage_at"]["8192"] == pytest.approx((30000 + 8191) / total)
    assert rep["coverage_at"]["65536"] == pytest.approx((30000 + 65535) / total)
    assert [t["token"] for t in rep["top_tokens"]] == ["<5>", "<0>", "<1>"]


def test_record_origin_tells_target_from_dataset_text_when_the_merge_cut_a_record():
    from eagle3.vocab.mapping import record_origin

    regenerated = {"chat": True, "tools": False}
    assert record_origin({"source": "tools", "finish_reason": "dataset"}, regenerated) == "dataset"
    assert record_origin({"source": "chat", "finish_reason": "stop"}, {}) == "target"
    assert record_origin({"source": "chat", "finish_reason": "length"}, {}) == "target"
    assert record_origin({"source": "chat", "finish_reason": "truncated"}, regenerated) == "target"
    assert record_origin({"source": "tools", "finish_reason": "truncated"},
                         regenerated) == "dataset"
    assert record_origin({"source": "x", "finish_reason": "truncated"}, regenerated) == "unknown"


def test_report_gives_coverage_per_origin_and_warns_when_dataset_text_chose_the_vocab(tmp_path):
    from eagle3.vocab.mapping import count_supervised_by_origin, report

    recs = [{"id": "chat/0", "source": "chat", "finish_reason": "stop",
             "input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1]},
            {"id": "tools/0", "source": "tools", "finish_reason": "dataset",
             "input_ids": [1, 7, 7, 7, 8], "loss_mask": [0, 1, 1, 1, 1]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    by_origin = count_supervised_by_origin(path, 10, {"chat": True, "tools": False})
    assert by_origin.sum(0).tolist() == count_supervised(path, 10).tolist()
    hot = select_hot_ids(by_origin.sum(0), 2)  # 7 (3), 3 (2): 2 and 8 left out
    rep = report(by_origin.sum(0), hot, by_origin=by_origin)
    assert rep["coverage"] == pytest.approx(5 / 7)
    assert rep["coverage_by_origin"] == {
        "target": {"supervised_tokens": 3, "coverage": pytest.approx(2 / 3)},
        "dataset": {"supervised_tokens": 4, "coverage": pytest.approx(3 / 4)}}
    assert len(rep["warnings"]) == 1 and "57% of the supervised tokens" in rep["warnings"][0]
    assert "target-written tokens: 0.6667" in rep["warnings"][0]
    only_target = count_supervised_by_origin(path, 10, {})[:, :]
    only_target[1:] = 0
    assert report(only_target.sum(0), hot, by_origin=only_target)["warnings"] == []


def test_03_folder_is_identical_when_killed_at_several_moments_and_rerun(tmp_path,
                                                                          tiny_target_dir):
    """SIGKILL at three moments of 03's work, then a full run: the same files, byte for byte,
    as an uninterrupted run (manifest.json without its timestamps), and no temp file left."""
    import sys
    from pathlib import Path

    from stage_helpers import assert_same_folder, kill_and_rerun

    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    lines = []
    for i in range(5_000):
        ids = rng.integers(0, vocab, 64).tolist()
        lines.append(json.dumps({"id": f"s/{i}", "source": "s", "finish_reason": "stop",
                                 "input_ids": ids, "loss_mask": [0] * 8 + [1] * 56}) + "\n")
    for w in ("ref", "run"):
        (tmp_path / w / "01c_merged").mkdir(parents=True)
        (tmp_path / w / "01c_merged/train.jsonl").write_text("".join(lines))
        (tmp_path / w / "01c_merged/manifest.json").write_text(json.dumps({"complete": True}))
    root = Path(__file__).resolve().parents[2]

    def cmd(w):
        return [sys.executable, str(root / "03_build_vocab_mapping.py"), "--workdir",
                str(tmp_path / w), "--target", str(tiny_target_dir), "--draft-vocab", "64",
                "--log-level", "WARNING"]

    kill_and_rerun(cmd, lambda w: tmp_path / w / "03_vocab", (0.03, 0.4, 0.9), root)
    assert_same_folder(tmp_path / "run/03_vocab", tmp_path / "run",
                       tmp_path / "ref/03_vocab", tmp_path / "ref")
