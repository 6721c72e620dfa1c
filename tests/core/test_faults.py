"""The shared fault handling (eagle3/core/faults.py): disk errors from the atomic writers, the
skip list with its budget, signals turned into a clean stop, and the scripts' entry point."""

from __future__ import annotations

import errno
import signal

import pytest

from eagle3.core.faults import (
    BadRecords,
    DiskError,
    Interrupted,
    StopSignals,
    TooManyBad,
    script_main,
)
from eagle3.core.records import JsonlAppender
from eagle3.core.stage import StageError, atomic_write_bytes, atomic_writer
from tests.fault_helpers import full_disk_shim, make_read_only, make_writable, small_disk


def _no_temp(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


def test_atomic_write_on_a_full_disk_names_folder_and_bytes(tmp_path):
    with small_disk(tmp_path / "disk", kib=64) as disk:
        if disk is None:
            pytest.skip("no tmpfs here: the shim test below covers it")
        (disk / "old.bin").write_bytes(b"old")
        with pytest.raises(DiskError) as e:
            atomic_write_bytes(disk / "old.bin", b"x" * 200_000)
        msg = str(e.value)
        assert str(disk) in msg and "200,000 bytes" in msg and "no space left" in msg
        assert (disk / "old.bin").read_bytes() == b"old"  # the old content stands
        assert _no_temp(disk)
        atomic_write_bytes(disk / "old.bin", b"y" * 1000)  # space is back: it writes
        assert (disk / "old.bin").read_bytes() == b"y" * 1000


def test_atomic_write_on_a_read_only_disk(tmp_path):
    with small_disk(tmp_path / "disk", kib=64) as disk:
        if disk is None or not make_read_only(disk):
            pytest.skip("no tmpfs remount here")
        try:
            with pytest.raises(DiskError, match="read-only file system"):
                atomic_write_bytes(disk / "a.bin", b"x")
        finally:
            make_writable(disk)
        assert not (disk / "a.bin").exists()


def test_streaming_writer_shim_full_disk_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    with full_disk_shim(monkeypatch, after_bytes=10_000, under=tmp_path):
        with pytest.raises(DiskError) as e:
            with atomic_writer(target) as f:
                for _ in range(50):
                    f.write(b"z" * 4096)
    assert str(tmp_path) in str(e.value) and "bytes" in str(e.value)
    assert not target.exists() and _no_temp(tmp_path)


def test_jsonl_appender_torn_line_from_a_full_disk_is_dropped(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    with JsonlAppender(path) as out:
        out.write({"i": 0})
    with full_disk_shim(monkeypatch, after_bytes=5, under=tmp_path):
        out = JsonlAppender(path)
        out.write({"i": 1, "pad": "x" * 100})
        with pytest.raises(OSError) as e:
            out.close()
        assert e.value.errno == errno.ENOSPC
    with JsonlAppender(path) as out:  # reopened once space is back: the torn tail is cut
        out.write({"i": 2})
    assert path.read_text().splitlines() == ['{"i": 0}', '{"i": 2}']


def test_bad_records_budget_and_resume(tmp_path):
    bad = BadRecords(tmp_path, max_bad=2)
    bad.add("r1", "non-finite: 3 NaN in hidden_states[1]", file=tmp_path / "a.pt")
    bad.add("r1", "non-finite: again")  # the same record counts once
    bad.add("r2", "checksum: sha256 differs")
    assert bad.summary()["skipped"] == 2
    with pytest.raises(TooManyBad, match="3 bad records, more than --max-bad 2"):
        bad.add("r3", "truncated: zip end not found")
    again = BadRecords(tmp_path, max_bad=-1)  # a resumed run counts the earlier skips
    assert again.count == 3 and again.seen == {"r1", "r2", "r3"}
    assert again.reasons == {"non-finite": 1, "checksum": 1, "truncated": 1}


def test_stop_signals_first_flags_second_interrupts():
    # raise_signal: to this thread, its handler run before the call returns (os.kill may
    # reach another thread of the process, and the handler then runs a few bytecodes later)
    with StopSignals() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(Interrupted, match="SIGTERM.*re-run the same command"):
            stop.check()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("exc, code, text", [
    (StageError("upstream folder x does not exist"), 1, "05: error: upstream folder x"),
    (Interrupted(signal.SIGTERM), 128 + signal.SIGTERM, "05: stopped by SIGTERM"),
    (OSError(errno.ENOSPC, "No space left on device", "/w/04_train/x.pt"), 1,
     "05: error: cannot write /w/04_train/x.pt: no space left in /w/04_train"),
])
def test_script_main_turns_faults_into_one_line(exc, code, text, capsys):
    def main():
        raise exc
    assert script_main(main, "05") == code
    err = capsys.readouterr().err
    assert err.startswith(text) and "Traceback" not in err and err.count("\n") == 1


def test_script_main_lets_programming_errors_through():
    def main():
        raise OSError(errno.EACCES, "denied")
    with pytest.raises(OSError):
        script_main(main, "05")
