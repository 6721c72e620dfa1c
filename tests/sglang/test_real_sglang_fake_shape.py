"""The stand-in server the fault tests use (eagle3.testing.fake_sglang) answers in the real
SGLang's shape: for the same `/generate` request (cut by the length limit, or stopped by a stop
token) the same keys of the answer and of `meta_info` with values of the same types, the
same `finish_reason` form, `meta_info.id` the rid, and output ids that hold the matched stop
token the same way; its `/server_info` and `/model_info` keys exist in the real answers."""

from __future__ import annotations

import pytest
from sglang_helpers import DEEPSEEK_TARGETS, get_json, post_generate

from eagle3.testing.fake_sglang import FakeSGLang


def _shape(value):
    """Keys and value types, recursively for dicts (what a client's parsing depends on)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


def _assert_fake_within_real(fake: dict, real: dict, where: str) -> None:
    """Every key the fake answers, the real server answers too, with a value of the same type."""
    for key, value in fake.items():
        assert key in real, f"{where}: the fake answers {key!r}, the real server does not"
        if isinstance(value, dict):
            _assert_fake_within_real(value, real[key], f"{where}.{key}")
        else:
            assert type(value) is type(real[key]), (where, key, value, real[key])


# The answer's shape does not depend on the model: the DeepSeek servers suffice.
@pytest.mark.sglang_targets(*DEEPSEEK_TARGETS)
def test_fake_sglang_answers_generate_in_the_real_servers_shape(sglang_server):
    prompt = [3, 5, 100, 200, 7]
    real_plain = post_generate(sglang_server.url, {"input_ids": prompt, "rid": "shape-0",
                                           "sampling_params": {"max_new_tokens": 6,
                                                               "temperature": 0}})
    stop_id = real_plain["output_ids"][2]  # a stop token the greedy reply meets third
    with FakeSGLang(eos_id=stop_id) as fake:
        for n, params in enumerate([{"max_new_tokens": 1, "temperature": 0},
                                    {"max_new_tokens": 6, "temperature": 0,
                                     "stop_token_ids": [stop_id]}]):
            body = {"input_ids": prompt, "rid": f"shape-{n + 1}", "sampling_params": params}
            real = post_generate(sglang_server.url, body)
            # the fake's answer is a function of the prompt: find one that ends the same way
            fake_ans = post_generate(fake.url, body)
            want_kind = real["meta_info"]["finish_reason"]["type"]
            if fake_ans["meta_info"]["finish_reason"]["type"] != want_kind:
                fake_ans = next(a for a in (post_generate(fake.url, {**body, "input_ids": prompt + [i]})
                                            for i in range(400))
                                if a["meta_info"]["finish_reason"]["type"] == want_kind)
            _assert_fake_within_real(fake_ans, real, f"/generate {params}")
            for answer in (real, fake_ans):
                meta = answer["meta_info"]
                assert meta["id"] == body["rid"]
                assert meta["completion_tokens"] == len(answer["output_ids"])
                finish = meta["finish_reason"]
                if finish["type"] == "length":
                    assert finish["length"] == params["max_new_tokens"]
                else:
                    assert finish == {"type": "stop", "matched": stop_id}
                    assert answer["output_ids"][-1] == stop_id  # the stop token is kept
            assert real["output_ids"] == real_plain["output_ids"][:len(real["output_ids"])]
        for path in ("/server_info", "/model_info"):
            _assert_fake_within_real(get_json(fake.url, path), get_json(sglang_server.url, path), path)
