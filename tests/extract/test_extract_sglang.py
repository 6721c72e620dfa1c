"""The 02b SGLang client end to end against a fake dump server that writes through the real dump
module (tests/fake_dump_server.py): its files must equal the hf backend's byte for byte, also
after missing, truncated and short dumps, a server restart, and a SIGKILL of the client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dump_helpers import kill_writer_mid_file
from extract_helpers import (
    STAGE,
    assert_same_outputs,
    build_vocab,
    copy_merged,
    data_files,
    main_02b,
    write_merged,
)
from fake_dump_server import FakeDumpServer, Faults

from eagle3.core.preflight import PreflightError
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy
from eagle3.core.target import default_capture_layers, read_target_info
from eagle3.extract.config import ExtractConfig
from eagle3.extract.sglang import (
    ClientTuning,
    Expected,
    auto_concurrency,
    check_answer,
    extract_sglang,
    make_rid,
)
from eagle3.extract.writer import ExtractError, SplitWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    return write_merged(tmp_path_factory.mktemp("merged") / "w")


@pytest.fixture(scope="module")
def layers(tiny_target_dir) -> list[int]:
    return default_capture_layers(read_target_info(tiny_target_dir).num_hidden_layers)


def _hf_run(merged, target, workdir, dtype) -> Path:
    copy_merged(merged, workdir)
    if dtype == "fp8-topk":
        build_vocab(workdir, target)
    # Each record alone: the forward pass a server computes per request (extract.py docstring).
    rc = main_02b()(["--workdir", str(workdir), "--target", str(target), "--backend", "hf",
                     "--max-batch-size", "1", "--dtype", dtype])
    assert rc == 0
    return workdir


@pytest.fixture(scope="module")
def hf_reference(merged, tiny_target_dir, tmp_path_factory) -> Path:
    return _hf_run(merged, tiny_target_dir, tmp_path_factory.mktemp("hf") / "w", "bf16")


@pytest.fixture
def make_server(target_model, layers, tmp_path):
    servers = []

    def make(**kwargs) -> FakeDumpServer:
        kwargs.setdefault("faults", Faults())
        server = FakeDumpServer(target_model, tmp_path / "dump", kwargs.pop("capture", layers),
                                **kwargs)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def _options(server: FakeDumpServer, poll_s: float, retry: RetryPolicy,
             **kw) -> tuple[ExtractConfig, ClientTuning]:
    """02b's flag defaults (ExtractConfig) with `kw` for a library-level run against `server`,
    and the client's tuning."""
    cfg = ExtractConfig(target=Path("unused"), dump_dir=server.dump_config.dump_dir,
                        server_url=server.url, **kw)
    return cfg, ClientTuning(poll_s=poll_s, retry=retry)


def run_client(workdir: Path, target: Path, server: FakeDumpServer, *extra: str) -> int:
    return main_02b()(["--workdir", str(workdir), "--target", str(target), "--server-url",
                       server.url, "--dump-dir", str(server.dump_config.dump_dir),
                       "--dump-wait-s", "0.3", *extra])


def rid_of(merged: Path, split: str, line: int) -> str:
    record = list(read_jsonl(merged / "01c_merged" / f"{split}.jsonl"))[line]
    return make_rid("eagle3-", record["id"], 0)


def test_extract_sglang_writes_the_hf_backend_files_when_server_batches_and_chunks(
        merged, hf_reference, tiny_target_dir, make_server, tmp_path):
    workdir = copy_merged(merged, tmp_path / "w")
    server = make_server()
    assert run_client(workdir, tiny_target_dir, server) == 0
    assert_same_outputs(workdir, hf_reference)
    # The server really batched several requests per pass and split long prompts in chunks.
    assert max(len(p) for p in server.passes) >= 3
    chunks_per_rid = {}
    for p in server.passes:
        for rid, _, _ in p:
            chunks_per_rid[rid] = chunks_per_rid.get(rid, 0) + 1
    assert max(chunks_per_rid.values()) >= 5  # the 231-token record: 5 chunks of 48
    assert all(rid.startswith("eagle3-") for rid in server.generate_calls)
    assert len(server.generate_calls) == len(data_files(workdir))  # no retries were needed
    assert list(server.dump_config.dump_dir.iterdir()) == []  # every dump was picked up
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert manifest["complete"] and manifest["backend"] == "sglang"
    assert manifest["outputs"]["train"]["written"] == 20 and manifest["server"]["restarts"] == 0


@pytest.mark.parametrize("layout", ["bf16", "fp8"])  # the server's EAGLE3_DUMP_LAYOUT
@pytest.mark.parametrize("dtype", ["fp8", "fp8-all", "fp8-topk"])
def test_extract_sglang_writes_the_hf_backend_files_when_dtype_is_compact(
        merged, tiny_target_dir, make_server, tmp_path, dtype, layout):
    reference = _hf_run(merged, tiny_target_dir, tmp_path / "hf", dtype)
    workdir = copy_merged(merged, tmp_path / "w")
    if dtype == "fp8-topk":  # the client computes the teacher from each dump's final state
        build_vocab(workdir, tiny_target_dir)
    server = make_server(dump_layout=layout)
    assert run_client(workdir, tiny_target_dir, server, "--dtype", dtype,
                      "--verify-against-hf", "2") == 0
    assert_same_outputs(workdir, reference)
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert all(row["final_rel_err"] < 1e-3 for row in manifest["verify_against_hf"])


def test_extract_sglang_writes_identical_files_when_dumps_are_missing_truncated_or_short(
        merged, hf_reference, tiny_target_dir, make_server, tmp_path, caplog):
    faults = Faults(drop_dump_once={rid_of(merged, "train", 3)},
                    truncate_dump_once={rid_of(merged, "train", 5), rid_of(merged, "eval", 1)},
                    mixed_chunk_once={rid_of(merged, "train", 8)})  # 231 tokens, 5 chunks
    server = make_server(faults=faults)
    workdir = copy_merged(merged, tmp_path / "w")
    with caplog.at_level(logging.WARNING):
        assert run_client(workdir, tiny_target_dir, server) == 0
    assert_same_outputs(workdir, hf_reference)
    for kind in ("missing dump", "unreadable dump", "short dump"):
        assert kind in caplog.text, kind
    retries = [rid for rid in server.generate_calls if "+retry" in rid]
    assert len(retries) == 4 and len(server.generate_calls) == 25 + 4
    assert not (faults.drop_dump_once or faults.truncate_dump_once or faults.mixed_chunk_once)


def _library_run(workdir: Path, target: Path, opts: tuple[ExtractConfig, ClientTuning],
                 layers) -> tuple:
    cfg, tuning = opts
    hidden = read_target_info(target).hidden_size
    writers = {s: SplitWriter(workdir / STAGE / s, list(read_jsonl(
        workdir / "01c_merged" / f"{s}.jsonl"))) for s in ("train", "eval")}
    return asyncio.run(extract_sglang(cfg, Expected(hidden, tuple(layers), target), writers,
                                      tuning=tuning))


def test_extract_sglang_writes_identical_files_when_server_restarts_mid_run(
        merged, hf_reference, tiny_target_dir, make_server, layers, tmp_path):
    server = make_server(faults=Faults(pass_delay_s=0.02))
    workdir = copy_merged(merged, tmp_path / "w")

    def restart_after_some_files():
        while len(data_files(workdir)) < 6:
            time.sleep(0.005)
        server.restart(down_s=1.0)  # longer than the client's own HTTP retries below

    thread = threading.Thread(target=restart_after_some_files, daemon=True)
    thread.start()
    opts = _options(server, concurrency=6, poll_s=0.1,
                    retry=RetryPolicy(max_retries=1, base_delay_s=0.05, timeout_s=600.0))
    outputs, extra = _library_run(workdir, tiny_target_dir, opts, layers)
    thread.join(timeout=10)
    assert extra["server"]["restarts"] == 1
    assert sum(o["failed"] for o in outputs.values()) == 0
    assert_same_outputs(workdir, hf_reference)


def test_extract_sglang_writes_identical_files_when_client_is_killed_and_rerun(
        merged, hf_reference, tiny_target_dir, make_server, tmp_path):
    faults = Faults(pass_delay_s=0.05)
    server = make_server(faults=faults)
    workdir = copy_merged(merged, tmp_path / "w")
    cmd = [sys.executable, str(ROOT / "02b_extract_hidden_states_sglang.py"), "--workdir",
           str(workdir), "--target", str(tiny_target_dir), "--server-url", server.url,
           "--dump-dir", str(server.dump_config.dump_dir), "--concurrency", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while len(data_files(workdir)) < 4 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(data_files(workdir))
    assert proc.returncode == -signal.SIGKILL and 4 <= written < 25, proc.stderr.read()[-2000:]
    assert not (workdir / STAGE / "manifest.json").exists()
    faults.pass_delay_s = 0.0
    calls_before = len(server.generate_calls)
    assert run_client(workdir, tiny_target_dir, server) == 0
    assert_same_outputs(workdir, hf_reference)
    assert len(server.generate_calls) - calls_before <= 25 - written  # resumed, not redone
    index = [e["idx"] for e in read_jsonl(workdir / STAGE / "train" / "index.jsonl")]
    assert sorted(index) == list(range(20))  # one line per file, also for unlogged ones
    assert not [p for p in server.dump_config.dump_dir.iterdir()]


def test_extract_sglang_writes_identical_files_when_a_killed_server_left_dumps_and_temp_files(
        merged, hf_reference, tiny_target_dir, make_server, tmp_path):
    # A dump server killed in the middle of a file, after two whole dumps, under the rids this
    # run sends (random states, not the target's): what a crash leaves in the dump directory.
    records = list(read_jsonl(merged / "01c_merged" / "train.jsonl"))[:4]
    prompts = {make_rid("eagle3-", r["id"], 0): len(r["input_ids"]) for r in records}
    pid = kill_writer_mid_file(tmp_path / "dump", prompts)
    left = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert len(left) == 3 and left[0].endswith(f".{pid}.tmp")
    server = make_server()
    workdir = copy_merged(merged, tmp_path / "w")
    assert run_client(workdir, tiny_target_dir, server) == 0
    assert_same_outputs(workdir, hf_reference)
    assert list(server.dump_config.dump_dir.iterdir()) == []  # stale dumps and temp file gone


def test_extract_sglang_lists_record_in_failures_file_when_every_attempt_fails(
        merged, hf_reference, tiny_target_dir, make_server, tmp_path):
    bad = rid_of(merged, "train", 4)
    server = make_server(faults=Faults(always_drop={bad}))
    workdir = copy_merged(merged, tmp_path / "w")
    assert run_client(workdir, tiny_target_dir, server) == 2
    assert not (workdir / STAGE / "manifest.json").exists()  # incomplete: 04 would refuse it
    (failure,) = list(read_jsonl(workdir / STAGE / "train" / "failures.jsonl"))
    assert failure["idx"] == 4 and failure["attempts"] == 3
    assert failure["reason"].startswith("missing dump")
    assert len(data_files(workdir)) == 24
    server.faults.always_drop.clear()  # the re-run retries the failed record only
    calls_before = len(server.generate_calls)
    assert run_client(workdir, tiny_target_dir, server) == 0
    assert server.generate_calls[calls_before:] == [bad]
    assert not (workdir / STAGE / "train" / "failures.jsonl").exists()
    assert_same_outputs(workdir, hf_reference)


def test_extract_sglang_completes_with_failures_when_they_are_accepted(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server(faults=Faults(always_drop={rid_of(merged, "eval", 2)}))
    workdir = copy_merged(merged, tmp_path / "w")
    assert run_client(workdir, tiny_target_dir, server, "--accept-failures") == 0
    manifest = json.loads((workdir / STAGE / "manifest.json").read_text())
    assert manifest["complete"] and manifest["outputs"]["eval"]["failed"] == 1


def test_extract_sglang_stops_at_first_sample_when_aux_width_is_not_three_hidden(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server(capture=[2])  # one capture: aux [T, H], as without EAGLE-3 capture
    workdir = copy_merged(merged, tmp_path / "w")
    with pytest.raises(ExtractError, match=r"64 wide.*3 x 64 = 192"):
        run_client(workdir, tiny_target_dir, server)
    assert len(server.generate_calls) == 1 and data_files(workdir) == []


def test_extract_sglang_stops_when_server_answers_with_cached_tokens(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server(faults=Faults(cached_tokens=16))
    with pytest.raises(ExtractError, match="--disable-radix-cache"):
        run_client(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server)
    assert len(server.generate_calls) == 1


def test_extract_sglang_refuses_before_first_request_when_server_flags_are_wrong(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server(info={"disable_radix_cache": False, "enable_mixed_chunk": True})
    with pytest.raises(PreflightError, match="disable-radix-cache") as e:
        run_client(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server)
    assert "enable-mixed-chunk" in str(e.value)
    assert server.generate_calls == []


def test_extract_sglang_stops_with_checklist_when_first_request_leaves_no_dump(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server(rid_prefix="other-")  # the server dumps other rids only
    with pytest.raises(ExtractError, match="EAGLE3_DUMP_RID_PREFIX") as e:
        run_client(copy_merged(merged, tmp_path / "w"), tiny_target_dir, server)
    assert "eagle3.extract.patching --check" in str(e.value)
    assert len(server.generate_calls) == 3 and len({r.split("+")[0]
                                                    for r in server.generate_calls}) == 1


def test_extract_sglang_refuses_when_dump_dir_is_not_the_servers(
        merged, tiny_target_dir, make_server, tmp_path):
    server = make_server()
    argv = ["--workdir", str(copy_merged(merged, tmp_path / "w")), "--target",
            str(tiny_target_dir), "--server-url", server.url, "--dump-dir", str(tmp_path / "no")]
    with pytest.raises(ExtractError, match="EAGLE3_DUMP_DIR="):
        main_02b()(argv)


def test_verify_against_hf_reports_agreement_when_server_captures_the_right_layers(
        merged, tiny_target_dir, make_server, tmp_path, layers):
    workdir = copy_merged(merged, tmp_path / "w")
    assert run_client(workdir, tiny_target_dir, make_server(), "--verify-against-hf", "4") == 0
    report = json.loads((workdir / STAGE / "manifest.json").read_text())["verify_against_hf"]
    assert [row["idx"] for row in report] == [0, 1, 2, 3]
    for row in report:
        assert row["nearest_layer"] == layers
        assert max(row["aux_rel_err"]) == 0.0 and row["final_rel_err"] == 0.0


def test_verify_against_hf_stops_run_when_server_captures_layers_shifted_by_one(
        merged, tiny_target_dir, make_server, tmp_path, layers):
    shifted = [layer - 1 for layer in layers]  # outputs of layers i instead of inputs
    server = make_server(state_layers=shifted)
    workdir = copy_merged(merged, tmp_path / "w")
    with pytest.raises(ExtractError, match="Nearest layers other than") as e:
        run_client(workdir, tiny_target_dir, server, "--verify-against-hf", "3")
    assert str(shifted) in str(e.value)
    assert len(server.generate_calls) == 3  # stopped before the rest were sent


def test_make_rid_is_injective_when_ids_differ_only_in_escaped_characters():
    ids = ["a/b", "a_b", "a%2Fb", "a b", "a+retry1", "a"]
    rids = [make_rid("eagle3-", i, attempt) for i in ids for attempt in (0, 1)]
    assert len(set(rids)) == len(rids)
    assert make_rid("eagle3-", "sharegpt/x#1", 0) == "eagle3-sharegpt%2Fx%231"
    assert make_rid("eagle3-", "a", 2) == "eagle3-a+retry2"


def test_auto_concurrency_fills_four_prefill_batches_when_server_budget_is_known():
    assert auto_concurrency({"max_prefill_tokens": 16384}, 2048) == 32
    assert auto_concurrency({"max_prefill_tokens": 16384, "chunked_prefill_size": 32768},
                            2048) == 64
    assert auto_concurrency({}, 100000) == 8 and auto_concurrency({}, 1) == 256


def test_check_answer_rejects_answer_when_prompt_was_truncated():
    from eagle3.extract.sglang import SampleError

    check_answer({"meta_info": {"prompt_tokens": 5, "cached_tokens": 0}}, "r", 5)
    with pytest.raises(SampleError, match="prompt_tokens"):
        check_answer({"meta_info": {"prompt_tokens": 4, "cached_tokens": 0}}, "r", 5)
    with pytest.raises(SampleError, match="bad answer.*overloaded"):
        check_answer({"error": "overloaded"}, "r", 5)
    with pytest.raises(ExtractError, match="--disable-radix-cache"):
        check_answer({"meta_info": {"prompt_tokens": 5, "cached_tokens": 3}}, "r", 5)


def test_extract_sglang_stops_with_rerun_advice_when_server_stays_down(
        merged, tiny_target_dir, make_server, layers, tmp_path):
    server = make_server(faults=Faults(pass_delay_s=0.02))
    workdir = copy_merged(merged, tmp_path / "w")

    def crash_after_some_files():
        while len(data_files(workdir)) < 3:
            time.sleep(0.005)
        server.stop()

    threading.Thread(target=crash_after_some_files, daemon=True).start()
    opts = _options(server, concurrency=4, poll_s=0.1, server_wait_s=0.5,
                    retry=RetryPolicy(max_retries=0, base_delay_s=0.5, timeout_s=600.0))
    with pytest.raises(ExtractError, match="did not come back.*re-run"):
        _library_run(workdir, tiny_target_dir, opts, layers)
    assert 3 <= len(data_files(workdir)) < 25


def test_check_dump_dir_refuses_when_dumps_in_flight_do_not_fit(tmp_path, monkeypatch):
    from collections import namedtuple

    from eagle3.extract import writer as extract
    from eagle3.extract.dumps import Expected
    from eagle3.extract.sglang import check_dump_dir

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(extract.shutil, "disk_usage", lambda p: Usage(0, 0, 10 << 30))
    # 32 dumps of 8192 tokens at 8 x 7168 + 8 bytes a token: 15 GB, more than 10 GB free
    expected = Expected(7168, (2, 30, 58), tmp_path)
    with pytest.raises(ExtractError, match="32 dumps in flight.*57,352 B.*--concurrency"):
        check_dump_dir(tmp_path, [8192] * 100, expected, in_flight=32)
    check_dump_dir(tmp_path, [8192] * 100, expected, in_flight=16)  # 7.5 GB (+20%) fits
