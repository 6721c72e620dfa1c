"""Stage 04 on damaged copies of tiny hidden-state files: each fault kind is skipped and listed
(`04_train/skipped.jsonl`), or stops the stage with an error naming the file; never trained on.

Fault kinds and their expected outcome (FAULTS below): truncated, emptied, 64 flipped bytes,
NaN in one token, Inf in another, wrong hidden size, wrong dtype, an index line to a missing
file, a file without an index line, a hand-edited index line. Plus: a damaged index or manifest
(the stage stops), --max-bad, an exact resume after SIGKILL meeting the same skips, SIGTERM, and
a disk that fills up under 04_train/ (a real tmpfs).

Run as a script (the kill-and-resume test): WORK OUT [KILL_AT_STEP].
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # run as a script: the tests' helpers beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_helpers as th  # noqa: E402
from fault_helpers import (  # noqa: E402
    flip_bytes,
    full_disk_shim,
    make_writable,
    small_disk,
    truncate_copy,
)

from eagle3.core import hidden_states as hs  # noqa: E402
from eagle3.core.faults import BadRecords, DiskError, InputFileError, Interrupted, StopSignals  # noqa: E402
from eagle3.core.stage import STAGE_DIRS, file_sha256  # noqa: E402
from eagle3.extract.writer import INDEX_FILE  # noqa: E402
from eagle3.train.files import check_split, read_sample  # noqa: E402

CAPTURE = [2, 4, 5]


def write_split(root: Path, n: int, seed: int) -> None:
    """`n` tiny files and the index 02b writes beside them (sha256 included)."""
    th.write_dataset(root, n, seed)
    reindex(root)


def reindex(root: Path, drop: tuple = ()) -> None:
    lines = []
    for p in sorted(root.glob("shard_*/data_*.pt"), key=hs.file_index):
        idx = hs.file_index(p)
        if idx in drop:
            continue
        data = hs.load(p, mmap=True)
        lines.append(json.dumps({"idx": idx, "id": data["meta"]["id"],
                                 "tokens": hs.num_tokens(data), "bytes": p.stat().st_size,
                                 "sha256": file_sha256(p)}) + "\n")
    (root / INDEX_FILE).write_text("".join(lines))


def _rewrite(path: Path, edit, reindexed: bool = True) -> None:
    """Load a file, `edit(data)`, save it back (as 02b would have written it: reindexed)."""
    data = hs.load(path)
    edit(data)
    hs.save(data, path)
    if reindexed:
        reindex(path.parent.parent)


def _nan_token(data):
    data["hidden_states"][1][3, 5] = float("nan")


def _inf_token(data):
    data["hidden_states"][3][7, 0] = float("inf")


def _wide(data):
    data["hidden_states"] = [torch.zeros(t.shape[0], th.H // 2, dtype=t.dtype)
                             for t in data["hidden_states"]]


def _float32(data):
    data["hidden_states"] = [t.float() for t in data["hidden_states"]]


def _edit_index_tokens(root: Path, idx: int) -> None:
    lines = [json.loads(x) for x in (root / INDEX_FILE).read_text().splitlines()]
    lines[idx]["tokens"] += 1
    (root / INDEX_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))


# kind -> (damage(split root, file path), where it is caught, the skip reason's start)
FAULTS = {
    "truncated": (lambda r, p: truncate_copy(p), "preflight", "wrong size"),
    "truncated_index_edited_to_match": (
        lambda r, p: (truncate_copy(p), reindex_size(r, p)), "preflight", "unreadable"),
    "emptied": (lambda r, p: p.write_bytes(b""), "preflight", "wrong size"),
    "flipped_64_bytes": (lambda r, p: flip_bytes(p, 64), "read", "checksum mismatch"),
    "nan_in_one_token": (lambda r, p: _rewrite(p, _nan_token), "read", "non-finite"),
    "inf_in_another": (lambda r, p: _rewrite(p, _inf_token), "read", "non-finite"),
    "wrong_hidden_size": (lambda r, p: _rewrite(p, _wide), "preflight", "wrong shape"),
    "wrong_dtype": (lambda r, p: _rewrite(p, _float32), "preflight", "wrong dtype"),
    "index_line_to_missing_file": (lambda r, p: p.unlink(), "preflight", "missing"),
    "file_without_index_line": (lambda r, p: reindex(r, drop=(hs.file_index(p),)),
                                "preflight", "unindexed"),
    "index_line_edited": (lambda r, p: _edit_index_tokens(r, hs.file_index(p)), "preflight",
                          "index mismatch"),
}


def reindex_size(root: Path, path: Path) -> None:
    """A hand-edited index that agrees with a truncated file's size (so the header must tell)."""
    lines = [json.loads(x) for x in (root / INDEX_FILE).read_text().splitlines()]
    for x in lines:
        if x["idx"] == hs.file_index(path):
            x["bytes"], x["sha256"] = path.stat().st_size, file_sha256(path)
    (root / INDEX_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_a_damaged_file_is_skipped_and_listed_where_it_is_caught(tmp_path, kind):
    damage, where, reason = FAULTS[kind]
    root = tmp_path / "train"
    write_split(root, 6, seed=1)
    victim = hs.file_path(root, 2)
    damage(root, victim)
    bad = BadRecords(tmp_path / "04_train", max_bad=-1)
    files, index = check_split(root, th.H, CAPTURE, bad)
    if where == "preflight":
        assert victim not in files and len(files) == 5
        assert len(index.lengths) == 5
    else:  # the header is fine: caught when the file is read for training
        assert victim in files and bad.count == 0
        data, skip = read_sample(files, files.index(victim))
        assert data is None and skip["file"] == str(victim)
        bad.add(skip["id"], skip["reason"], skip["file"])
    rows = [json.loads(x) for x in bad.path.read_text().splitlines()]
    assert len(rows) == 1, rows
    assert rows[0]["reason"].startswith(reason), rows[0]
    assert rows[0]["file"] == str(victim)
    for j, p in enumerate(files):  # every other file reads as good
        if p != victim:
            assert read_sample(files, j)[1] is None


def test_a_truncated_or_emptied_file_raises_an_error_naming_it_not_a_zip_error(tmp_path):
    root = tmp_path / "train"
    write_split(root, 2, seed=1)
    for path, cut in ((hs.file_path(root, 0), 0.5), (hs.file_path(root, 1), 0.0)):
        truncate_copy(path, cut)
        with pytest.raises(InputFileError, match=f"{path}: unreadable"):
            hs.check_header(path, th.H, CAPTURE)


@pytest.mark.parametrize("line", ["{not json\n", '{"idx": 0}\n', "dup"])
def test_a_damaged_index_stops_the_stage_naming_it(tmp_path, line):
    root = tmp_path / "train"
    write_split(root, 3, seed=1)
    text = (root / INDEX_FILE).read_text()
    first = text.splitlines(keepends=True)[0]
    (root / INDEX_FILE).write_text(text + (first if line == "dup" else line))
    with pytest.raises(InputFileError, match=f"{root / INDEX_FILE}: line 4"):
        check_split(root, th.H, CAPTURE, BadRecords(tmp_path, -1))


def test_an_index_without_checksums_is_read_unverified_and_said_once(tmp_path, caplog):
    root = tmp_path / "train"
    write_split(root, 3, seed=1)
    lines = [json.loads(x) for x in (root / INDEX_FILE).read_text().splitlines()]
    (root / INDEX_FILE).write_text("".join(
        json.dumps({k: v for k, v in x.items() if k != "sha256"}) + "\n" for x in lines))
    files, _ = check_split(root, th.H, CAPTURE, BadRecords(tmp_path, -1))
    assert files.sha256 == [None] * 3
    assert sum("no checksums" in r.message for r in caplog.records) == 1


def test_past_max_bad_the_preflight_stops_naming_the_skip_list(tmp_path):
    from eagle3.core.faults import TooManyBad

    root = tmp_path / "train"
    write_split(root, 4, seed=1)
    for i in (0, 1):
        hs.file_path(root, i).unlink()
    with pytest.raises(TooManyBad, match="skipped.jsonl"):
        check_split(root, th.H, CAPTURE, BadRecords(tmp_path, max_bad=1))


def test_files_captured_at_other_layers_than_the_manifest_says_are_skipped(tmp_path):
    root = tmp_path / "train"
    write_split(root, 3, seed=1)
    bad = BadRecords(tmp_path, -1)
    files, _ = check_split(root, th.H, [1, 2, 3], bad)
    assert len(files) == 0 and bad.reasons == {"wrong layout": 3}


# ---------------------------------------------------------------- training on damaged data


def damaged_workdir(work: Path) -> Path:
    """A 02b folder of 24 + 4 files, one of each read-time fault and two preflight ones."""
    root = work / STAGE_DIRS["02b"]
    write_split(root / "train", 24, seed=1)
    write_split(root / "eval", 4, seed=2)
    _rewrite(hs.file_path(root / "train", 5), _nan_token)  # as 02b wrote them (reindexed)
    _rewrite(hs.file_path(root / "train", 8), _inf_token)
    _rewrite(hs.file_path(root / "eval", 2), _nan_token)
    flip_bytes(hs.file_path(root / "train", 3), 64)  # damaged since
    truncate_copy(hs.file_path(root / "train", 11))
    hs.file_path(root / "eval", 1).unlink()
    return work


def run_checked(work: Path, out: Path, kill_at_step: int | None = None,
                term_at_step: int | None = None, full_after: tuple | None = None, **overrides):
    """Train the tiny draft on `work`'s 02b folder through the stage's checked data path and
    its door around the loop. `full_after` = (monkeypatch, bytes): the disk under `out` fills
    up once the training wrote that many bytes (the write shim)."""
    from eagle3.train.distributed import DistInfo
    from eagle3.train.loop import build_runtime
    from eagle3.train.stage import RESUME_HINT, _train, load_data

    torch.set_num_threads(1)
    at = kill_at_step if kill_at_step is not None else term_at_step
    if at is not None:
        sig = signal.SIGKILL if kill_at_step is not None else signal.SIGTERM
        calls, original = {"n": 0}, torch.optim.AdamW.step

        def step_then_signal(self, *a, **kw):
            result = original(self, *a, **kw)
            calls["n"] += 1
            if calls["n"] == at + 1:
                os.kill(os.getpid(), sig)
            return result

        torch.optim.AdamW.step = step_then_signal
    cfg = th.tiny_config(work, epochs=1, max_bad=-1, **overrides)
    draft, embed, teacher = th.tiny_parts()
    lm_head, d2t = th.tiny_lm_head()
    try:
        with StopSignals(RESUME_HINT) as stop:
            data = load_data(cfg, out, True, d2t, th.H, CAPTURE, stop)
            rt = build_runtime(cfg, torch.device("cpu"), DistInfo())
            with (full_disk_shim(full_after[0], full_after[1], under=out) if full_after
                  else contextlib.nullcontext()):
                summary = _train(cfg, out, data, (draft, embed, teacher, lm_head), rt)
    finally:
        if at is not None:
            torch.optim.AdamW.step = original
    return summary, draft


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    return damaged_workdir(tmp_path_factory.mktemp("damaged"))


def _skip_list(out: Path) -> dict[str, str]:
    rows = [json.loads(x) for x in (out / "skipped.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["id"] for r in rows}), "a record listed twice"
    return {r["id"]: r["reason"].split(":")[0] for r in rows}


EXPECTED_SKIPS = {"train:t/3": "checksum mismatch", "train:t/5": "non-finite",
                  "train:t/8": "non-finite", "train:t/11": "wrong size", "eval:t/1": "missing",
                  "eval:t/2": "non-finite"}  # eval's t/2 is another record than train's


def test_04_trains_on_the_good_records_only_and_lists_each_bad_one_once(damaged, tmp_path):
    summary, draft = run_checked(damaged, tmp_path / "out")
    assert all(torch.isfinite(p).all() for p in draft.parameters())
    assert _skip_list(tmp_path / "out") == EXPECTED_SKIPS
    assert summary["num_steps"] > 0


def test_04_killed_and_resumed_meets_the_same_skips_and_ends_with_the_same_draft(damaged,
                                                                                  tmp_path):
    me = str(Path(__file__).resolve())
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    subprocess.run([sys.executable, me, str(damaged), str(whole)], check=True, timeout=300)
    proc = subprocess.run([sys.executable, me, str(damaged), str(crashed), "4"], timeout=300)
    assert proc.returncode == -9  # after the update of step 4 (checkpoint at 3)
    subprocess.run([sys.executable, me, str(damaged), str(crashed)], check=True, timeout=300)
    assert _skip_list(crashed) == _skip_list(whole) == EXPECTED_SKIPS
    a = torch.load(whole / "draft.pt", weights_only=True)
    b = torch.load(crashed / "draft.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_abandons_the_step_in_flight_and_a_rerun_ends_like_an_uninterrupted_run(
        damaged, tmp_path):
    with pytest.raises(Interrupted, match="SIGTERM.*re-run the same command to resume"):
        run_checked(damaged, tmp_path / "cut", term_at_step=4)
    steps = sorted(p.name for p in (tmp_path / "cut/checkpoints").glob("step_*"))
    assert steps == ["step_000003"]  # complete checkpoints only; step 4's update is lost
    _, resumed = run_checked(damaged, tmp_path / "cut")
    _, whole = run_checked(damaged, tmp_path / "whole")
    for (name, x), y in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(x, y), name


def test_a_full_disk_under_04_train_stops_naming_the_folder_and_a_rerun_resumes(damaged,
                                                                                  tmp_path):
    with small_disk(tmp_path / "disk", kib=96) as disk:  # full in the first checkpoint
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        out = disk / "04_train"
        with pytest.raises(DiskError, match=r"no space left in .*04_train.*bytes") as e:
            run_checked(damaged, out)
        assert "re-run the same command to resume" in str(e.value)
        assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no partial file
        assert not [p for p in (out / "checkpoints").glob("step_*")
                    if not (p / "COMPLETE").exists()]
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        make_writable(disk)
        _, resumed = run_checked(damaged, out)
        _, whole = run_checked(damaged, tmp_path / "whole")
        for (name, x), y in zip(whole.state_dict().items(), resumed.state_dict().values()):
            assert torch.equal(x, y), name


if __name__ == "__main__":  # WORK OUT [KILL_AT_STEP]
    _, trained = run_checked(Path(sys.argv[1]), Path(sys.argv[2]),
                             kill_at_step=int(sys.argv[3]) if len(sys.argv) > 3 else None,
                             num_workers=1)
    torch.save(trained.state_dict(), Path(sys.argv[2]) / "draft.pt")


def test_a_full_disk_while_logging_stops_with_a_disk_error_and_a_rerun_resumes(damaged, tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "out"
    with pytest.raises(DiskError, match=r"no space left in .*out"):
        run_checked(damaged, out, full_after=(monkeypatch, 100))  # the step-0 eval's lines
    _, resumed = run_checked(damaged, out)
    _, whole = run_checked(damaged, tmp_path / "whole")
    for (name, x), y in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(x, y), name


def test_a_nonfinite_gradient_stop_names_the_records_of_its_step(damaged, tmp_path,
                                                                 monkeypatch):
    from eagle3.train import loop
    from eagle3.train.data import records_of_step
    from eagle3.train.stage import TrainStopped

    real = loop.clip_gradients

    def nan_at_step_2(optimizer, max_norm, step, flag):
        if step == 2:
            raise FloatingPointError(f"step {step}: gradient norm nan is not finite; stopping "
                                     "before the update")
        return real(optimizer, max_norm, step, flag)

    monkeypatch.setattr(loop, "clip_gradients", nan_at_step_2)
    with pytest.raises(TrainStopped, match="step 2: gradient norm nan") as e:
        run_checked(damaged, tmp_path / "out")
    from eagle3.train.stage import load_data

    cfg = th.tiny_config(damaged, epochs=1, max_bad=-1)
    data = load_data(cfg, tmp_path / "again", True, th.tiny_lm_head()[1], th.H, CAPTURE)
    records = records_of_step(data, cfg, 1, 0, 2)
    assert records and all(f"{rid} ({path})" in str(e.value) for rid, path in records)
    assert "skipped.jsonl" in str(e.value)


def test_a_hand_edited_02b_manifest_stops_the_stage_naming_it(tmp_path):
    from eagle3.train.stage import check_inputs

    for name, text in (("02b", '{"complete": true, "capture_layers": [2, 4'), ("03", "{}")):
        folder = tmp_path / STAGE_DIRS[name]
        folder.mkdir()
        (folder / "manifest.json").write_text(text)
    with pytest.raises(InputFileError, match="02b_hidden_states/manifest.json: not valid JSON"):
        check_inputs(th.tiny_config(tmp_path))
