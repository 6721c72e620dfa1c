"""Preflight of the two servers 05 compares: a wrong speculative or baseline server is refused,
settings that bias the comparison are warned about."""

from __future__ import annotations

from eagle3.bench.preflight import (
    check_baseline_server,
    check_server_pair,
    check_speculative_server,
    check_streaming,
)
from eagle3.core.presets import draft_fields
from eagle3.draft.export import sglang_config
from eagle3.draft.model import DraftConfig

KIMI = DraftConfig(**draft_fields("kimi-k2.5"), max_position_embeddings=262144)


def kimi_config() -> dict:
    return sglang_config(KIMI)


def errors(problems) -> list[str]:
    return [p.message for p in problems if p.level == "error"]


def test_check_speculative_server_refuses_eagle_when_draft_is_eagle3():
    problems = check_speculative_server({"speculative_algorithm": "EAGLE"}, kimi_config())
    (msg,) = errors(problems)
    assert "--speculative-algorithm EAGLE3" in msg and "collapses to about 1" in msg
    assert check_speculative_server({"speculative_algorithm": "EAGLE3",
                                     "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                     "speculative_num_draft_tokens": 4}, kimi_config()) == []


def test_check_speculative_server_refuses_no_algorithm_and_warns_on_chain_tokens():
    assert "--speculative-algorithm EAGLE3" in errors(check_speculative_server({}, None))[0]
    (warning,) = check_speculative_server({"speculative_algorithm": "EAGLE3",
                                           "speculative_num_steps": 3,
                                           "speculative_eagle_topk": 1,
                                           "speculative_num_draft_tokens": 8})
    assert warning.level == "warning" and "--speculative-num-draft-tokens" in warning.message


def test_check_baseline_server_refuses_a_draft_when_it_should_have_none():
    assert "without --speculative-*" in errors(
        check_baseline_server({"speculative_algorithm": "EAGLE3"}))[0]
    assert check_baseline_server({"speculative_algorithm": None}) == []


def test_check_server_pair_warns_when_servers_differ_in_more_than_the_draft():
    base = {"model_path": "/m", "tp_size": 8, "disable_cuda_graph": False}
    assert check_server_pair(base, {**base, "speculative_algorithm": "EAGLE3"}) == []
    (w,) = check_server_pair(base, {**base, "tp_size": 4, "disable_cuda_graph": True})
    assert w.level == "warning" and "tp_size: 8 vs 4" in w.message
    assert "disable_cuda_graph: False vs True" in w.message


def test_check_speculative_server_warns_when_cuda_graphs_are_off():
    (w,) = check_speculative_server({"speculative_algorithm": "EAGLE3",
                                     "disable_cuda_graph": True}, kimi_config())
    assert w.level == "warning" and "--disable-cuda-graph" in w.message


def test_check_streaming_warns_when_server_streams_cumulative_ids():
    (w,) = check_streaming({"incremental_streaming_output": False})
    assert "--incremental-streaming-output" in w.message
    assert check_streaming({"incremental_streaming_output": True}) == []
