"""Stage 01b against servers that are not the API they are said to be, or speak it in a legal
dialect: a readiness or model list that is another service's page ends 01b in one line (exit 1)
at once, an answer whose optional counts are null is recorded, one whose required count is not a
count is retried, never recorded. The fakes are eagle3.testing.fake_sglang's, their answers
spoiled here.

And servers whose answers cannot be the record's (ids outside the vocabulary, another request's
answer, a reply over the budget on either backend), that break HTTP or Unicode, that are up while
their generation endpoint is not, or that answer slowly: each answer is retried then listed as a
failure (never written), a text disagreeing with its ids is named, a broken endpoint ends in one
stop, and a slow server is waited for."""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from bench_helpers import free_port

from eagle3.core.faults import script_main
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy, ServerPool
from eagle3.generate.backends import BadAnswer, SGLangBackend
from eagle3.generate.jobs import GenerationJob
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang

ROOT = Path(__file__).resolve().parents[2]
STAGE = "01b_generated"
PAGE = "<!DOCTYPE html><html><head><title>Grafana</title></head></html>"


class LyingServer(FakeSGLang):
    """FakeSGLang whose readiness (`page`: /model_info answers a web page), model list
    (`models`) or answers' `meta_info` (`meta`: fields overwritten) lie."""

    def __init__(self, page: bool = False, models: dict | None = None,
                 meta: dict | None = None, **kw):
        super().__init__(**kw)
        self.page, self.models, self.meta = page, models, meta or {}

    async def _model_info(self, request: web.Request) -> web.Response:
        if self.page:
            return web.Response(text=PAGE, content_type="text/html")
        return await super()._model_info(request)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models is not None:
            return web.json_response(self.models)
        return await super()._models(request)

    async def _generate(self, request: web.Request) -> web.Response:
        answer = json.loads((await super()._generate(request)).body)
        answer["meta_info"].update(self.meta)
        return web.json_response(answer)


def _main(argv: list[str]) -> int:
    return importlib.import_module("01b_generate_synthetic").main(argv)


def _argv(workdir, target, url, *extra, backend: str = "sglang") -> list[str]:
    return ["--workdir", str(workdir), "--target", str(target), "--server-url", url,
            "--backend", backend,
            "--max-new-tokens", "24", "--retry-delay-s", "0.01", "--poll-s", "0.1",
            "--max-attempts", "2", "--log-level", "ERROR", *extra]


def _script(argv: list[str], capsys) -> tuple[int, str]:
    """01b through its entry point: (exit code, its error lines); never a traceback."""
    capsys.readouterr()
    rc = script_main(lambda: _main(argv), "01b")
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, "\n".join(line for line in err.splitlines() if line.startswith("01b: "))


@pytest.mark.parametrize("backend,server,words", [
    ("sglang", {"page": True}, "/model_info answered HTTP 200 with an HTML page"),
    ("openai", {"models": {"data": [{"name": "m"}]}}, "/v1/models lists no model id"),
    ("openai", {"models": {"data": "m"}}, "/v1/models lists no model id"),
])
def test_a_server_that_is_not_the_api_ends_01b_in_one_line_at_once(
        tmp_path, tiny_target_dir, capsys, backend, server, words):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(3, "ds")})
    with LyingServer(**server) as s:
        t0 = time.monotonic()
        rc, line = _script(_argv(tmp_path, tiny_target_dir, s.url, "--server-down-timeout-s",
                                 "60", backend=backend), capsys)
    assert time.monotonic() - t0 < 30  # not the 60 s a server still loading is given
    assert rc == 1 and line.startswith("01b: error: ") and "\n" not in line
    assert words in line and s.url in line
    assert not [r for r in s.requests if r.get("path") == "/generate"]


def test_answers_whose_optional_counts_are_null_are_recorded(tmp_path, tiny_target_dir,
                                                             tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    convs = synthetic_conversations(4, "ds")
    for d in ("ref", "run"):
        write_prepared_stage(tmp_path / d, {"ds": convs})
    with FakeSGLang(eos_id=eos) as clean:
        assert _main(_argv(tmp_path / "ref", tiny_target_dir, clean.url)) == 0
    with LyingServer(meta={"completion_tokens": None, "cached_tokens": None,
                           "e2e_latency": None}, eos_id=eos) as s:
        assert _main(_argv(tmp_path / "run", tiny_target_dir, s.url)) == 0
    read = lambda d: list(read_jsonl(tmp_path / d / STAGE / "ds/tokenized.jsonl"))  # noqa: E731
    assert sorted(read("run"), key=str) == sorted(read("ref"), key=str) and len(read("run")) == 4
    assert len([r for r in s.requests if r["path"] == "/generate"]) == 4


@pytest.mark.parametrize("prompt_tokens", [None, "3", 3.0, True])
def test_an_answer_whose_prompt_count_is_not_a_count_is_retried_not_recorded(prompt_tokens):
    backend = SGLangBackend(ServerPool(["http://127.0.0.1:9"]), 7, RetryPolicy(0.5, 10.0))
    answer = {"output_ids": [5, 7], "meta_info": {"prompt_tokens": prompt_tokens,
                                                  "finish_reason": {"type": "stop"}}}
    with pytest.raises(BadAnswer, match="malformed answer.*prompt_tokens"):
        backend.to_record(GenerationJob("ds/1", "ds", [1, 2, 3], 4), answer)


# ---------------------------------------------------------------- answers that cannot be


class RuleBreaker(FakeSGLang):
    """FakeSGLang whose `/generate` answers break one rule (`kind`), for every record or only
    for `only` (a record id); `info_delay_s` slows `/model_info` down; `chat` replaces the
    `/v1/chat/completions` answer's message and usage."""

    def __init__(self, kind: str = "", only: str | None = None, info_delay_s: float = 0.0,
                 chat: dict | None = None, **kw):
        super().__init__(**kw)
        self.kind, self.only, self.info_delay_s, self.chat = kind, only, info_delay_s, chat
        self.dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def _model_info(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.info_delay_s)
        return await super()._model_info(request)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        kind = self.kind if self.only in (None, rid) else ""
        if kind == "redirect":  # the server is up; its generation endpoint points nowhere
            raise web.HTTPTemporaryRedirect(self.dead + "/generate")
        good = await super()._generate(request)
        answer = json.loads(good.body)
        body = json.dumps(answer)
        if kind == "out_of_vocab":  # counts consistent, one id the target cannot emit
            answer["output_ids"][0] = VOCAB + 5
        elif kind == "foreign":  # another request's answer: same prompt length, its rid
            answer["meta_info"]["id"] = "ds/another~retry1"
        elif kind == "text":
            answer["text"] = "not what the ids say"
        elif kind == "surrogate":  # an extra field holding a lone UTF-16 surrogate
            body = json.dumps(answer)[:-2] + ', "note": "\\ud800"}}'
            return web.Response(body=body.encode(), content_type="application/json")
        elif kind == "bad_chunk":  # a chunk size that is not hex
            request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
                                    + body.encode() + b"\r\n0\r\n\r\n")
            await asyncio.sleep(0.05)
            request.transport.close()
            return web.Response()
        return web.json_response(answer)

    async def _chat(self, request: web.Request) -> web.Response:
        if self.chat is None:
            return await super()._chat(request)
        await request.json()
        return web.json_response({"id": "chatcmpl-x", "object": "chat.completion",
                                  "usage": self.chat["usage"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": self.chat["message"]}]})


VOCAB = 0  # set from the tiny target's config.json by the fixture below


@pytest.fixture(scope="module", autouse=True)
def _vocab(tiny_target_dir):
    global VOCAB
    VOCAB = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]


def _failures(workdir) -> dict[str, dict]:
    path = workdir / STAGE / "ds/failures.jsonl"
    return {f["id"]: f for f in read_jsonl(path)} if path.exists() else {}


def _tokenized(workdir) -> list[dict]:
    path = workdir / STAGE / "ds/tokenized.jsonl"
    return list(read_jsonl(path)) if path.exists() else []


@pytest.mark.parametrize("kind,words", [
    ("out_of_vocab", "outside the target's vocabulary"),
    ("foreign", "the answer of another request"),
    ("surrogate", "lone UTF-16 surrogate"),
    ("bad_chunk", "malformed HTTP answer"),
])
def test_an_answer_that_cannot_be_the_records_is_retried_then_listed_never_written(
        tmp_path, tiny_target_dir, tokenizer, capsys, kind, words):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    convs = synthetic_conversations(3, "ds")
    write_prepared_stage(tmp_path, {"ds": convs})
    with RuleBreaker(kind, eos_id=eos) as s:
        rc, line = _script(_argv(tmp_path, tiny_target_dir, s.url, "--max-failure-fraction",
                                 "1"), capsys)
    assert rc == 0, line  # every record listed as failed, none written, no traceback
    assert _tokenized(tmp_path) == []
    failures = _failures(tmp_path)
    assert set(failures) == {c["id"] for c in convs}
    for f in failures.values():
        assert f["attempts"] == 2 and words in f["reason"], f
        if kind in ("surrogate", "bad_chunk"):  # caught in transport: server and request named
            assert s.url in f["reason"] and f"request {f['id']}" in f["reason"], f


def test_an_openai_reply_over_max_tokens_without_a_count_is_retried_then_listed(
        tmp_path, tiny_target_dir, capsys):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(2, "ds")})
    long_reply = {"message": {"role": "assistant", "content": "word " * 280}, "usage": {}}
    with RuleBreaker(chat=long_reply) as s:
        rc, _ = _script(_argv(tmp_path, tiny_target_dir, s.url, "--max-failure-fraction", "1",
                              backend="openai"), capsys)
    assert rc == 0 and _tokenized(tmp_path) == []
    reasons = [f["reason"] for f in _failures(tmp_path).values()]
    assert len(reasons) == 2 and all("does not honour max_tokens" in r for r in reasons)


def test_a_text_that_disagrees_with_its_ids_is_named_and_the_ids_are_kept(
        tmp_path, tiny_target_dir, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    convs = synthetic_conversations(3, "ds")
    for d in ("ref", "run"):
        write_prepared_stage(tmp_path / d, {"ds": convs})
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with FakeSGLang(eos_id=eos, decode=decode) as clean:
        assert _main(_argv(tmp_path / "ref", tiny_target_dir, clean.url)) == 0
    with RuleBreaker("text", only=convs[1]["id"], eos_id=eos, decode=decode) as s:
        assert _main(_argv(tmp_path / "run", tiny_target_dir, s.url)) == 0
    assert _tokenized(tmp_path / "run") == _tokenized(tmp_path / "ref")  # the ids, as sent
    outputs = json.loads((tmp_path / "run" / STAGE / "manifest.json").read_text())["outputs"]
    assert outputs["datasets"]["ds"]["text_mismatch"] == 1  # the clean texts all agree
    raw = {r["id"]: r for r in read_jsonl(tmp_path / "run" / STAGE / "ds/raw.jsonl")}
    assert raw[convs[1]["id"]]["text_disagreeing_with_ids"] == "not what the ids say"
    assert sum("text_disagreeing_with_ids" in r for r in raw.values()) == 1


def test_a_text_that_disagrees_with_its_ids_is_listed_with_its_reason_and_named_in_the_summary(
        tmp_path, tiny_target_dir, tokenizer, capsys):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    convs = {"ds": synthetic_conversations(3, "ds"), "ds2": synthetic_conversations(2, "ds2")}
    write_prepared_stage(tmp_path, convs)
    liar = convs["ds"][1]["id"]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with RuleBreaker("text", only=liar, eos_id=eos, decode=decode) as s:
        capsys.readouterr()
        assert _main(_argv(tmp_path, tiny_target_dir, s.url)) == 0
    out = capsys.readouterr().out
    listed = tmp_path / STAGE / "ds/text_mismatch.jsonl"
    (line,) = read_jsonl(listed)  # the skip list's shape: id, file, reason
    assert line["id"] == liar and line["file"] == str(tmp_path / STAGE / "ds/raw.jsonl")
    assert line["reason"].startswith("text mismatch: ") and "'not what the ids say'" in line[
        "reason"] and "the ids are kept" in line["reason"]
    assert liar in {r["id"] for r in _tokenized(tmp_path)}  # the ids are the record's
    (row,) = [x for x in out.splitlines() if "text disagreeing with its ids" in x]
    assert row.lstrip().startswith("ds text") and str(listed) in row and liar in row
    datasets = json.loads((tmp_path / STAGE / "manifest.json").read_text())["outputs"][
        "datasets"]
    assert datasets["ds"]["text_mismatch"] == 1 and datasets["ds"]["text_mismatch_list"] == str(
        listed)
    assert datasets["ds2"]["text_mismatch"] == 0  # counted per dataset, not carried over
    assert not (tmp_path / STAGE / "ds2/text_mismatch.jsonl").exists()


def test_a_server_up_whose_generation_endpoint_is_not_ends_in_one_stop_not_a_flood(
        tmp_path, tiny_target_dir):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(4, "ds")})
    with RuleBreaker("redirect") as s:
        argv = _argv(tmp_path, tiny_target_dir, s.url, "--max-attempts", "3",
                     "--server-down-timeout-s", "5")
        argv[argv.index("--log-level") + 1] = "WARNING"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "01b_generate_synthetic.py"), *argv],
                              cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert time.monotonic() - t0 < 60
    err = proc.stderr
    assert proc.returncode == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("01b stopped: ") and s.url in last, last
    assert "3 requests in a row could not reach its generation endpoint" in last, last
    assert err.count("unreachable") + err.count("reachable again") <= 2, err[-2000:]
    assert _tokenized(tmp_path) == []


def test_a_slow_correct_server_is_waited_for_not_taken_for_dead(tmp_path, tiny_target_dir,
                                                                tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(3, "ds")})
    with RuleBreaker(info_delay_s=1.5, eos_id=eos) as s:
        argv = _argv(tmp_path, tiny_target_dir, s.url, "--server-down-timeout-s", "8")
        argv[argv.index("--poll-s") + 1] = "0.5"
        assert _main(argv) == 0
    assert len(_tokenized(tmp_path)) == 3
