"""The server client: retries and what is not retried, fault classes, pools, readiness."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from eagle3.core.server import (
    NotJSONError,
    RetryPolicy,
    ServerError,
    ServerExitedError,
    ServerPool,
    TransientError,
    generate,
    get_server_info,
    make_session,
    post_json,
    post_once,
    served_model,
    wait_ready,
)
from eagle3.testing.fake_sglang import FakeSGLang, Faults, fake_output

FAST = RetryPolicy(max_retries=3, base_delay_s=0.01, timeout_s=5.0)


def _run(coro_fn):
    async def go():
        async with make_session(64) as session:
            return await coro_fn(session)
    return asyncio.run(go())


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_generate_returns_the_servers_output_ids_when_healthy():
    with FakeSGLang() as server:
        answer = _run(lambda s: generate(s, server.url, [5, 6, 7], "r1",
                                         {"max_new_tokens": 8}, FAST))
    out, reason = fake_output([5, 6, 7], 8)
    assert answer["output_ids"] == out
    assert answer["meta_info"]["finish_reason"]["type"] == reason
    assert server.requests[0]["rid"] == "r1"


def test_post_json_retries_then_raises_naming_the_request_when_always_500():
    with FakeSGLang(Faults(fail_ids=frozenset({"bad"}))) as server:
        with pytest.raises(ServerError, match="request bad failed after 4 attempts.*HTTP 500"):
            _run(lambda s: generate(s, server.url, [1], "bad", {}, FAST))
    assert len(server.requests) == 4


def test_post_json_succeeds_when_some_attempts_fail():
    faults = Faults(error_rate=0.5, drop_rate=0.2, seed=9)  # at most 4 attempts a request
    policy = RetryPolicy(max_retries=20, base_delay_s=0.001, timeout_s=5.0)
    with FakeSGLang(faults) as server:
        for k in range(10):
            answer = _run(lambda s, k=k: generate(s, server.url, [k], f"r{k}", {}, policy))
            assert answer["output_ids"] == fake_output([k], 128)[0]
    kinds = [r["kind"] for r in server.requests]
    assert kinds.count("ok") == 10 and "error" in kinds and "drop" in kinds


def test_post_json_does_not_retry_when_server_answers_4xx():
    with FakeSGLang() as server:
        with pytest.raises(ServerError, match="HTTP 404.*not retried"):
            _run(lambda s: post_json(s, server.url + "/no_such_path", {}, FAST, "x"))


def test_post_once_classifies_refused_dropped_and_timed_out_requests():
    with FakeSGLang(Faults(drop_rate=1.0)) as dropping:
        with pytest.raises(TransientError) as dropped:
            _run(lambda s: post_once(s, dropping.url + "/generate", {"input_ids": [1]}, 5, "x"))
    assert not dropped.value.unreachable
    with FakeSGLang(Faults(hang_rate=1.0, hang_s=5.0)) as hanging:
        with pytest.raises(TransientError, match="no answer within") as timed_out:
            _run(lambda s: post_once(s, hanging.url + "/generate", {"input_ids": [1]}, 0.2,
                                     "x"))
    assert not timed_out.value.unreachable
    with pytest.raises(TransientError, match="cannot connect") as refused:
        _run(lambda s: post_once(s, _dead_url() + "/generate", {}, 5, "x"))
    assert refused.value.unreachable


def test_pool_round_robin_takes_servers_in_turn():
    pool = ServerPool(["http://a", "http://b/", "http://c"], "round_robin")
    picks = [pool.acquire() for _ in range(6)]
    assert picks == ["http://a", "http://b", "http://c"] * 2


def test_pool_least_outstanding_picks_the_least_busy_and_skips_down_servers():
    pool = ServerPool(["http://a", "http://b"])
    assert [pool.acquire() for _ in range(3)] == ["http://a", "http://b", "http://a"]
    pool.release("http://a")
    pool.release("http://a")
    assert pool.acquire() == "http://a"  # a: 1 outstanding, b: 1 -> the first on ties
    pool.down.add("http://a")
    assert [pool.acquire() for _ in range(3)] == ["http://b"] * 3
    pool.down.add("http://b")
    assert pool.all_down()


def test_generate_over_a_pool_retries_on_another_server_when_one_is_down():
    with FakeSGLang() as alive:
        pool = ServerPool([_dead_url(), alive.url], "round_robin")
        answers = [_run(lambda s, k=k: generate(s, pool, [k], f"r{k}", {}, FAST))
                   for k in range(4)]
    assert all(a["output_ids"] == fake_output([k], 128)[0] for k, a in enumerate(answers))
    assert sum(pool.sent.values()) >= 6  # refused attempts went to the dead one first


def test_wait_ready_returns_model_info_and_times_out_on_a_dead_server():
    with FakeSGLang() as server:
        answer = _run(lambda s: wait_ready(s, server.url, timeout_s=5, poll_s=0.05))
        assert answer["model_path"] == "fake"
        assert _run(lambda s: get_server_info(s, server.url))["disable_radix_cache"] is True
    with pytest.raises(ServerError, match="not ready after"):
        _run(lambda s: wait_ready(s, _dead_url(), timeout_s=0.3, poll_s=0.1))


def test_wait_ready_raises_at_once_when_the_watched_process_exits():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    t0 = time.monotonic()
    with pytest.raises(ServerExitedError, match="status 3"):
        _run(lambda s: wait_ready(s, _dead_url(), timeout_s=60, poll_s=0.05, process=proc))
    assert time.monotonic() - t0 < 10  # did not wait out the 60 s timeout


def test_wait_ready_accepts_any_http_status_when_asked():
    with FakeSGLang() as server:
        assert _run(lambda s: wait_ready(s, server.url, ("/no-such-path",), timeout_s=5,
                                         poll_s=0.05, any_status=True)) == {}
        with pytest.raises(ServerError, match="not ready after"):
            _run(lambda s: wait_ready(s, server.url, ("/no-such-path",), timeout_s=0.2,
                                      poll_s=0.05))


def test_make_session_allows_the_requested_concurrency():
    async def go():
        async with make_session(200) as session:
            return session.connector.limit, session.connector.limit_per_host

    assert asyncio.run(go()) == (200, 200)



# ---------------------------------------------------------------- servers that are not the API


async def _serving(routes: dict, client):
    """Serve `routes` ({path: (status, body, content type)}) on a loopback port while
    `client(session, url)` runs; its result."""
    from aiohttp import web

    app = web.Application()
    for path, (status, body, ctype) in routes.items():
        app.router.add_get(path, lambda r, s=status, b=body, t=ctype:
                           web.Response(status=s, text=b, content_type=t))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with make_session(4) as session:
            return await client(session, url)
    finally:
        await runner.cleanup()


PAGE = (200, "<!DOCTYPE html><html><body>Jupyter</body></html>", "text/html")


@pytest.mark.parametrize("body", [PAGE, (200, "[1, 2]", "application/json"),
                                  (200, '{"cut": ', "application/json")])
def test_get_json_names_the_url_and_what_came_when_a_200_is_not_a_json_object(body):
    with pytest.raises(NotJSONError, match=r"/server_info answered HTTP 200 with .*port"):
        asyncio.run(_serving({"/server_info": body},
                             lambda s, url: get_server_info(s, url)))


def test_wait_ready_stops_at_once_when_the_url_serves_a_web_page():
    t0 = time.monotonic()
    with pytest.raises(NotJSONError, match="HTML page"):
        asyncio.run(_serving({"/model_info": PAGE},
                             lambda s, url: wait_ready(s, url, timeout_s=30, poll_s=0.05)))
    assert time.monotonic() - t0 < 10  # not the 30 s of a server still loading


@pytest.mark.parametrize("models", [{}, {"data": []}, {"data": "m"}, {"data": [{"name": "m"}]},
                                    {"data": [None]}, {"data": [{"id": ""}]}])
def test_served_model_refuses_a_model_list_without_a_model_id(models):
    with pytest.raises(ServerError, match=r"http://h/v1/models lists no model id"):
        served_model(models, "http://h")
    assert served_model({"data": [{"id": "m"}, {"id": "n"}]}, "http://h") == "m"


@pytest.mark.parametrize("flag,value", [("pp_size", "2"), ("disable_radix_cache", "false"),
                                        ("speculative_num_steps", [3]), ("pp_size", True),
                                        ("speculative_draft_model_path", 7)])
def test_get_server_info_refuses_a_flag_not_of_sglangs_type(flag, value):
    body = (200, json.dumps({"pp_size": 1, "disable_radix_cache": True, flag: value}),
            "application/json")
    with pytest.raises(ServerError, match=rf"/server_info: {flag} .*not of the types"):
        asyncio.run(_serving({"/server_info": body}, lambda s, url: get_server_info(s, url)))
    good = (200, '{"pp_size": 1, "disable_radix_cache": true, "version": null}',
            "application/json")
    assert asyncio.run(_serving({"/server_info": good},
                                lambda s, url: get_server_info(s, url)))["pp_size"] == 1
