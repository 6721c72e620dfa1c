"""Stage 01b's pool (eagle3/generate/runner.py): every regenerated dataset's jobs go through one
pool of requests on a server backend, so that the next dataset's requests run while the last long
replies of the one before finish (a dataset does not wait for another's tail); the concurrency
and the long-context pass hold over the whole pool; each dataset's files are the ones it writes
alone, byte for byte; and a pooled run killed at any moment, or stopped by SIGTERM, resumes to
the folder of an uninterrupted run.

The fake server (eagle3.testing.fake_sglang) logs each request's arrival and answer times
(`start`, `end`) and the requests in flight when it arrived; `slow_ids` makes chosen records'
replies slow: a dataset's tail.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
from generate_helpers import (
    RUN_COUNTS,
    count_lines,
    main_01b,
    sglang_argv,
    spawn_01b,
    wait_for_lines,
)
from stage_helpers import assert_same_folder

import eagle3.generate.stage
from eagle3.core.records import read_jsonl
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang, Faults

STAGE = "01b_generated"


@pytest.fixture(scope="module")
def eos_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _write(workdir: Path, sets: dict[str, list[dict]], kept: tuple = ()) -> None:
    """A complete 01 stage of `sets`; the datasets named in `kept` keep their replies."""
    write_prepared_stage(workdir, sets)
    path = workdir / "01_prepared/manifest.json"
    manifest = json.loads(path.read_text())
    for name in kept:
        manifest["outputs"]["datasets"][name]["regenerate"] = False
    path.write_text(json.dumps(manifest))


def _manifest(workdir: Path) -> dict:
    return json.loads((workdir / STAGE / "manifest.json").read_text())


def _without_run_counts(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in RUN_COUNTS}


def _generate_requests(server: FakeSGLang) -> list[dict]:
    return [r for r in server.requests if r["path"] == "/generate"]


# ---------------------------------------------------------------- one pool, no waiting


def test_pool_sends_the_next_datasets_requests_while_the_tail_of_the_one_before_runs(
        tmp_path, tiny_target_dir, eos_id):
    """The last three replies of `a` take 3 s; `b`'s requests are sent and answered while they
    run (one dataset after another, `b` would start only once `a`'s last reply is in)."""
    sets = {"a": synthetic_conversations(24, "a"), "b": synthetic_conversations(24, "b")}
    _write(tmp_path, sets)
    tail = frozenset(c["id"] for c in sets["a"][-3:])
    with FakeSGLang(Faults(delay_s=(0.005, 0.01), slow_ids=tail, slow_s=3.0),
                    eos_id=eos_id) as server:
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url,
                                    "--concurrency", "8")) == 0
    gen = _generate_requests(server)
    slow = [r for r in gen if r["rid"] in tail]
    of_b = [r for r in gen if r["rid"].startswith("b/")]
    assert len(slow) == 3 and all(r["kind"] == "slow" for r in slow) and len(of_b) == 24
    tail_end = max(r["end"] for r in slow)
    assert min(r["start"] for r in of_b) < min(r["end"] for r in slow)  # b during a's tail
    assert max(r["end"] for r in of_b) < tail_end  # all of b done before a's tail ends
    assert max(r["inflight_at_start"] for r in gen) <= 8  # the concurrency of the whole pool
    outputs = _manifest(tmp_path)["outputs"]
    assert {n: (c["generated"], c["jobs"], c["records"]) for n, c in
            outputs["datasets"].items()} == {"a": (24, 24, 24), "b": (24, 24, 24)}
    assert outputs["pool"]["datasets"] == ["a", "b"] and outputs["pool"]["generated"] == 48
    assert outputs["datasets"]["b"]["seconds"] < outputs["datasets"]["a"]["seconds"]
    assert [r["id"] for r in read_jsonl(tmp_path / STAGE / "a/tokenized.jsonl")] == \
        [c["id"] for c in sets["a"]]  # conversation order, whatever the answers' order


def test_long_context_pass_takes_every_datasets_long_jobs_after_all_short_ones(
        tmp_path, tiny_target_dir, eos_id):
    sets = {"a": synthetic_conversations(30, "a", long_every=6, long_words=300),
            "b": synthetic_conversations(30, "b", long_every=5, long_words=300)}
    _write(tmp_path, sets)
    with FakeSGLang(Faults(delay_s=(0.02, 0.05)), eos_id=eos_id) as server:
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url, "--concurrency", "8",
                                    "--long-concurrency", "2",
                                    "--long-context-threshold", "400")) == 0
    gen = _generate_requests(server)
    long = [r for r in gen if r["prompt_len"] + r["max_new_tokens"] > 400]
    short = [r for r in gen if r["prompt_len"] + r["max_new_tokens"] <= 400]
    assert sorted({r["rid"][0] for r in long}) == ["a", "b"] and len(long) == 11
    assert min(r["start"] for r in long) >= max(r["end"] for r in short)
    assert max(r["inflight_at_start"] for r in long) <= 2
    assert max(r["inflight_at_start"] for r in short) == 8
    ds = _manifest(tmp_path)["outputs"]["datasets"]
    assert {n: (c["short_jobs"], c["long_jobs"]) for n, c in ds.items()} == {
        "a": (25, 5), "b": (24, 6)}


# ---------------------------------------------------------------- what is written


def test_pooled_datasets_write_the_files_each_dataset_writes_alone(tmp_path, tiny_target_dir,
                                                                   eos_id):
    """Three datasets (one kept as it is, one with long-context jobs, records failing in two)
    through one pool, and each alone against the same server: the same files byte for byte
    and the same manifest entries, but for the counts of what each run did."""
    sets = {"a": synthetic_conversations(60, "a", long_every=10, long_words=300),
            "kept": synthetic_conversations(20, "kept"), "b": synthetic_conversations(40, "b")}
    _write(tmp_path / "pooled", sets, kept=("kept",))
    for name, convs in sets.items():
        _write(tmp_path / name, {name: convs}, kept=("kept",) if name == "kept" else ())
    faults = Faults(delay_s=(0.0, 0.03), fail_ids=frozenset({"a/00005", "b/00007"}),
                    truncate_ids=frozenset({"b/00003"}), seed=2)
    flags = ("--concurrency", "6", "--long-concurrency", "2", "--long-context-threshold", "400",
             "--max-attempts", "2", "--max-failure-fraction", "0.1")
    with FakeSGLang(faults, eos_id=eos_id) as server:
        for workdir in ("pooled", *sets):
            assert main_01b(sglang_argv(tmp_path / workdir, tiny_target_dir, server.url,
                                        *flags)) == 0
    pooled = _manifest(tmp_path / "pooled")["outputs"]["datasets"]
    assert pooled["a"]["failed"] == 1 and pooled["b"]["failed"] == 2
    assert pooled["a"]["long_jobs"] == 6 and pooled["kept"]["records"] == 20
    for name in sets:
        assert_same_folder(tmp_path / "pooled" / STAGE / name, tmp_path / "pooled",
                           tmp_path / name / STAGE / name, tmp_path / name,
                           run_counts=RUN_COUNTS, count_files=("done.json",))
        alone = _manifest(tmp_path / name)["outputs"]["datasets"][name]
        assert _without_run_counts(pooled[name]) == _without_run_counts(alone), name


# ---------------------------------------------------------------- kills, signals, resume


def test_pooled_run_killed_at_random_moments_resumes_to_the_uninterrupted_folder(
        tmp_path, tiny_target_dir, eos_id):
    """Three datasets in one pool, answers out of order; three SIGKILLs at random numbers of
    records written (over every dataset's file, so some kill finds several datasets begun)
    and a torn last line, then a full run: the stage folder is an uninterrupted run's."""
    sets = {"a": synthetic_conversations(150, "a", long_every=30, long_words=200),
            "b": synthetic_conversations(60, "b"),
            "c": synthetic_conversations(150, "c", long_every=25, long_words=200)}
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    for d in (ref_dir, run_dir):
        _write(d, sets)
    outs = [run_dir / STAGE / name / "tokenized.jsonl" for name in sets]
    rng = random.Random(1)
    with FakeSGLang(Faults(delay_s=(0.02, 0.08), seed=5), eos_id=eos_id) as server:
        assert main_01b(sglang_argv(ref_dir, tiny_target_dir, server.url,
                                    "--concurrency", "16")) == 0
        kills, reached, begun = 0, 0, []
        for _ in range(3):
            proc = spawn_01b(run_dir, tiny_target_dir, server.url)
            reached += rng.randint(60, 110)
            wait_for_lines(outs, reached, proc)
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is None:
                begun.append(sum(count_lines([p]) > 0 for p in outs))
                proc.kill()
                kills += 1
            proc.communicate()
        outs[0].write_bytes(outs[0].read_bytes() + b'{"id": "a/torn", "input_ids": [1, 2')
        proc = spawn_01b(run_dir, tiny_target_dir, server.url)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
    assert kills >= 2 and max(begun) >= 2
    assert_same_folder(run_dir / STAGE, run_dir, ref_dir / STAGE, ref_dir,
                       run_counts=RUN_COUNTS, count_files=("done.json",))


def test_pooled_run_killed_while_putting_files_in_order_resumes_to_the_uninterrupted_folder(
        tmp_path, tiny_target_dir, eos_id, monkeypatch):
    """Every answer is in; the run dies after the first dataset's files are in conversation
    order and before the second's are: the re-run puts them in order and ends as a whole
    run does."""
    sets = {"a": synthetic_conversations(30, "a"), "b": synthetic_conversations(30, "b")}
    for d in ("ref", "killed"):
        _write(tmp_path / d, sets)
    in_order = eagle3.generate.stage.write_in_job_order

    def dies_at_b(path: Path, ids: list[str]) -> None:
        if path.parent.name == "b":
            raise KeyboardInterrupt  # a SIGKILL here leaves the same files
        in_order(path, ids)

    with FakeSGLang(Faults(delay_s=(0.0, 0.03)), eos_id=eos_id) as server:
        argv = lambda d: sglang_argv(tmp_path / d, tiny_target_dir, server.url)  # noqa: E731
        assert main_01b(argv("ref")) == 0
        with monkeypatch.context() as m:
            m.setattr(eagle3.generate.stage, "write_in_job_order", dies_at_b)
            with pytest.raises(KeyboardInterrupt):
                main_01b(argv("killed"))
        stage = tmp_path / "killed" / STAGE
        assert (stage / "a/done.json").exists() and not (stage / "b/done.json").exists()
        n_before = len(server.requests)
        assert main_01b(argv("killed")) == 0
        assert len(server.requests) == n_before  # every answer was kept: none asked again
    assert_same_folder(stage, tmp_path / "killed", tmp_path / "ref" / STAGE, tmp_path / "ref",
                       run_counts=RUN_COUNTS, count_files=("done.json",))


def test_sigterm_in_a_pooled_run_keeps_every_answer_in_flight_and_a_rerun_completes(
        tmp_path, tiny_target_dir, eos_id):
    """SIGTERM with the last requests of `a` and the first of `b` in flight: every request
    sent, of either dataset, becomes a record; the re-run generates only the others."""
    sets = {"a": synthetic_conversations(60, "a"), "b": synthetic_conversations(60, "b")}
    _write(tmp_path, sets)
    outs = [tmp_path / STAGE / name / "tokenized.jsonl" for name in sets]
    with FakeSGLang(Faults(delay_s=(0.2, 0.3)), eos_id=eos_id) as server:
        proc = spawn_01b(tmp_path, tiny_target_dir, server.url)
        wait_for_lines(outs, 50, proc)  # 50 of a answered, 16 in flight: some of b sent
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
        sent = {r["rid"] for r in _generate_requests(server)}
        written = {r["id"] for p in outs if p.exists() for r in read_jsonl(p)}
        assert written == sent and len(written) < 120
        assert {rid[0] for rid in sent} == {"a", "b"}
        assert not (tmp_path / STAGE / "manifest.json").exists()
        n_before = len(server.requests)
        assert main_01b(sglang_argv(tmp_path, tiny_target_dir, server.url)) == 0
        again = {r["rid"] for r in server.requests[n_before:] if r["path"] == "/generate"}
    assert not again & written and len(again) == 120 - len(written)
    assert [len(list(read_jsonl(p))) for p in outs] == [60, 60]
