"""Stage 01b against servers speaking SGLang's `/generate`: exact tokens, faults, resume, signals.

The fake server (eagle3.testing.fake_sglang) answers a pure function of the prompt ids, so every
record is compared with an independent reference: the prompt rendered by the tokenizer's own
`apply_chat_template` followed by `fake_output(prompt)`.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from generate_helpers import (
    MAX_NEW,
    RUN_COUNTS,
    main_01b,
    sglang_argv,
    spawn_01b,
    wait_for_lines,
)
from stage_helpers import assert_same_folder

from eagle3.core.chat import split_for_generation
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy, ServerPool, TransientError
from eagle3.generate.backends import RecordFailure, SGLangBackend
from eagle3.generate.jobs import GenerationJob
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang, Faults, fake_output

MAX_SEQ = 4096


@pytest.fixture(scope="module")
def eos_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _expected(conv: dict, tokenizer, eos_id: int) -> tuple[list[int], list[int], str]:
    """(input_ids, loss_mask, finish_reason) a record must hold, computed independently."""
    prompt_msgs, _ = split_for_generation(conv["messages"])
    prompt = tokenizer.apply_chat_template(prompt_msgs, tools=conv.get("tools"),
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True, thinking=True)["input_ids"]
    out, reason = fake_output(prompt, min(MAX_NEW, MAX_SEQ - len(prompt)), eos_id)
    return prompt + out, [0] * len(prompt) + [1] * len(out), reason


def _records(workdir: Path, name: str = "ds") -> list[dict]:
    path = workdir / "01b_generated" / name / "tokenized.jsonl"
    return list(read_jsonl(path)) if path.exists() else []


def _as_set(records: list[dict]) -> set:
    return {(r["id"], tuple(r["input_ids"]), tuple(r["loss_mask"]), r["finish_reason"])
            for r in records}


# ---------------------------------------------------------------- the sglang backend alone


def _backend(eos_id: int) -> SGLangBackend:
    return SGLangBackend(ServerPool(["http://127.0.0.1:9"]), eos_id, RetryPolicy(0.5, 3600.0))


def _answer(job, output, finish, prompt_tokens=None, completion_tokens=None):
    meta = {"prompt_tokens": len(job.prompt_ids) if prompt_tokens is None else prompt_tokens,
            "completion_tokens": len(output) if completion_tokens is None
            else completion_tokens, "finish_reason": finish}
    return {"text": "", "output_ids": output, "meta_info": meta}


def test_sglang_record_keeps_exact_output_ids_when_stopped_by_eos():
    job = GenerationJob("a", "s", [1, 2, 3], 8)
    rec, raw = _backend(7).to_record(job, _answer(job, [11, 12, 7], {"type": "stop",
                                                                     "matched": 7}))
    assert rec["input_ids"] == [1, 2, 3, 11, 12, 7]
    assert rec["loss_mask"] == [0, 0, 0, 1, 1, 1]
    assert (rec["n_prompt_tokens"], rec["n_response_tokens"]) == (3, 3)
    assert rec["finish_reason"] == "stop" and raw["output_ids"] == [11, 12, 7]


def test_sglang_record_appends_matched_stop_token_when_output_ids_lack_it():
    backend = _backend(7)
    job = GenerationJob("a", "s", [1, 2], 8)
    rec, _ = backend.to_record(job, _answer(job, [11, 12], {"type": "stop", "matched": 7},
                                            completion_tokens=2))
    assert rec["input_ids"] == [1, 2, 11, 12, 7] and backend.stats["appended_stop_token"] == 1


def test_sglang_record_fails_when_server_truncated_the_prompt():
    job = GenerationJob("a", "s", [1, 2, 3], 8)
    with pytest.raises(RecordFailure, match="prompt truncated"):
        _backend(7).to_record(job, _answer(job, [5], {"type": "length"}, prompt_tokens=2))


def test_sglang_record_is_retried_when_generation_was_aborted():
    job = GenerationJob("a", "s", [1], 8)
    with pytest.raises(TransientError, match="aborted"):
        _backend(7).to_record(job, _answer(job, [], {"type": "abort", "message": "oom"}))


def test_sglang_payload_is_greedy_with_record_id_and_fresh_rid_on_retry():
    job = GenerationJob("ds/1", "s", [1, 2], 5)
    first, retry = _backend(7).payload(job, 0), _backend(7).payload(job, 2)
    assert first["rid"] == "ds/1" and retry["rid"] == "ds/1~retry2"
    assert first["input_ids"] == [1, 2]
    assert first["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0,
                                        "stop_token_ids": [7]}


# ---------------------------------------------------------------- end to end under faults


def test_generate_completes_every_record_once_or_fails_it_when_server_faults(
        tmp_path, tiny_target_dir, tokenizer, eos_id):
    convs = synthetic_conversations(240, "ds")
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    fail_ids, truncate_ids = {"ds/00005", "ds/00077"}, {"ds/00006"}
    faults = Faults(error_rate=0.05, drop_rate=0.03, hang_rate=0.02, hang_s=30.0,
                    slow_rate=0.05, slow_s=0.3, abort_rate=0.02, delay_s=(0.0, 0.02),
                    fail_ids=frozenset(fail_ids), truncate_ids=frozenset(truncate_ids), seed=1)
    with FakeSGLang(faults, eos_id=eos_id) as server:
        restarted = threading.Event()

        def restart_mid_run():  # the server goes away with requests in flight, then returns
            while len(server.requests) < 80:
                time.sleep(0.01)
            server.stop()
            time.sleep(0.6)
            server.start()
            restarted.set()

        threading.Thread(target=restart_mid_run, daemon=True).start()
        rc = main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url, "--concurrency", "24",
                         "--request-timeout-s", "0.4", "--max-failure-fraction", "0.05"))
    assert rc == 0 and restarted.is_set()
    # every fault was drawn (a request hanging at shutdown never finishes, so count draws)
    assert {"ok", "error", "drop", "hang", "slow", "abort", "fail_id"} <= set(server.drawn)
    records = _records(tmp_path)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))  # exactly once
    failures = {f["id"]: f for f in read_jsonl(tmp_path / "01b_generated/ds/failures.jsonl")}
    assert set(failures) == fail_ids | truncate_ids
    assert set(ids) | set(failures) == {c["id"] for c in convs} and not set(ids) & set(failures)
    for rid in fail_ids:
        assert "HTTP 500" in failures[rid]["reason"] and failures[rid]["attempts"] == 6
    assert "prompt truncated" in failures["ds/00006"]["reason"]
    by_id = {c["id"]: c for c in convs}
    for r in records:
        ids_, mask, reason = _expected(by_id[r["id"]], tokenizer, eos_id)
        assert (r["input_ids"], r["loss_mask"], r["finish_reason"]) == (ids_, mask, reason)
    manifest = json.loads((tmp_path / "01b_generated/manifest.json").read_text())
    assert manifest["complete"] and manifest["outputs"]["datasets"]["ds"]["failed"] == 3


def test_generate_marks_stage_incomplete_when_failures_exceed_the_allowed_share(
        tmp_path, tiny_target_dir, eos_id):
    convs = synthetic_conversations(20, "ds")
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    bad = frozenset(c["id"] for c in convs[:3])
    with FakeSGLang(Faults(fail_ids=bad), eos_id=eos_id) as server:
        argv = sglang_argv(tmp_path, tiny_target_dir, server.url, "--max-attempts", "2")
        assert main_01b(argv) == 1
        assert not (tmp_path / "01b_generated/manifest.json").exists()
        server.faults.fail_ids = frozenset()  # the cause is fixed: a re-run completes
        n_before = len(server.requests)
        assert main_01b(argv) == 0
        resent = [r["rid"] for r in server.requests[n_before:] if r["path"] == "/generate"]
    assert sorted(resent) == sorted(bad)  # only the failed records are generated again
    assert len(_records(tmp_path)) == 20


def test_long_context_jobs_run_after_short_ones_at_lower_concurrency(
        tmp_path, tiny_target_dir, eos_id):
    convs = synthetic_conversations(60, "ds", long_every=6, long_words=300)
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    with FakeSGLang(Faults(delay_s=(0.02, 0.05)), eos_id=eos_id) as server:
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url, "--concurrency", "8",
                           "--long-concurrency", "2", "--long-context-threshold", "400")) == 0
    gen = [r for r in server.requests if r["path"] == "/generate"]
    long = [r for r in gen if r["prompt_len"] + r["max_new_tokens"] > 400]
    short = [r for r in gen if r["prompt_len"] + r["max_new_tokens"] <= 400]
    assert len(long) == 10 and len(short) == 50
    assert min(r["start"] for r in long) >= max(r["end"] for r in short)
    assert max(r["inflight_at_start"] for r in long) <= 2
    assert max(r["inflight_at_start"] for r in short) == 8  # the cap is reached, not exceeded


def test_pool_spreads_requests_over_servers_and_survives_one_going_down(
        tmp_path, tiny_target_dir, tokenizer, eos_id):
    convs = synthetic_conversations(120, "ds")
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    with FakeSGLang(Faults(delay_s=(0.01, 0.03)), eos_id=eos_id) as a, \
            FakeSGLang(Faults(delay_s=(0.01, 0.03)), eos_id=eos_id) as b:

        def kill_b():
            while len(b.requests) < 20:
                time.sleep(0.005)
            b.stop()  # never comes back: the rest must go to a

        threading.Thread(target=kill_b, daemon=True).start()
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, [a.url, b.url],
                                    "--concurrency", "8")) == 0
    ok = lambda s: sum(r.get("kind") == "ok" for r in s.requests)  # noqa: E731
    assert ok(a) > 20 and ok(b) >= 20
    records = _records(tmp_path)
    assert {r["id"] for r in records} == {c["id"] for c in convs} and len(records) == 120


# ---------------------------------------------------------------- resume and signals


def test_resumed_folder_equals_uninterrupted_run_when_killed_at_random_moments(
        tmp_path, tiny_target_dir, eos_id):
    """Answers complete out of order (random delays, 16 in flight); four SIGKILLs at random
    numbers of written records and a torn last line, then a full run: the whole stage folder
    equals an uninterrupted run's, byte for byte (records in conversation order), but for the
    manifest's timestamps and the per-run counts above."""
    convs = synthetic_conversations(400, "ds", long_every=40, long_words=200)
    faults = Faults(delay_s=(0.02, 0.08), seed=3)  # no errors: a retry's rid is in meta_info
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    for d in (ref_dir, run_dir):
        write_prepared_stage(d, {"ds": convs}, max_seq_len=MAX_SEQ)
    rng = random.Random(0)
    out = run_dir / "01b_generated/ds/tokenized.jsonl"
    with FakeSGLang(faults, eos_id=eos_id) as server:
        assert main_01b(sglang_argv(ref_dir, tiny_target_dir, server.url,
                                    "--concurrency", "16")) == 0
        kills, reached = 0, 0
        for _ in range(4):  # SIGKILL at a random number of written records
            proc = spawn_01b(run_dir, tiny_target_dir, server.url)
            reached += rng.randint(20, 70)
            wait_for_lines(out, reached, proc)
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is None:
                proc.kill()
                kills += 1
            proc.communicate()
        torn = out.read_bytes()
        out.write_bytes(torn + b'{"id": "ds/torn", "input_ids": [1, 2')  # a torn last line
        proc = spawn_01b(run_dir, tiny_target_dir, server.url)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
    assert kills >= 3
    ref = _records(ref_dir)
    assert [r["id"] for r in ref] == [c["id"] for c in convs]  # conversation order
    assert_same_folder(run_dir / "01b_generated", run_dir, ref_dir / "01b_generated", ref_dir,
                       run_counts=RUN_COUNTS, count_files=("done.json",))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_lets_inflight_requests_finish_then_exits_and_resume_completes(
        tmp_path, tiny_target_dir, eos_id, sig):
    convs = synthetic_conversations(200, "ds")
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    out = tmp_path / "01b_generated/ds/tokenized.jsonl"
    with FakeSGLang(Faults(delay_s=(0.2, 0.3)), eos_id=eos_id) as server:
        proc = spawn_01b(tmp_path, tiny_target_dir, server.url)
        wait_for_lines(out, 20, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err.decode()[-2000:]
        sent = {r["rid"] for r in server.requests if r["path"] == "/generate"}
        written = {r["id"] for r in _records(tmp_path)}
        assert written == sent and len(written) < 200  # every request in flight was kept
        assert not (tmp_path / "01b_generated/manifest.json").exists()
        n_before = len(server.requests)
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url)) == 0
        again = {r["rid"] for r in server.requests[n_before:] if r["path"] == "/generate"}
    assert not again & written  # resume by id: nothing generated twice
    assert len(_records(tmp_path)) == 200


def test_length_cut_replies_are_dropped_and_not_regenerated_when_keep_length_is_off(
        tmp_path, tiny_target_dir, tokenizer, eos_id):
    convs = synthetic_conversations(60, "ds")
    write_prepared_stage(tmp_path, {"ds": convs}, max_seq_len=MAX_SEQ)
    with FakeSGLang(eos_id=eos_id) as server:
        argv = sglang_argv(tmp_path, tiny_target_dir, server.url, "--no-keep-length")
        assert main_01b(argv) == 0
        expected = {c["id"]: _expected(c, tokenizer, eos_id)[2] for c in convs}
        kept = {r["id"] for r in _records(tmp_path)}
        assert kept == {i for i, reason in expected.items() if reason == "stop"}
        assert 0 < len(kept) < 60
        (tmp_path / "01b_generated/manifest.json").unlink()  # as if killed before the end
        n_before = len(server.requests)
        assert main_01b(argv) == 0
        assert len(server.requests) == n_before  # dropped replies count as done
    raw = list(read_jsonl(tmp_path / "01b_generated/ds/raw.jsonl"))
    assert {r["id"] for r in raw if not r["kept"]} == set(expected) - kept


def test_line_ids_reads_escaped_ids_and_ignores_a_torn_tail(tmp_path):
    from eagle3.core.records import JsonlAppender
    from eagle3.generate.jobs import line_ids

    ids = ['ds/"quoted"', "ds/naïve\\path", "ds/plain"]
    with JsonlAppender(tmp_path / "x.jsonl") as f:
        for k, i in enumerate(ids):
            f.write({"id": i, "kept": k != 1})
    (tmp_path / "x.jsonl").open("ab").write(b'{"id": "ds/torn", "ke')
    assert line_ids(tmp_path / "x.jsonl") == set(ids)
    assert line_ids(tmp_path / "x.jsonl", b'"kept": false}') == {"ds/naïve\\path"}
    assert line_ids(tmp_path / "missing.jsonl") == set()


def test_second_signal_abandons_inflight_requests_and_asks_server_to_abort_them(
        tmp_path, tiny_target_dir, eos_id):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(50, "ds")}, max_seq_len=MAX_SEQ)
    with FakeSGLang(Faults(slow_rate=1.0, slow_s=30.0), eos_id=eos_id) as server:
        proc = spawn_01b(tmp_path, tiny_target_dir, server.url)
        deadline = time.monotonic() + 60
        while server.inflight < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        waited = time.monotonic() - t0
        aborted = {r["rid"] for r in server.requests if r["path"] == "/abort_request"}
    assert proc.returncode == 130, err.decode()[-2000:]
    assert waited < 15  # not the 30 s the requests in flight would take
    assert len(aborted) == 16 and all(rid.startswith("ds/") for rid in aborted)
    assert _records(tmp_path) == []


def test_generate_stops_cleanly_when_every_server_stays_down(tmp_path, tiny_target_dir, eos_id):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(200, "ds")}, max_seq_len=MAX_SEQ)
    with FakeSGLang(Faults(delay_s=(0.01, 0.02)), eos_id=eos_id) as server:

        def crash():
            while len(server.requests) < 40:
                time.sleep(0.005)
            server.stop()  # and never comes back

        threading.Thread(target=crash, daemon=True).start()
        t0 = time.monotonic()
        rc = main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url, "--concurrency", "8",
                         "--server-down-timeout-s", "1.0"))
    assert rc == 1 and time.monotonic() - t0 < 30
    written = _records(tmp_path)
    assert 40 <= len(written) < 200
    assert not (tmp_path / "01b_generated/ds/failures.jsonl").read_bytes()  # nothing blamed
    assert not (tmp_path / "01b_generated/manifest.json").exists()
