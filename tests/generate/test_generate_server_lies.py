"""Stage 01b against servers that are not the API they are said to be, or speak it in a legal
dialect: a readiness or model list that is another service's page ends 01b in one line (exit 1)
at once, an answer whose optional counts are null is recorded, one whose required count is not a
count is retried, never recorded. The fakes are eagle3.testing.fake_sglang's, their answers
spoiled here."""

from __future__ import annotations

import importlib
import json
import time

import pytest
from aiohttp import web

from eagle3.core.faults import script_main
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy, ServerPool
from eagle3.generate.backends import BadAnswer, SGLangBackend
from eagle3.generate.jobs import GenerationJob
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang

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
