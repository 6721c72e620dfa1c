"""02b's SGLang client against a dump server that misbehaves on cue (tests/fake_dump_server.py):
each fault (HTTP 500, no answer, an answer cut half-way, a wrong prompt_tokens, a dump short of a
row or truncated) ends in a bounded retry with backoff and then a failure line for that record,
never a hang and never a wrong file; NaN states are skipped as bad; SIGTERM stops cleanly.

And a server that lies: a dump must prove it belongs to its request (its input_ids, its dtype),
what sits at a dump's path is read only as a plain file of a dump's size, and a server that is not
the dump server (or a run that cannot go on) ends the script in one line, exit 1: one whose
states fail `--verify-against-hf` leaves nothing a clean run would not write (no file, no index
line of a removed file), one that answers empty bodies or never answers stops after one
request's retries, within a bound computed from the deadlines."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from extract_helpers import (
    STAGE,
    assert_same_outputs,
    copy_merged,
    data_files,
    main_02b,
    write_merged,
)
from fake_dump_server import FakeDumpServer, Faults
from fault_helpers import fill_disk, silent_server, small_disk

from eagle3.core.faults import DiskError, script_main
from eagle3.core.hidden_states import file_path
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy
from eagle3.core.stage import file_sha256
from eagle3.core.target import default_capture_layers, read_target_info
from eagle3.extract.config import ExtractConfig
from eagle3.extract.sglang import ClientTuning, Expected, extract_sglang, make_rid
from eagle3.extract.writer import INDEX_FILE, SplitWriter

N_TRAIN = 6
BAD = 4  # the faulted record's line (48 tokens: one full chunk)
# fault -> the words its failure line must hold
PERSISTENT = {"http_500": "HTTP 500", "hang": "no answer within",
              "close_midway": "connection dropped", "wrong_prompt_tokens": "prompt_tokens",
              "short_rows_dump": "short dump", "truncate_dump": "unreadable dump"}


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    return write_merged(tmp_path_factory.mktemp("merged") / "w", n_train=N_TRAIN, n_eval=1)


@pytest.fixture(scope="module")
def layers(tiny_target_dir) -> list[int]:
    return default_capture_layers(read_target_info(tiny_target_dir).num_hidden_layers)


@pytest.fixture(scope="module")
def reference(merged, tiny_target_dir, tmp_path_factory) -> Path:
    """The hf backend's files, each record alone (what a server computes per request)."""
    workdir = copy_merged(merged, tmp_path_factory.mktemp("hf") / "w")
    assert main_02b()(["--workdir", str(workdir), "--target", str(tiny_target_dir),
                       "--backend", "hf", "--max-batch-size", "1"]) == 0
    return workdir


@pytest.fixture
def server(target_model, layers, tmp_path):
    with FakeDumpServer(target_model, tmp_path / "dump", layers, faults=Faults()) as s:
        yield s


def rid(merged: Path, line: int) -> str:
    return make_rid("eagle3-", list(read_jsonl(merged / "01c_merged/train.jsonl"))[line]["id"], 0)


def library_run(workdir: Path, target: Path, server: FakeDumpServer, layers,
                max_attempts: int = 2) -> dict:
    """The train split through the client with short deadlines; returns its outputs."""
    cfg = ExtractConfig(target=target, dump_dir=server.dump_config.dump_dir,
                        server_url=server.url, concurrency=3, dump_wait_s=0.3,
                        max_attempts=max_attempts)
    tuning = ClientTuning(poll_s=0.1, retry=RetryPolicy(max_retries=1, base_delay_s=0.02,
                                                        timeout_s=1.0))
    writer = SplitWriter(workdir / STAGE / "train",
                         list(read_jsonl(workdir / "01c_merged/train.jsonl")))
    expected = Expected(read_target_info(target).hidden_size, tuple(layers), target)
    outputs, _ = asyncio.run(extract_sglang(cfg, expected, {"train": writer}, tuning=tuning))
    return outputs["train"]


def assert_good_files(workdir: Path, reference: Path, missing: set[int] = frozenset()) -> None:
    """The files written equal the reference's byte for byte, their index lines carry the
    sha256 of those bytes, and only `missing` lines have none."""
    got = {int(p.stem.split("_")[1]): p for p in (workdir / STAGE / "train").rglob("data_*.pt")}
    assert set(got) == set(range(N_TRAIN)) - missing
    for idx, path in got.items():
        assert path.read_bytes() == (reference / STAGE / path.relative_to(workdir / STAGE)
                                     ).read_bytes(), idx
    index = list(read_jsonl(workdir / STAGE / "train/index.jsonl"))
    assert [e["idx"] for e in index] == sorted(got)
    assert all(e["sha256"] == file_sha256(got[e["idx"]]) for e in index)


@pytest.mark.parametrize("fault", list(PERSISTENT))
def test_extract_sglang_lists_record_as_failed_after_bounded_retries_when_fault_persists(
        merged, reference, tiny_target_dir, server, layers, tmp_path, fault, caplog):
    getattr(server.faults, fault)[rid(merged, BAD)] = 99
    server.faults.hang_s = 30.0  # far past the client's 1 s deadline
    workdir = copy_merged(merged, tmp_path / "w")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        out = library_run(workdir, tiny_target_dir, server, layers)
    assert time.monotonic() - t0 < 20  # deadlines, not a hang
    assert out["failed"] == 1 and out["written"] == N_TRAIN - 1
    (line,) = read_jsonl(workdir / STAGE / "train/failures.jsonl")
    assert line["idx"] == BAD and line["attempts"] == 2 and PERSISTENT[fault] in line["reason"]
    # Bounded: 2 attempts, each at most 2 HTTP tries (max_retries=1), with a new rid each.
    calls = [r for r in server.generate_calls if r.startswith(rid(merged, BAD))]
    assert 2 <= len(calls) <= 4 and len(set(calls)) == 2
    assert_good_files(workdir, reference, missing={BAD})
    assert list(server.dump_config.dump_dir.iterdir()) == []  # no dump left behind


def test_extract_sglang_writes_the_reference_files_when_each_fault_happens_once(
        merged, reference, tiny_target_dir, server, layers, tmp_path):
    for line, fault in enumerate(PERSISTENT):  # one fault kind per record, once
        getattr(server.faults, fault)[rid(merged, line)] = 1
    server.faults.hang_s = 30.0
    workdir = copy_merged(merged, tmp_path / "w")
    out = library_run(workdir, tiny_target_dir, server, layers, max_attempts=3)
    assert out["failed"] == 0 and out["written"] == N_TRAIN
    assert_good_files(workdir, reference)
    assert not (workdir / STAGE / "train/failures.jsonl").exists()


def test_extract_sglang_skips_record_naming_layer_and_count_when_states_hold_nan(
        merged, reference, tiny_target_dir, server, layers, tmp_path):
    server.faults.nan_states[rid(merged, BAD)] = 5
    workdir = copy_merged(merged, tmp_path / "w")
    out = library_run(workdir, tiny_target_dir, server, layers)
    assert out["failed"] == 0 and out["skipped_bad"] == 1
    (line,) = read_jsonl(workdir / STAGE / "skipped.jsonl")
    record_id = list(read_jsonl(merged / "01c_merged/train.jsonl"))[BAD]["id"]
    assert line["id"] == f"train:{record_id}"
    assert line["reason"] == (f"non-finite states: record {record_id}: capture layer "
                              f"{layers[1]} has 5 NaN/Inf values of {48 * 64:,} (a bf16 "
                              "overflow in the target?)")
    assert [r for r in server.generate_calls if "+retry" in r] == []  # not requested again
    assert_good_files(workdir, reference, missing={BAD})
    # A resumed run does not send it again: the skip list is the record's verdict.
    calls = len(server.generate_calls)
    out = library_run(workdir, tiny_target_dir, server, layers)
    assert len(server.generate_calls) == calls and out["skipped_bad"] == 1


def test_main_stops_on_sigterm_with_resume_line_and_rerun_completes_the_stage(
        merged, reference, tiny_target_dir, server, tmp_path, monkeypatch, capsys):
    workdir = copy_merged(merged, tmp_path / "w")
    argv = ["--workdir", str(workdir), "--target", str(tiny_target_dir), "--server-url",
            server.url, "--dump-dir", str(server.dump_config.dump_dir), "--concurrency", "2"]
    real = SplitWriter.mark_written

    def mark_then_signal(self, idx, *a, **kw):
        real(self, idx, *a, **kw)
        if len(self.done) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill <pid>` or a scheduler would

    monkeypatch.setattr(SplitWriter, "mark_written", mark_then_signal)
    assert script_main(lambda: main_02b()(argv), "02b") == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "re-run the same command to resume" in err
    written = len(data_files(workdir))
    assert 2 <= written < N_TRAIN + 1 and not (workdir / STAGE / "manifest.json").exists()
    index = list(read_jsonl(workdir / STAGE / "train/index.jsonl"))
    assert len(index) == len([p for p in data_files(workdir) if p.parts[0] == "train"])
    monkeypatch.setattr(SplitWriter, "mark_written", real)
    assert main_02b()(argv) == 0
    assert_same_outputs(workdir, reference)
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert manifest["skipped"] == 0 and manifest["outputs"]["train"]["failed"] == 0


def test_extract_sglang_stops_with_disk_error_when_disk_fills_and_rerun_completes(
        merged, reference, tiny_target_dir, server, layers, tmp_path, monkeypatch):
    with small_disk(tmp_path / "disk", kib=1024) as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (not root)")
        workdir = copy_merged(merged, disk / "w")
        real = SplitWriter.mark_written

        def fill_after_two(self, idx, *a, **kw):
            real(self, idx, *a, **kw)
            if len(self.done) == 2 and not (disk / "ballast").exists():
                fill_disk(disk, leave=8_000)

        monkeypatch.setattr(SplitWriter, "mark_written", fill_after_two)
        with pytest.raises(DiskError, match=f"no space left in {disk / 'w' / STAGE / 'train'}"):
            library_run(workdir, tiny_target_dir, server, layers)
        assert not [p for p in (workdir / STAGE).rglob(".*tmp")]
        (disk / "ballast").unlink()
        monkeypatch.setattr(SplitWriter, "mark_written", real)
        assert library_run(workdir, tiny_target_dir, server, layers)["failed"] == 0
        assert_good_files(workdir, reference)
        assert list(server.dump_config.dump_dir.iterdir()) == []


# ---------------------------------------------------------------- a server that lies


def _lie(kind: str, merged: Path) -> tuple[Faults, str]:
    """(Faults, the words of the record's failure reasons) of one lie about record BAD."""
    bad = rid(merged, BAD)
    records = list(read_jsonl(merged / "01c_merged/train.jsonl"))
    return {
        # record 5's first 48 tokens under record 4's rid: right length, prompt_tokens and
        # shapes, the wrong states
        "another prompt": (Faults(foreign_prompt={bad: records[BAD + 1]["input_ids"][:48]}),
                           "ids differ"),
        "integer states": (Faults(int_states={bad}), "torch.int16"),
        "another request's answer": (Faults(answer_id={bad}), "another request"),
        "a directory": (Faults(dump_entry={bad: "directory"}), "is a directory"),
        "a FIFO": (Faults(dump_entry={bad: "fifo"}), "not a regular file"),
        "a bloated file": (Faults(dump_entry={bad: "bloated"}), "more than a dump of 48 tokens"),
    }[kind]


@pytest.mark.parametrize("kind", ["another prompt", "integer states", "another request's answer",
                                  "a directory", "a FIFO", "a bloated file"])
def test_extract_sglang_never_writes_a_dump_that_lies_as_the_records_file(
        merged, reference, tiny_target_dir, server, layers, tmp_path, kind):
    server.faults, reason = _lie(kind, merged)
    workdir = copy_merged(merged, tmp_path / "w")
    result: dict = {}

    def run():
        try:
            result["out"] = library_run(workdir, tiny_target_dir, server, layers)
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # a reader blocked on the FIFO: give it a writer, then fail
        for fifo in server.dump_config.dump_dir.iterdir():
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the client hung on what sat at the dump's path")
    assert "error" not in result, result.get("error")
    assert result["out"]["failed"] == 1
    assert_good_files(workdir, reference, missing={BAD})
    (line,) = read_jsonl(workdir / STAGE / "train/failures.jsonl")
    assert line["idx"] == BAD and len(line["reasons"]) == 2
    assert all(reason in r for r in line["reasons"]), line["reasons"]


def run_script(workdir: Path, target: Path, server: FakeDumpServer, capsys, *extra: str,
               dump_dir: Path | None = None) -> tuple[int, str]:
    """02b through its entry point: (exit code, its error lines); never a traceback."""
    argv = ["--workdir", str(workdir), "--target", str(target), "--server-url", server.url,
            "--dump-dir", str(dump_dir or server.dump_config.dump_dir), "--dump-wait-s", "0.3",
            "--splits", "train", *extra]
    capsys.readouterr()
    rc = script_main(lambda: main_02b()(argv), "02b")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, "\n".join(line for line in err.splitlines() if line.startswith("02b: "))


def test_main_ends_in_one_line_when_server_info_is_a_web_page(
        merged, tiny_target_dir, server, tmp_path, capsys):
    server.faults.server_info_html = True
    rc, line = run_script(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server, capsys)
    assert rc == 1 and line.startswith("02b: error: ") and "\n" not in line
    assert f"{server.url}/server_info" in line and "HTML page" in line
    assert server.generate_calls == []


def test_main_ends_in_one_line_naming_the_restart_when_dumps_are_of_an_older_format(
        merged, tiny_target_dir, server, tmp_path, capsys):
    server.faults.old_format = True
    rc, line = run_script(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server, capsys)
    assert rc == 1 and "\n" not in line
    assert "v1 file" in line and "Restart the dump server" in line
    assert len(server.generate_calls) == 1


def test_main_ends_in_one_line_naming_the_layout_when_server_dumps_fp8_for_dtype_bf16(
        merged, tiny_target_dir, target_model, layers, tmp_path, capsys):
    with FakeDumpServer(target_model, tmp_path / "dump", layers, dump_layout="fp8") as server:
        rc, line = run_script(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server,
                              capsys)
    assert rc == 1 and "\n" not in line
    assert "EAGLE3_DUMP_LAYOUT=fp8" in line and "--dtype fp8" in line
    assert len(server.generate_calls) == 1


@pytest.mark.parametrize("case,words", [("no dump dir", "does not exist"),
                                        ("other layers", "the server captured layers"),
                                        ("verify fails", "differ from the transformers forward")])
def test_main_ends_in_one_line_when_extraction_cannot_go_on(
        merged, tiny_target_dir, target_model, layers, tmp_path, capsys, case, words):
    kw, extra, dump_dir = {}, (), None
    if case == "no dump dir":
        dump_dir = tmp_path / "no-such-dir"
    elif case == "other layers":  # announces and dumps other captures than the target's
        layers = [1, 2, 3]
    else:  # announces the right layers, captures the next ones
        kw, extra = {"state_layers": [c + 1 for c in layers]}, ("--verify-against-hf", "2")
    with FakeDumpServer(target_model, tmp_path / "dump", layers, **kw) as s:
        rc, line = run_script(copy_merged(merged, tmp_path / "w"), tiny_target_dir, s, capsys,
                              *extra, dump_dir=dump_dir)
    assert rc == 1 and line.startswith("02b: error: ") and words in line


def test_files_that_fail_verify_against_hf_are_removed_and_a_rerun_writes_them_right(
        merged, reference, tiny_target_dir, target_model, layers, tmp_path, capsys):
    workdir = copy_merged(merged, tmp_path / "w")
    shifted = [c + 1 for c in layers]  # announces the right layers, captures the next ones
    with FakeDumpServer(target_model, tmp_path / "dump", layers, state_layers=shifted) as s:
        rc, line = run_script(workdir, tiny_target_dir, s, capsys, "--verify-against-hf", "2")
    assert rc == 1 and "differ from the transformers forward" in line
    assert "Removed the 2 files that failed" in line
    assert data_files(workdir) == []  # never left as good files
    with FakeDumpServer(target_model, tmp_path / "dump", layers) as s:
        rc, line = run_script(workdir, tiny_target_dir, s, capsys, "--verify-against-hf", "2")
    assert rc == 0, line
    assert_good_files(workdir, reference)


def test_request_timeout_flag_bounds_the_wait_for_an_answer_that_never_comes(
        merged, reference, tiny_target_dir, server, tmp_path, capsys):
    server.faults.hang[rid(merged, BAD)] = 1  # its first request is never answered
    server.faults.hang_s = 60.0
    workdir = copy_merged(merged, tmp_path / "w")
    t0 = time.monotonic()
    rc, line = run_script(workdir, tiny_target_dir, server, capsys, "--request-timeout-s", "0.5")
    assert rc == 0, line
    assert time.monotonic() - t0 < 30  # the 0.5 s deadline, not the 60 s hang
    assert_good_files(workdir, reference)


def test_a_run_that_fails_verify_against_hf_leaves_nothing_a_clean_run_would_not_write(
        merged, reference, tiny_target_dir, target_model, layers, tmp_path, capsys):
    workdir = copy_merged(merged, tmp_path / "w")
    shifted = [c + 1 for c in layers]  # announces the right layers, captures the next ones
    with FakeDumpServer(target_model, tmp_path / "dump", layers, state_layers=shifted) as s:
        rc, line = run_script(workdir, tiny_target_dir, s, capsys, "--verify-against-hf", "2",
                              "--splits", "train", "eval")
    assert rc == 1 and "differ from the transformers forward" in line
    # Every file left is the clean run's; every index line names a file that is there, with
    # the clean run's line; a split never reached has no index.
    for path in sorted(p for p in (workdir / STAGE).rglob("*") if p.is_file()):
        rel = path.relative_to(workdir / STAGE)
        if path.name == INDEX_FILE:
            clean = (reference / STAGE / rel).read_text().splitlines()
            for entry in read_jsonl(path):
                assert json.dumps(entry, ensure_ascii=False) in clean, (rel, entry)
                assert file_path(path.parent, entry["idx"]).exists(), (rel, entry)
        else:
            assert path.name.startswith("data_"), rel
            assert path.read_bytes() == (reference / STAGE / rel).read_bytes(), rel
    assert not (workdir / STAGE / "eval" / INDEX_FILE).exists()


def test_files_written_before_a_verifier_that_cannot_finish_are_removed(
        merged, tiny_target_dir, server, layers, tmp_path):
    workdir = copy_merged(merged, tmp_path / "w")
    cfg = ExtractConfig(target=tiny_target_dir, dump_dir=server.dump_config.dump_dir,
                        server_url=server.url, concurrency=3, dump_wait_s=0.3,
                        verify_against_hf=2)
    tuning = ClientTuning(poll_s=0.1, retry=RetryPolicy(max_retries=1, base_delay_s=0.02,
                                                        timeout_s=5.0))
    writer = SplitWriter(workdir / STAGE / "train",
                         list(read_jsonl(workdir / "01c_merged/train.jsonl")))
    expected = Expected(read_target_info(tiny_target_dir).hidden_size, tuple(layers),
                        tiny_target_dir)

    def verifier_that_fails(writer, idxs):  # an out-of-memory, a bug: nothing verified
        raise RuntimeError("the verifier broke")

    with pytest.raises(RuntimeError, match="the verifier broke"):
        asyncio.run(extract_sglang(cfg, expected, {"train": writer}, verifier_that_fails,
                                   tuning=tuning))
    assert data_files(workdir) == []  # written unverified: not kept as good
    assert list(read_jsonl(workdir / STAGE / "train" / INDEX_FILE)) == []


def run_within(limit_s: float, workdir: Path, target: Path, url: str, dump_dir: Path, capsys,
               *extra: str) -> tuple[int, str, float]:
    """02b through its entry point in a thread given `limit_s`: (exit code, its error lines,
    seconds); a run still going at the limit fails the test (left to end on its own)."""
    argv = ["--workdir", str(workdir), "--target", str(target), "--server-url", url,
            "--dump-dir", str(dump_dir), "--dump-wait-s", "0.3", "--splits", "train",
            "--server-wait-s", "5", *extra]
    capsys.readouterr()
    result: dict = {}

    def run():
        result["rc"] = script_main(lambda: main_02b()(argv), "02b")

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    seconds = time.monotonic() - t0
    if thread.is_alive():
        pytest.fail(f"02b still running after {limit_s:.0f}s")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return result["rc"], "\n".join(x for x in err.splitlines() if x.startswith("02b: ")), seconds


def retry_bound_s(timeout_s: float) -> float:
    """The longest one request's retries may take (02b's default per-request policy: each
    attempt's deadline, each backoff at its largest jitter), plus 30 s for a busy machine."""
    policy = ClientTuning().resolved(ExtractConfig(target=Path("t"), dump_dir=Path("d"),
                                                   request_timeout_s=timeout_s)).retry
    backoffs = sum(min(policy.max_delay_s, policy.base_delay_s * 2 ** (a - 1)) * 1.5
                   for a in range(1, policy.max_retries + 1))
    return (policy.max_retries + 1) * policy.timeout_s + backoffs + 30.0


def test_a_server_answering_empty_bodies_stops_02b_after_one_requests_retries_in_one_line(
        merged, tiny_target_dir, server, tmp_path, capsys):
    server.faults.empty_answer = True
    limit = retry_bound_s(600.0) - 6 * 600.0  # empty answers come at once: no deadline waited
    rc, line, _ = run_within(limit, copy_merged(merged, tmp_path / "w"), tiny_target_dir,
                             server.url, server.dump_config.dump_dir, capsys)
    assert rc == 1 and line.startswith("02b: error: ") and "\n" not in line
    assert server.url in line and "empty body" in line and "does not answer the API" in line
    assert len(server.generate_calls) == 6  # the first request's 6 attempts, nothing more


@pytest.mark.parametrize("holds", ["every /generate", "every connection"])
def test_a_server_that_never_answers_ends_02b_within_the_request_timeout_and_its_retries(
        merged, tiny_target_dir, server, tmp_path, capsys, holds):
    timeout_s = 0.2
    workdir = copy_merged(merged, tmp_path / "w")
    if holds == "every /generate":
        server.faults.hang = {rid(merged, i): 99 for i in range(N_TRAIN)}
        server.faults.hang_s = 3600.0
        rc, line, seconds = run_within(retry_bound_s(timeout_s), workdir, tiny_target_dir,
                                       server.url, server.dump_config.dump_dir, capsys,
                                       "--request-timeout-s", str(timeout_s))
        assert "accepts requests but answers none" in line and "--request-timeout-s" in line
        assert 1 <= len(server.generate_calls) <= 6  # one request's attempts
    else:
        with silent_server() as url:
            rc, line, seconds = run_within(retry_bound_s(timeout_s), workdir, tiny_target_dir,
                                           url, server.dump_config.dump_dir, capsys,
                                           "--request-timeout-s", str(timeout_s))
        assert url in line and "cannot read its flags" in line
    assert rc == 1 and line.startswith("02b: error: ") and "\n" not in line
    assert data_files(workdir) == []
