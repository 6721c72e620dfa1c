"""Stage 01b under faults: a server that misbehaves on cue, damaged input files, a full or
read-only disk, SIGTERM. Each fault kind has its expected outcome: a bounded retry then a
failure line (never a record written as good, never a hang), a counted skip, or a clean stop
that a re-run turns into exactly the output of an uninterrupted run.

`CueServer` is the fake SGLang server (eagle3.testing.fake_sglang) with a script per record id:
the behaviour of each attempt in turn (`CUES`), then good answers.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from fault_helpers import fill_disk, make_read_only, make_writable, small_disk
from generate_helpers import RUN_COUNTS
from stage_helpers import assert_same_folder

from eagle3.core.faults import DiskError, InputFileError, TooManyBad, script_main
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy, ServerPool, TransientError
from eagle3.generate.backends import BadAnswer, OpenAIBackend, RecordFailure, SGLangBackend
from eagle3.generate.jobs import GenerationJob
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 24
STAGE = "01b_generated"

# fault kind -> what the failure line's reason must say once every attempt met it
CUES = {
    "500": "HTTP 500",
    "429": "HTTP 429",
    "hang": "no answer within",
    "half_body": "connection dropped",
    "half_chunked": "connection dropped",
    "bad_json": "unparsable answer",
    "not_object": "not a JSON object",
    "no_fields": "malformed answer",
    "count": "wrong token count",
    "over_budget": "wrong token count",
    "cut_short": "reply cut short",
    "not_ids": "not token ids",
}


class CueServer(FakeSGLang):
    """FakeSGLang whose `/generate` follows `cues[record id]`: one fault kind per attempt."""

    def __init__(self, cues: dict[str, list[str]], **kw):
        super().__init__(**kw)
        self.cues = {k: list(v) for k, v in cues.items()}

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body.get("rid", "").split("~")[0]
        cue = self.cues.get(rid, [])
        kind = cue.pop(0) if cue else "ok"
        self.requests.append({"rid": rid, "path": "/generate", "kind": kind})
        if kind in ("500", "429"):
            return web.Response(status=int(kind), text=f"injected {kind}")
        if kind == "hang":
            await self._stopping.wait()
            return web.Response(status=500)
        good = await super()._generate(request)
        self.requests.pop()  # the parent logged the same request
        answer = json.loads(good.body)
        if kind in ("half_body", "half_chunked"):
            return await _cut_body(request, json.dumps(answer).encode(), kind == "half_chunked")
        if kind == "bad_json":
            return web.Response(body=json.dumps(answer).encode()[:-7],
                                content_type="application/json")
        return web.json_response(_spoil(answer, kind, body))


def _spoil(answer: dict, kind: str, body: dict):
    """The answer as a faulty server sends it."""
    meta, out = answer["meta_info"], answer["output_ids"]
    budget = body["sampling_params"]["max_new_tokens"]
    if kind == "not_object":
        return [answer]
    if kind == "no_fields":
        return {"text": "", "meta": meta}
    if kind == "count":
        meta["completion_tokens"] = len(out) + 3
    elif kind == "over_budget":
        answer["output_ids"] = out + [11] * (budget + 1 - len(out))
        meta["completion_tokens"] = len(answer["output_ids"])
    elif kind == "cut_short":  # a reply cut by the connection, labelled as cut by the limit
        answer["output_ids"] = out[:1]
        meta.update(completion_tokens=1, finish_reason={"type": "length", "length": budget})
    elif kind == "not_ids":
        answer["output_ids"] = [str(t) for t in out]
    return answer


async def _cut_body(request: web.Request, data: bytes, chunked: bool) -> web.StreamResponse:
    """Headers and half of the body, then the connection closes."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    if chunked:
        resp.enable_chunked_encoding()
    else:
        resp.content_length = len(data)
    await resp.prepare(request)
    await resp.write(data[: len(data) // 2])
    await asyncio.sleep(0.05)
    request.transport.abort()
    return resp


def _main(argv: list[str]) -> int:
    return importlib.import_module("01b_generate_synthetic").main(argv)


def _argv(workdir, target, url, *extra) -> list[str]:
    return ["--workdir", str(workdir), "--target", str(target), "--backend", "sglang",
            "--server-url", url, "--max-new-tokens", str(MAX_NEW), "--retry-delay-s", "0.01",
            "--poll-s", "0.1", "--log-level", "ERROR", *extra]


@pytest.fixture(scope="module")
def eos_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _records(workdir: Path, name: str = "ds") -> dict[str, dict]:
    path = workdir / STAGE / name / "tokenized.jsonl"
    return {r["id"]: r for r in read_jsonl(path)} if path.exists() else {}


# ---------------------------------------------------------------- server faults


def test_every_server_fault_is_retried_then_failed_and_never_written_as_good(
        tmp_path, tiny_target_dir, eos_id):
    """Per fault kind, one record meets it twice then gets a good answer (kept, equal to the
    clean run's), one meets it on every attempt (a failure line naming it, no record)."""
    convs = synthetic_conversations(2 * len(CUES) + 2, "ds")
    ids = [c["id"] for c in convs]
    recover = dict(zip(ids[0::2], CUES))
    always = dict(zip(ids[1::2], CUES))
    cues = {**{i: [k, k] for i, k in recover.items()}, **{i: [k] * 3 for i, k in always.items()}}
    for d in ("ref", "run"):
        write_prepared_stage(tmp_path / d, {"ds": convs})
    flags = ("--max-attempts", "3", "--request-timeout-s", "0.5", "--concurrency", "8",
             "--max-failure-fraction", "1")
    with FakeSGLang(eos_id=eos_id) as clean:
        assert _main(_argv(tmp_path / "ref", tiny_target_dir, clean.url, *flags)) == 0
    with CueServer(cues, eos_id=eos_id) as server:
        t0 = time.monotonic()
        assert _main(_argv(tmp_path / "run", tiny_target_dir, server.url, *flags)) == 0
        assert time.monotonic() - t0 < 30  # no hang: every wait had its deadline
    drawn = {r["kind"] for r in server.requests}
    assert set(CUES) <= drawn
    ref, got = _records(tmp_path / "ref"), _records(tmp_path / "run")
    failures = {f["id"]: f for f in read_jsonl(tmp_path / "run" / STAGE / "ds/failures.jsonl")}
    assert set(failures) == set(always) and not set(got) & set(always)
    for rid, kind in always.items():
        assert CUES[kind] in failures[rid]["reason"], (kind, failures[rid])
        assert failures[rid]["attempts"] == 3
    assert {rid: got[rid] for rid in got} == {rid: ref[rid] for rid in got}
    assert set(got) == set(ref) - set(always)


def _job() -> GenerationJob:
    return GenerationJob("ds/1", "ds", [1, 2, 3], 4)


def _sglang(output, finish, **meta) -> dict:
    return {"text": "", "output_ids": output,
            "meta_info": {"prompt_tokens": 3, "completion_tokens": len(output),
                          "finish_reason": finish, **meta}}


@pytest.mark.parametrize("answer, match", [
    (_sglang([5, 6], {"type": "stop", "matched": 7}, completion_tokens=5), "wrong token count"),
    (_sglang([5, 6, 7, 8, 9], {"type": "length", "length": 5}), "more than max_new_tokens"),
    (_sglang([5], {"type": "length", "length": 4}), "reply cut short"),
    (_sglang([5, True], {"type": "length", "length": 2}), "not token ids"),
    (_sglang([5, -1], {"type": "length", "length": 2}), "not token ids"),
    (_sglang([], {"type": "stop"}), "empty reply"),
    ({"output_ids": [5], "meta_info": None}, "malformed answer"),
])
def test_sglang_answer_that_contradicts_itself_is_retried_not_recorded(answer, match):
    backend = SGLangBackend(ServerPool(["http://127.0.0.1:9"]), 7, RetryPolicy(0.5, 10.0))
    with pytest.raises(BadAnswer, match=match):
        backend.to_record(_job(), answer)


@pytest.mark.parametrize("finish, usage, error, match", [
    (None, {}, BadAnswer, "reply not finished"),
    ("abort", {}, BadAnswer, "reply not finished"),
    ("content_filter", {}, RecordFailure, "unusable finish reason"),
    ("stop", {"completion_tokens": 9}, BadAnswer, "more than max_tokens"),
])
def test_openai_answer_cut_or_overlong_never_becomes_a_finished_reply(finish, usage, error,
                                                                      match):
    backend = OpenAIBackend(ServerPool(["http://127.0.0.1:9"]), None, RetryPolicy(0.5, 10.0),
                            "m")
    answer = {"choices": [{"message": {"role": "assistant", "content": "hi"},
                           "finish_reason": finish}], "usage": usage}
    with pytest.raises(error, match=match):
        backend.to_record(_job(), answer)
    assert issubclass(BadAnswer, TransientError)  # retried like a 500


# ---------------------------------------------------------------- damaged input files


def _damage(workdir: Path) -> None:
    """A bad JSON line and two contract breaks in the middle, a torn last line."""
    path = workdir / "01_prepared/ds/conversations.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(3, b'{"id": "ds/x", "messages": [\n')
    lines.insert(6, json.dumps({"id": "ds/y", "source": "ds", "messages": "hi"}).encode() + b"\n")
    lines.insert(9, json.dumps({"id": "ds/z", "source": "ds", "messages": [
        {"role": "narrator", "content": "x"}]}).encode() + b"\n")
    path.write_bytes(b"".join(lines) + b'{"id": "ds/torn", "source": "ds", "mess')


def test_damaged_input_lines_are_skipped_listed_and_counted_up_to_max_bad(
        tmp_path, tiny_target_dir, eos_id):
    convs = synthetic_conversations(12, "ds")
    write_prepared_stage(tmp_path, {"ds": convs})
    _damage(tmp_path)
    with FakeSGLang(eos_id=eos_id) as server:
        with pytest.raises(TooManyBad, match="4 bad records, more than --max-bad 3"):
            _main(_argv(tmp_path, tiny_target_dir, server.url, "--max-bad", "3"))
        assert not (tmp_path / STAGE / "manifest.json").exists()
        assert _main(_argv(tmp_path, tiny_target_dir, server.url, "--max-bad", "4")) == 0
        sent = {r["rid"] for r in server.requests if r["path"] == "/generate"}
    skipped = list(read_jsonl(tmp_path / STAGE / "skipped.jsonl"))
    assert [s["id"] for s in skipped] == [f"ds/conversations.jsonl:{n}" for n in (4, 7, 10, 16)]
    kinds = [s["reason"].split(":")[0] for s in skipped]
    assert kinds == ["bad JSON", "bad record", "bad record", "torn line"]
    assert sent == set(_records(tmp_path)) == {c["id"] for c in convs}  # none sent, all good
    outputs = json.loads((tmp_path / STAGE / "manifest.json").read_text())["outputs"]
    assert outputs["skipped"] == 4 and outputs["skip_reasons"] == {
        "bad JSON": 1, "bad record": 2, "torn line": 1}


def test_input_file_listed_upstream_but_missing_is_an_error_naming_it(tmp_path,
                                                                     tiny_target_dir):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(3, "ds")}, regenerate=False)
    src = tmp_path / "01_prepared/ds/conversations.jsonl"
    src.unlink()
    with pytest.raises(InputFileError, match="missing.*lists dataset ds") as err:
        _main(_argv(tmp_path, tiny_target_dir, "http://127.0.0.1:9"))
    assert str(src) in str(err.value)


# ---------------------------------------------------------------- full or read-only disk


def test_full_then_read_only_disk_stop_naming_the_folder_and_rerun_equals_clean_run(
        tmp_path, tiny_target_dir, eos_id, capsys):
    convs = synthetic_conversations(120, "ds")
    write_prepared_stage(tmp_path / "ref", {"ds": convs})
    with small_disk(tmp_path / "disk", kib=1024) as disk, FakeSGLang(eos_id=eos_id) as server:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        run = disk / "run"
        write_prepared_stage(run, {"ds": convs})
        assert _main(_argv(tmp_path / "ref", tiny_target_dir, server.url)) == 0
        ref_bytes = sum(p.stat().st_size for p in (tmp_path / "ref" / STAGE / "ds").iterdir())
        fill_disk(disk, leave=ref_bytes // 3)
        with pytest.raises(DiskError) as err:
            _main(_argv(run, tiny_target_dir, server.url))
        msg = str(err.value)
        assert "no space left" in msg and str(run / STAGE / "ds") in msg and "bytes" in msg
        assert not (run / STAGE / "manifest.json").exists()
        if make_read_only(disk):  # through the script's entry point: one line, exit 1
            try:
                rc = script_main(lambda: _main(_argv(run, tiny_target_dir, server.url)), "01b")
            finally:
                make_writable(disk)
            assert rc == 1 and "read-only file system" in capsys.readouterr().err
        (disk / "ballast").unlink()  # space is back: the same command resumes
        assert _main(_argv(run, tiny_target_dir, server.url)) == 0
        assert_same_folder(run / STAGE, run, tmp_path / "ref" / STAGE, tmp_path / "ref",
                           run_counts=RUN_COUNTS, count_files=("done.json",))
        shutil.rmtree(run)


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_keeps_what_is_complete_and_ends_with_how_to_resume(
        tmp_path, tiny_target_dir, eos_id):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(60, "ds")})
    out = tmp_path / STAGE / "ds/tokenized.jsonl"
    from eagle3.testing.fake_sglang import Faults

    with FakeSGLang(Faults(delay_s=(0.1, 0.2)), eos_id=eos_id) as server:
        cmd = [sys.executable, str(ROOT / "01b_generate_synthetic.py"),
               *_argv(tmp_path, tiny_target_dir, server.url, "--concurrency", "4")]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 4:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert _main(_argv(tmp_path, tiny_target_dir, server.url)) == 0
    assert proc.returncode == 128 + signal.SIGTERM
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("01b: stopped by SIGTERM") and "re-run the same command" in last
    assert "Traceback" not in err.decode()
    assert len(_records(tmp_path)) == 60
