"""Stage 01b's openai backend: a real OpenAI-compatible server (`transformers serve` with the
tiny target) end to end, and the re-rendering of reasoning and tool calls."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from eagle3.core.chat import ChatRenderer, split_for_generation
from eagle3.core.records import read_jsonl
from eagle3.core.server import RetryPolicy, ServerPool
from eagle3.generate.backends import OpenAIBackend, RecordFailure
from eagle3.generate.jobs import GenerationJob
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage
from eagle3.testing.fake_sglang import FakeSGLang

MAX_NEW = 10


def _main(argv: list[str]) -> int:
    return importlib.import_module("01b_generate_synthetic").main(argv)


def _prompt(tokenizer, conv: dict) -> list[int]:
    msgs, _ = split_for_generation(conv["messages"])
    return tokenizer.apply_chat_template(msgs, tools=conv.get("tools"), thinking=True,
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def transformers_server(tiny_target_dir, tmp_path_factory):
    """`transformers serve` on the tiny target (CPU), stopped after the module's tests."""
    for module in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(module, reason="transformers serve needs transformers[serving]")
    port = _free_port()
    cache = tmp_path_factory.mktemp("hf_cache")  # /v1/models lists the (empty) hub cache
    log = (cache / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformers.cli.transformers", "serve", str(tiny_target_dir),
         "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("transformers serve did not start:\n"
                                       + (cache / "serve.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_openai_backend_matches_hf_greedy_when_served_by_transformers_serve(
        tmp_path, tiny_target_dir, tokenizer, target_model, transformers_server):
    import torch

    convs = synthetic_conversations(4, "ds")  # one has tools, one a system prompt, one 2 turns
    assert any("tools" in c for c in convs)
    write_prepared_stage(tmp_path, {"ds": convs})
    rc = _main(["--workdir", str(tmp_path), "--target", str(tiny_target_dir), "--backend",
                "openai", "--server-url", transformers_server, "--served-model",
                str(tiny_target_dir), "--max-new-tokens", str(MAX_NEW), "--concurrency", "2",
                "--max-failure-fraction", "0"])
    assert rc == 0
    records = {r["id"]: r for r in read_jsonl(tmp_path / "01b_generated/ds/tokenized.jsonl")}
    assert set(records) == {c["id"] for c in convs}
    for conv in convs:
        r, prompt = records[conv["id"]], _prompt(tokenizer, conv)
        n = len(prompt)
        assert r["input_ids"][:n] == prompt and r["n_prompt_tokens"] == n
        assert r["loss_mask"] == [0] * n + [1] * (len(r["input_ids"]) - n)
        # Independent reference: greedy generation in process, decoded as the server decodes.
        with torch.no_grad():
            out = target_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                        do_sample=False)[0, n:].tolist()
        reference = tokenizer.decode(out, skip_special_tokens=True)
        assert tokenizer.decode(r["input_ids"][n:], skip_special_tokens=True) == reference
        assert r["finish_reason"] == ("length" if len(out) == MAX_NEW and
                                      out[-1] != tokenizer.eos_token_id else "stop")


def _fake_prompt_tokens(tokenizer, extra: int = 0):
    def count(body: dict) -> int:  # what a server rendering our template would count
        return len(tokenizer.apply_chat_template(
            body["messages"], tools=body.get("tools"), add_generation_prompt=True,
            tokenize=True, return_dict=True, **body.get("chat_template_kwargs", {}))
            ["input_ids"]) + extra
    return count


def test_openai_backend_rerenders_reasoning_and_tool_calls_with_the_template(
        tmp_path, tiny_target_dir, tokenizer, monkeypatch):
    convs = synthetic_conversations(10, "ds")
    write_prepared_stage(tmp_path, {"ds": convs})
    monkeypatch.setenv("TEST_OPENAI_KEY", "sk-secret-123")
    with FakeSGLang(prompt_tokens=_fake_prompt_tokens(tokenizer)) as server:
        rc = _main(["--workdir", str(tmp_path), "--target", str(tiny_target_dir), "--backend",
                    "openai", "--server-url", server.url, "--api-key-env", "TEST_OPENAI_KEY",
                    "--max-new-tokens", "256"])  # the fake's replies fit it (~71 tokens)
    assert rc == 0
    chats = [r for r in server.requests if r["path"] == "/v1/chat/completions"]
    assert {r["authorization"] for r in chats} == {"Bearer sk-secret-123"}
    assert all(r["body"]["chat_template_kwargs"] == {"thinking": True} for r in chats)
    assert all(r["body"]["model"] == "fake-model" for r in chats)  # from /v1/models
    assert "sk-secret-123" not in (tmp_path / "01b_generated/manifest.json").read_text()
    raw = {r["id"]: r for r in read_jsonl(tmp_path / "01b_generated/ds/raw.jsonl")}
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for rec in read_jsonl(tmp_path / "01b_generated/ds/tokenized.jsonl"):
        conv = next(c for c in convs if c["id"] == rec["id"])
        msgs, _ = split_for_generation(conv["messages"])
        reply = raw[rec["id"]]["message"]
        assert reply["reasoning_content"].startswith("The user asks")
        assert ("tool_calls" in reply) == ("tools" in conv)
        full = tokenizer.apply_chat_template(msgs + [reply], tools=conv.get("tools"),
                                             thinking=True, tokenize=True,
                                             return_dict=True)["input_ids"]
        n = len(_prompt(tokenizer, conv))
        assert rec["input_ids"] == full[: len(full) - full[::-1].index(eot)]
        assert rec["loss_mask"] == [0] * n + [1] * (len(rec["input_ids"]) - n)
        text = tokenizer.decode(rec["input_ids"][n:])
        assert text.startswith("<think>The user asks") and text.endswith("<|im_end|>")
        if "tools" in conv:
            assert "<|tool_call_begin|>functions.get_weather:0" in text


def test_openai_backend_fails_records_when_server_template_differs(
        tmp_path, tiny_target_dir, tokenizer):
    convs = synthetic_conversations(6, "ds")
    write_prepared_stage(tmp_path, {"ds": convs})
    with FakeSGLang(prompt_tokens=_fake_prompt_tokens(tokenizer, extra=1)) as server:
        rc = _main(["--workdir", str(tmp_path), "--target", str(tiny_target_dir), "--backend",
                    "openai", "--server-url", server.url, "--served-model", "m"])
    assert rc == 1  # every record failed: the stage is not complete
    failures = list(read_jsonl(tmp_path / "01b_generated/ds/failures.jsonl"))
    assert len(failures) == 6 and all(f["kind"] == "prompt mismatch" for f in failures)


def test_openai_record_drops_end_of_turn_when_reply_was_cut_by_length(tokenizer):
    renderer = ChatRenderer(tokenizer, template_kwargs={"thinking": True})
    msgs = [{"role": "user", "content": "Hi"}]
    job = GenerationJob("a", "s", renderer.prompt_ids(msgs), 5, msgs)
    backend = OpenAIBackend(ServerPool(["http://127.0.0.1:9"]), renderer,
                            RetryPolicy(0.5, 3600.0), "m")
    answer = {"choices": [{"message": {"content": "Hello there"}, "finish_reason": "length"}]}
    rec, _ = backend.to_record(job, answer)
    assert rec["finish_reason"] == "length"
    assert tokenizer.decode(rec["input_ids"][len(job.prompt_ids):]) == "<think></think>Hello there"
    answer["choices"][0]["finish_reason"] = "stop"
    rec, _ = backend.to_record(job, answer)
    assert rec["input_ids"][-1] == renderer.end_of_turn_id
    answer["usage"] = {"prompt_tokens": len(job.prompt_ids) + 3}
    with pytest.raises(RecordFailure, match="prompt mismatch"):
        backend.to_record(job, answer)


def test_api_key_env_must_name_a_set_variable(tmp_path, tiny_target_dir, monkeypatch):
    write_prepared_stage(tmp_path, {"ds": synthetic_conversations(2, "ds")})
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(SystemExit, match="NO_SUCH_KEY_VAR"):
        _main(["--workdir", str(tmp_path), "--target", str(tiny_target_dir), "--backend",
               "openai", "--api-key-env", "NO_SUCH_KEY_VAR"])

