"""Stage 03 on a full and on a read-only disk (a real tmpfs): one stderr line naming where and
why, exit 1, nothing partial kept, and once the disk is back the same command ends with the
files of an undisturbed run. `--force` over a complete stage on a read-only disk names the stage
folder it could not remove and the entry that failed, not a folder guessed from a relative name."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from extract_helpers import copy_merged, write_merged
from fault_helpers import fill_disk, make_read_only, make_writable, small_disk
from stage_helpers import assert_same_folder

from eagle3.core.faults import script_main

OUT = "03_vocab"


def _main(workdir: Path, target: Path, *extra: str) -> int:
    main = importlib.import_module("03_build_vocab_mapping").main
    return main(["--workdir", str(workdir), "--target", str(target), "--draft-vocab", "64",
                 *extra])


def _script(workdir: Path, target: Path, capsys, *extra: str) -> tuple[int, str]:
    """03 through its entry point: (exit code, its one error line); never a traceback."""
    capsys.readouterr()
    rc = script_main(lambda: _main(workdir, target, *extra), "03")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("03: ")]
    return rc, line


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tmp_path_factory) -> Path:
    workdir = write_merged(tmp_path_factory.mktemp("ref") / "w", n_train=40, n_eval=2)
    assert _main(workdir, tiny_target_dir) == 0
    return workdir


@pytest.mark.parametrize("case", ["full", "read-only", "read-only --force"])
def test_03_on_a_full_or_read_only_disk_stops_in_one_line_and_resumes(
        reference, tiny_target_dir, tmp_path, capsys, case):
    with small_disk(tmp_path / "disk", kib=1024) as disk:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        run = copy_merged(reference, disk / "w")
        extra = ("--force",) if case.endswith("--force") else ()
        if extra:  # a complete stage to redo
            assert _main(run, tiny_target_dir) == 0
        if case == "full":
            fill_disk(disk, leave=0)
        elif not make_read_only(disk):
            pytest.skip("cannot remount the tmpfs read-only here")
        try:
            rc, line = _script(run, tiny_target_dir, capsys, *extra)
        finally:
            make_writable(disk)
        assert rc == 1
        if case == "full":
            assert f"no space left in {run / OUT}" in line
        elif extra:  # the stage folder --force could not remove, and the entry that failed
            assert f"--force cannot remove {run / OUT} (" in line
            assert "read-only file system" in line and " in ." not in line
            assert any(f"({p.name}: " in line for p in (reference / OUT).iterdir())
            assert_same_folder(run / OUT, run, reference / OUT, reference)  # nothing removed
        else:
            assert f"cannot write {run / OUT}: read-only file system" in line
        if not extra:
            assert not (run / OUT / "manifest.json").exists()
        (disk / "ballast").unlink(missing_ok=True)  # the disk is back: the same command
        assert _main(run, tiny_target_dir, *extra) == 0
        assert_same_folder(run / OUT, run, reference / OUT, reference, run_counts=("force",))
