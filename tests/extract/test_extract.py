"""Stage 02b shared pieces and the hf backend: resume by id, disk preflight, fixed batches."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from extract_helpers import (
    STAGE,
    assert_same_outputs,
    copy_merged,
    data_files,
    main_02b,
    write_merged,
)
from stage_helpers import assert_same_folder

from eagle3.core import hidden_states as hs
from eagle3.core.records import read_jsonl
from eagle3.extract import writer as extract
from eagle3.extract.hf import fixed_batches
from eagle3.extract.writer import ExtractError, SplitWriter, check_output_disk


def _hf(workdir: Path, target: Path, *extra: str) -> int:
    return main_02b()(["--workdir", str(workdir), "--target", str(target), "--backend", "hf",
                       "--max-batch-tokens", "300", *extra])


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    return write_merged(tmp_path_factory.mktemp("merged") / "w")


def test_extract_hf_writes_identical_files_when_killed_and_resumed(merged, tiny_target_dir,
                                                                    tmp_path):
    reference = copy_merged(merged, tmp_path / "ref")
    assert _hf(reference, tiny_target_dir) == 0
    batches = fixed_batches([len(r["input_ids"]) for r in read_jsonl(
        merged / "01c_merged/train.jsonl")], 300, 64)
    assert len(batches) >= 4 and max(len(b) for b in batches) >= 3  # really batched
    workdir = copy_merged(merged, tmp_path / "w")
    assert _hf(workdir, tiny_target_dir) == 0
    # What a kill leaves: a manifest never written, files of half-done batches missing, a temp
    # file, and files whose index line never reached the disk.
    root = workdir / STAGE / "train"
    (workdir / STAGE / "manifest.json").unlink()
    for batch in batches[1:3]:
        hs.file_path(root, batch[0]).unlink()
    lines = (root / "index.jsonl").read_text().splitlines(keepends=True)
    (root / "index.jsonl").write_text("".join(lines[:5]) + lines[5][:7])  # torn tail
    stale = hs.file_path(root, 0).with_name(".data_0.pt.123.abc.tmp")
    stale.write_bytes(b"partial")
    assert _hf(workdir, tiny_target_dir) == 0
    assert_same_outputs(workdir, reference)
    assert not stale.exists()
    assert_same_folder(workdir / STAGE, workdir, reference / STAGE, reference, run_counts=(
        "written", "written_tokens", "written_bytes", "skipped_existing"))  # index order too
    index = {e["idx"]: e["id"] for e in read_jsonl(root / "index.jsonl")}
    records = list(read_jsonl(merged / "01c_merged/train.jsonl"))
    assert index == {i: r["id"] for i, r in enumerate(records)}


def test_extract_hf_stores_only_own_rows_when_target_runs_in_bf16(merged, tiny_target_dir,
                                                                 tmp_path):
    workdir = copy_merged(merged, tmp_path / "w")
    assert _hf(workdir, tiny_target_dir, "--model-dtype", "bfloat16", "--splits", "eval") == 0
    for rel in data_files(workdir):  # a row slice of a bf16 batch must not drag the batch along
        data = hs.load(workdir / STAGE / rel)
        T = data["input_ids"].shape[0]
        size = (workdir / STAGE / rel).stat().st_size
        assert size <= hs.estimate_bytes(T, 1, 64, "bf16"), rel


def _writer(tmp_path: Path, merged: Path) -> tuple[SplitWriter, list[dict]]:
    records = list(read_jsonl(merged / "01c_merged/train.jsonl"))
    return SplitWriter(tmp_path / "train", records), records


def _write_some(writer: SplitWriter, idxs: list[int]) -> None:
    for i in idxs:
        rec = writer.records[i]
        T = len(rec["input_ids"])
        data = hs.pack(rec["input_ids"], rec["loss_mask"], [torch.zeros(T, 4)] * 3,
                       torch.zeros(T, 4), extract.record_meta(rec, [2, 4, 5]))
        writer.mark_written(i, T, hs.save(data, writer.path(i)))
    writer.close()


@pytest.mark.parametrize("lose_index", [False, True], ids=["logged", "unlogged"])
def test_split_writer_refuses_folder_when_merged_split_changed_under_it(merged, tmp_path,
                                                                       lose_index):
    writer, records = _writer(tmp_path, merged)
    _write_some(writer, [0, 1, 2])
    if lose_index:
        (tmp_path / "train" / "index.jsonl").unlink()
    records[1], records[7] = records[7], records[1]  # the merge stage re-ran and reordered
    with pytest.raises(ExtractError, match=r"data_1\.pt holds record .*--force"):
        SplitWriter(tmp_path / "train", records)
    records[1], records[7] = records[7], records[1]
    resumed = SplitWriter(tmp_path / "train", records)
    assert sorted(resumed.done) == [0, 1, 2] and resumed.pending()[0] == 3


def test_split_writer_refuses_split_when_ids_repeat(merged, tmp_path):
    records = list(read_jsonl(merged / "01c_merged/train.jsonl"))
    with pytest.raises(ExtractError, match="lines 0 and 5"):
        SplitWriter(tmp_path / "train", records[:5] + records[:1])


def test_check_output_disk_refuses_with_numbers_when_estimate_exceeds_free_space(
        merged, tmp_path, monkeypatch):
    writer, records = _writer(tmp_path, merged)
    tokens = sum(len(r["input_ids"]) for r in records)
    Usage = namedtuple("Usage", "total used free")
    need = hs.estimate_bytes(tokens, len(records), 7168, "bf16")
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda p: Usage(0, 0, int(need * 1.05)))
    with pytest.raises(ExtractError) as e:
        check_output_disk(tmp_path, [writer], 7168, "bf16", margin=0.1)
    msg = str(e.value)
    assert f"{tokens:,} tokens x 57,360 bytes/token" in msg and "--dtype fp8" in msg
    # fp8 needs 35,868 bytes a token: it fits where bf16 did not
    assert check_output_disk(tmp_path, [writer], 7168, "fp8", margin=0.1) < need * 0.7
    writer.close()


def test_check_output_disk_counts_only_pending_records_when_resuming(merged, tmp_path,
                                                                     monkeypatch):
    writer, records = _writer(tmp_path, merged)
    _write_some(writer, list(range(10)))
    resumed = SplitWriter(tmp_path / "train", records)
    pending_tokens = sum(len(records[i]["input_ids"]) for i in range(10, 20))
    assert check_output_disk(tmp_path, [resumed], 64, "bf16", 0.0) == hs.estimate_bytes(
        pending_tokens, 10, 64, "bf16")
    resumed.close()


def test_main_refuses_sglang_backend_when_dump_dir_is_missing(merged, tiny_target_dir, capsys):
    with pytest.raises(SystemExit):
        main_02b()(["--workdir", str(merged), "--target", str(tiny_target_dir)])
    assert "--dump-dir" in capsys.readouterr().err


def test_fixed_batches_do_not_depend_on_which_files_exist():
    lengths = [5, 300, 17, 17, 120, 64, 1, 250]
    batches = fixed_batches(lengths, 400, 3)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(max(lengths[i] for i in b) * len(b) <= 400 or len(b) == 1 for b in batches)
    assert batches == fixed_batches(list(lengths), 400, 3)
    assert fixed_batches(lengths, 400, 1) == [[i] for i in sorted(range(8), key=lambda i: (
        -lengths[i], i))]


def test_tmp_files_are_not_taken_for_data_files(tmp_path):
    shutil.rmtree(tmp_path, ignore_errors=True)
    root = tmp_path / "train"
    path = hs.file_path(root, 3)
    path.parent.mkdir(parents=True)
    path.with_name(".data_3.pt.1.2.tmp").write_bytes(b"x")
    path.with_name("data_4.pt").write_bytes(b"kept")  # not a temp name
    from eagle3.core.stage import sweep_temp_files

    assert sweep_temp_files(root) == 1 and [p.name for p in path.parent.iterdir()] == ["data_4.pt"]
