"""Stage 02b's faults with the hf backend: bad merged lines skipped and counted (`--max-bad`),
NaN/Inf states skipped naming record, layer and count, the sha256 of every file in its index,
a full or read-only disk (a real small tmpfs) stopping with a DiskError and a re-run that
ends with the files of an uninterrupted run, SIGTERM stopping with a resume line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from extract_helpers import STAGE, copy_merged, data_files, main_02b, write_merged
from fault_helpers import fill_disk, small_disk, truncate_copy

from eagle3.core import hidden_states as hs
from eagle3.core.faults import script_main
from eagle3.core.records import read_jsonl
from eagle3.core.stage import atomic_writer, file_sha256
from eagle3.core.target import default_capture_layers, read_target_info
from eagle3.extract.checks import BadStates, pack_checked
from eagle3.extract.writer import SplitWriter

# A bad line of each kind, inserted in the middle of train.jsonl, with its skip-list reason kind.
GOOD = {"id": "x/ok", "source": "s", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
BAD_LINES = [
    ("bad json", '{"id": "x/torn", "input_ids": [1, 2'),
    ("bad record", "[1, 2, 3]"),  # valid JSON, not an object
    ("bad input_ids", json.dumps({**GOOD, "id": "x/no-ids", "input_ids": None})),
    ("bad input_ids", json.dumps({**GOOD, "id": "x/negative", "input_ids": [1, -2, 3]})),
    ("bad input_ids", json.dumps({**GOOD, "id": "x/oov", "input_ids": [1, 554, 3]})),
    ("bad input_ids", json.dumps({**GOOD, "id": "x/empty", "input_ids": [], "loss_mask": []})),
    ("bad loss_mask", json.dumps({**GOOD, "id": "x/short-mask", "loss_mask": [0, 1]})),
    ("bad loss_mask", json.dumps({**GOOD, "id": "x/mask-2", "loss_mask": [0, 2, 1]})),
    ("bad record", json.dumps({k: v for k, v in GOOD.items() if k != "source"})),
    ("duplicate id", None),  # a copy of the first record's line
]


def _hf(workdir: Path, target: Path, *extra: str) -> list[str]:
    return ["--workdir", str(workdir), "--target", str(target), "--backend", "hf",
            "--max-batch-size", "1", *extra]


def _index(workdir: Path, split: str = "train") -> list[dict]:
    return list(read_jsonl(workdir / STAGE / split / "index.jsonl"))


def _files_by_id(workdir: Path) -> dict[str, bytes]:
    out = {}
    for split in ("train", "eval"):
        for e in _index(workdir, split):
            out[e["id"]] = hs.file_path(workdir / STAGE / split, e["idx"]).read_bytes()
    return out


def _assert_same_run(workdir: Path, reference: Path) -> None:
    """The data files and the index lines of an uninterrupted run, byte for byte; no temp."""
    assert data_files(workdir) == data_files(reference)
    for rel in data_files(reference):
        assert (workdir / STAGE / rel).read_bytes() == (reference / STAGE / rel).read_bytes()
    for split in ("train", "eval"):
        assert _index(workdir, split) == _index(reference, split)
    assert not [p for p in (workdir / STAGE).rglob(".*tmp")]


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    return write_merged(tmp_path_factory.mktemp("merged") / "w", n_train=10, n_eval=2)


@pytest.fixture(scope="module")
def reference(merged, tiny_target_dir, tmp_path_factory) -> Path:
    workdir = copy_merged(merged, tmp_path_factory.mktemp("ref") / "w")
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    return workdir


def _with_bad_lines(merged: Path, workdir: Path) -> Path:
    copy_merged(merged, workdir)
    path = workdir / "01c_merged/train.jsonl"
    lines = path.read_text().splitlines()
    bad = [line if line is not None else lines[0] for _, line in BAD_LINES]
    path.write_text("\n".join(lines[:4] + bad + lines[4:]) + "\n")
    return workdir


def test_index_lists_the_sha256_of_each_file_as_written(reference):
    for split in ("train", "eval"):
        for e in _index(reference, split):
            assert e["sha256"] == file_sha256(hs.file_path(reference / STAGE / split, e["idx"]))


def test_main_skips_and_counts_every_bad_merged_line_and_extracts_the_others(
        merged, reference, tiny_target_dir, tmp_path, capsys):
    workdir = _with_bad_lines(merged, tmp_path / "w")
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    skipped = list(read_jsonl(workdir / STAGE / "skipped.jsonl"))
    assert [s["reason"].split(":")[0] for s in skipped] == [k for k, _ in BAD_LINES]
    src = workdir / "01c_merged/train.jsonl"
    for n, s in enumerate(skipped, start=5):  # each reason names the file and the line
        assert s["reason"].split(": ")[1] == f"{src} line {n}" and s["file"] == str(src)
    assert "input_ids[1] = -2" in skipped[3]["reason"]
    assert "input_ids[1] = 554" in skipped[4]["reason"] and "(vocabulary 554)" in skipped[4][
        "reason"]
    assert "is on lines 1 and 14" in skipped[-1]["reason"]
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert manifest["skipped"] == len(BAD_LINES) and manifest["skip_reasons"]["bad input_ids"] == 4
    assert manifest["outputs"]["train"]["skipped_bad"] == len(BAD_LINES)
    assert "skipped as bad" in capsys.readouterr().out
    # The good records keep their file names past the bad lines and hold the same bytes.
    assert _files_by_id(workdir) == _files_by_id(reference)
    assert [e["idx"] for e in _index(workdir)] == [*range(4), *range(4 + len(BAD_LINES), 20)]


def test_main_stops_naming_the_skip_list_when_more_lines_are_bad_than_max_bad(
        merged, tiny_target_dir, tmp_path, capsys):
    workdir = _with_bad_lines(merged, tmp_path / "w")
    assert script_main(lambda: main_02b()(_hf(workdir, tiny_target_dir, "--max-bad", "3")),
                       "02b") == 1
    err = capsys.readouterr().err
    assert "4 bad records, more than --max-bad 3" in err and "skipped.jsonl" in err
    assert data_files(workdir) == []  # stopped before the first forward pass
    assert main_02b()(_hf(workdir, tiny_target_dir, "--max-bad", "-1")) == 0
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert manifest["skipped"] == len(BAD_LINES)  # the first attempt's lines counted once


def test_main_skips_record_naming_layer_and_count_when_its_states_hold_nan(
        merged, reference, tiny_target_dir, tmp_path, monkeypatch):
    workdir = copy_merged(merged, tmp_path / "w")
    victim = list(read_jsonl(merged / "01c_merged/train.jsonl"))[6]  # 96 tokens
    layers = default_capture_layers(read_target_info(tiny_target_dir).num_hidden_layers)
    real = hs.capture_hf

    def overflowing(model, ids_BT, attn_BT, capture_layers):
        aux, final = real(model, ids_BT, attn_BT, capture_layers)
        for b in range(ids_BT.shape[0]):
            if ids_BT[b, :96].tolist() == victim["input_ids"]:
                aux[1][b, 10, :3] = float("inf")  # a bf16 overflow in one layer
        return aux, final

    monkeypatch.setattr(hs, "capture_hf", overflowing)
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    (line,) = read_jsonl(workdir / STAGE / "skipped.jsonl")
    assert line["reason"].startswith(f"non-finite states: record {victim['id']}: capture layer "
                                     f"{layers[1]} has 3 NaN/Inf values")
    assert not hs.file_path(workdir / STAGE / "train", 6).exists()
    assert len(data_files(workdir)) == len(data_files(reference)) - 1
    (workdir / STAGE / "manifest.json").unlink()  # resumed: not extracted again
    monkeypatch.setattr(hs, "capture_hf", real)
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    assert json.loads((workdir / STAGE / "manifest.json").read_text())["skipped"] == 1
    assert not hs.file_path(workdir / STAGE / "train", 6).exists()


@pytest.mark.parametrize("where", ["final", "teacher"])
def test_pack_checked_names_final_state_or_teacher_when_they_hold_nan(where):
    rec = {"id": "a/b", "input_ids": [1, 2], "loss_mask": [1, 1]}
    meta = {"id": "a/b", "capture_layers": [2, 4, 5], "final": "post_norm"}
    aux, final = [torch.zeros(2, 8)] * 3, torch.zeros(2, 8)
    if where == "final":
        final[1, :2] = float("nan")
        with pytest.raises(BadStates, match="record a/b: final state has 2 NaN/Inf values"):
            pack_checked(rec, aux, final, meta, "bf16")
        return

    class Head:  # a teacher whose log-probs overflow float16
        def topk(self, final_TH):
            return {"teacher_ids": torch.zeros(2, 1, dtype=torch.int16),
                    "teacher_logprobs": torch.tensor([[0.0], [-1e6]]).half(),
                    "target_top": torch.zeros(2, dtype=torch.int32)}

        def meta(self):
            return {"topk": 1}

    with pytest.raises(BadStates, match="teacher log-probs have 1 NaN/Inf"):
        pack_checked(rec, aux, final, meta, "fp8-topk", Head())


def test_resume_rehashes_unlogged_files_and_redoes_torn_or_resized_ones(
        merged, reference, tiny_target_dir, tmp_path):
    workdir = copy_merged(merged, tmp_path / "w")
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    root = workdir / STAGE / "train"
    (workdir / STAGE / "manifest.json").unlink()
    index = (root / "index.jsonl").read_text().splitlines(keepends=True)
    (root / "index.jsonl").write_text("".join(index[:5]))  # lines 5.. lost to a kill
    truncate_copy(hs.file_path(root, 2))  # logged, but its size no longer matches
    truncate_copy(hs.file_path(root, 7))  # unlogged and unreadable
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    _assert_same_run(workdir, reference)


def _read_only_on_top(disk: Path) -> bool:
    """Stack a read-only bind mount on `disk`: new opens get EROFS, as when the kernel turns a
    failing disk read-only (`remount,ro` itself is refused while a file is open for writing)."""
    return (subprocess.run(["mount", "--bind", str(disk), str(disk)]).returncode == 0
            and subprocess.run(["mount", "-o", "remount,bind,ro", str(disk)]).returncode == 0)


@pytest.mark.parametrize("fault", ["ENOSPC", "EROFS"])
def test_main_stops_with_disk_error_and_rerun_ends_with_the_uninterrupted_files(
        merged, reference, tiny_target_dir, tmp_path, monkeypatch, capsys, fault):
    with small_disk(tmp_path / "disk", kib=2048) as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (not root)")
        workdir = copy_merged(merged, disk / "w")
        real = SplitWriter.mark_written

        def fill_after_three(self, idx, *a, **kw):
            real(self, idx, *a, **kw)
            if len(self.done) == 3 and not (disk / "ballast").exists():
                if fault == "EROFS":
                    (disk / "ballast").touch()
                    assert _read_only_on_top(disk)
                    return
                fill_disk(disk, leave=20_000)  # another process

        monkeypatch.setattr(SplitWriter, "mark_written", fill_after_three)
        assert script_main(lambda: main_02b()(_hf(workdir, tiny_target_dir)), "02b") == 1
        err = capsys.readouterr().err
        kind = "no space left" if fault == "ENOSPC" else "read-only file system"
        assert f"{kind} in {workdir / STAGE / 'train'}" in err and "re-run" in err
        assert "Traceback" not in err and not (workdir / STAGE / "manifest.json").exists()
        assert not [p for p in (workdir / STAGE).rglob(".*tmp")]  # no partial file
        for rel in data_files(workdir):  # what is there is whole
            hs.load(workdir / STAGE / rel)
        if fault == "EROFS":
            assert subprocess.run(["umount", str(disk)]).returncode == 0  # writable again
        (disk / "ballast").unlink()
        monkeypatch.setattr(SplitWriter, "mark_written", real)
        assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
        _assert_same_run(workdir, reference)


def test_main_stops_on_sigterm_after_the_record_in_flight_and_rerun_completes(
        merged, reference, tiny_target_dir, tmp_path, monkeypatch, capsys):
    workdir = copy_merged(merged, tmp_path / "w")
    real = SplitWriter.mark_written

    def mark_then_signal(self, idx, *a, **kw):
        real(self, idx, *a, **kw)
        if len(self.done) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(SplitWriter, "mark_written", mark_then_signal)
    rc = script_main(lambda: main_02b()(_hf(workdir, tiny_target_dir)), "02b")
    assert rc == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "02b: stopped by SIGTERM" in err and "re-run the same command to resume" in err
    assert len(data_files(workdir)) == 2 and len(_index(workdir)) == 2  # index flushed
    monkeypatch.setattr(SplitWriter, "mark_written", real)
    assert main_02b()(_hf(workdir, tiny_target_dir)) == 0
    _assert_same_run(workdir, reference)


def test_save_hash_equals_the_hash_of_the_bytes_read_back_for_every_layout(tmp_path):
    """The hash taken while torch.save streams equals a re-read's, on the same bytes as an
    unhashed save (cost per GB: tests/extract/bench_save_sha256.py)."""
    torch.manual_seed(0)
    for dtype in ("bf16", "fp8", "fp8-all"):
        aux, final = [torch.randn(300, 64) for _ in range(3)], torch.randn(300, 64)
        data = hs.pack(list(range(300)), [1] * 300, aux, final, {"id": "a"}, dtype)
        with atomic_writer(tmp_path / "plain.pt") as f:
            torch.save(data, f)
        saved = hs.save_with_sha256(data, tmp_path / f"{dtype}.pt")
        assert saved.sha256 == file_sha256(tmp_path / f"{dtype}.pt")
        assert saved.bytes == (tmp_path / f"{dtype}.pt").stat().st_size
        assert (tmp_path / "plain.pt").read_bytes() == (tmp_path / f"{dtype}.pt").read_bytes()


def test_main_names_the_missing_split_file_when_merge_wrote_no_such_split(
        merged, tiny_target_dir, tmp_path, capsys):
    workdir = copy_merged(merged, tmp_path / "w")
    (workdir / "01c_merged/eval.jsonl").unlink()
    assert script_main(lambda: main_02b()(_hf(workdir, tiny_target_dir)), "02b") == 1
    err = capsys.readouterr().err
    assert f"{workdir / '01c_merged/eval.jsonl'}: missing" in err and "--splits" in err
    assert not (workdir / STAGE).exists()  # refused before the stage folder was made
