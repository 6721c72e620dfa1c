"""benchmarks/bench_sglang_gpu.py's own pieces, without a GPU or a server: the state comparison
its dump phase reports, the Kimi-width target and MLA draft its kimi phase serves, and the dump
writer's counters, drain and 02b keys that phase records."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config

from eagle3.core.target import default_capture_layers
from eagle3.draft.layers import sglang_capture_layers

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_sglang_gpu",
                                               ROOT / "benchmarks/bench_sglang_gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def _write(folder: Path, states: list[torch.Tensor]) -> None:
    folder.mkdir(parents=True)
    torch.save({"input_ids": torch.arange(states[0].shape[0]), "hidden_states": states},
               folder / "data_0.pt")


def test_compare_states_gives_the_worst_and_mean_relative_l2_error_by_hand(tmp_path):
    ref = [torch.tensor([[3.0, 4.0], [1.0, 0.0]])] * 4
    got = [torch.tensor([[3.0, 4.5], [1.0, 0.0]])] * 3 + [torch.tensor([[3.0, 4.0], [0.0, 1.0]])]
    _write(tmp_path / "a", ref)
    _write(tmp_path / "b", got)
    out = gpu.compare_states(tmp_path / "a", tmp_path / "b")
    # rows: |(0, 0.5)| / 5 = 0.1 and 0; the last state: 0 and |(-1, 1)| / 1 = sqrt(2)
    assert out["files"] == 1 and out["tokens"] == 2
    assert out["worst_rel_l2"] == pytest.approx([0.1, 0.1, 0.1, 2 ** 0.5])
    assert out["mean_rel_l2"] == pytest.approx([0.05, 0.05, 0.05, 2 ** 0.5 / 2])


def test_compare_states_refuses_files_of_other_prompts(tmp_path):
    _write(tmp_path / "a", [torch.ones(2, 2)] * 4)
    _write(tmp_path / "b", [torch.ones(3, 2)] * 4)
    with pytest.raises(AssertionError):
        gpu.compare_states(tmp_path / "a", tmp_path / "b")


def test_kimi_width_target_and_mla_draft_name_the_same_captures(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "run", lambda cmd, log_path, **kw: 0.0)  # no tiny target build
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "tokenizer.json").write_text("{}")
    target = gpu.kimi_target(tmp_path)
    config = json.loads((target / "config.json").read_text())
    hf = DeepseekV3Config(**{k: v for k, v in config.items() if k != "architectures"})
    assert (hf.hidden_size, hf.kv_lora_rank + hf.qk_rope_head_dim, hf.vocab_size) == (
        7168, 576, 163840)
    assert config["rope_parameters"]["factor"] == 1.0 and config["moe_layer_freq"] == 1
    assert (target / "tokenizer.json").exists()
    captures = default_capture_layers(hf.num_hidden_layers)
    draft = json.loads((gpu.mla_draft(target, tmp_path / "draft") / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_layers(ids, "0.5.17") == captures


def _dump_writer_stats(tmp_path, prompts: dict[str, int]) -> Path:
    """The stats file of the real dump writer after one pass per prompt."""
    from dump_helpers import CAPTURE, forward_pass

    from eagle3.extract import sglang_dump

    stats_file = tmp_path / "writer_stats.json"
    config = sglang_dump.DumpConfig(tmp_path / "dumps", 0, stats_file=stats_file)
    config.dump_dir.mkdir()
    writer = sglang_dump.writer_for(config)
    for rid, n in prompts.items():
        sglang_dump.dump_forward_pass(config, *forward_pass([(rid, 0, n)]), CAPTURE, writer)
    sglang_dump.close_writer(config)
    return stats_file


def test_writer_stats_reads_the_dump_writers_counters_once_its_queue_is_empty(tmp_path):
    stats_file = _dump_writer_stats(tmp_path, {"eagle3-a": 5, "eagle3-b": 7})
    got = gpu.writer_stats(stats_file, 12, since=0.0, timeout_s=5)
    assert got["drained"] and got["tokens"] == 12 and got["jobs_written"] == 2
    assert got["bytes_per_token"] == 8 + 2 * 8 + 2 * 3 * 8 and got["max_queue_jobs"] >= 1
    assert {"blocked_s", "max_queue_bytes", "drain_s", "file_bytes"} <= set(got)
    # Fewer tokens than expected and nothing written since: reported, not raised.
    stale = gpu.writer_stats(stats_file, 13, since=time.time() + 60, timeout_s=0.2)
    assert not stale["drained"] and stale["tokens"] == 12
    missing = gpu.writer_stats(tmp_path / "none.json", 1, since=0.0, timeout_s=0.2)
    assert not missing["drained"] and "no stats" in missing["error"]


def test_prefill_dumped_records_prefill_writer_and_drained_rate(tmp_path, monkeypatch):
    # 8 warm-up and 64 timed prompts of 2,048 tokens were dumped, as the kimi phase sends
    stats = {"jobs_submitted": 72, "jobs_written": 72, "jobs_failed": 0, "tokens": 72 * 2048,
             "time": time.time(), "queue_jobs": 0}
    (tmp_path / "s.json").write_text(json.dumps(stats))

    async def fake_prefill(url, n, length, concurrency, vocab, rid_prefix):
        return {"requests": n, "prompt_tokens": n * length, "seconds": 2.0,
                "tokens_per_s": n * length / 2.0}

    monkeypatch.setattr(gpu, "prefill", fake_prefill)
    out: dict = {}
    server = SimpleNamespace(url="http://127.0.0.1:1")
    dumped = gpu.prefill_dumped(out, "dump_on", server, tmp_path, tmp_path / "s.json", 0)
    assert dumped == 72 * 2048
    assert out["prefill_dump_on_2048"]["tokens_per_s"] == 64 * 2048 / 2.0
    assert out["writer_dump_on"]["drained"] and out["writer_dump_on"]["tokens"] == 72 * 2048
    assert out["prefill_dump_on_2048_drained_tokens_per_s"] == pytest.approx(
        64 * 2048 / (2.0 + out["writer_dump_on"]["drain_s"]))
    json.dumps(out)  # what write_json stores


def test_run_02b_keeps_the_keys_of_earlier_results(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gpu, "run", lambda cmd, log_path, **kw: calls.append(cmd) or (
        Path(log_path).write_text("02b log"), 4.0)[1])
    got = gpu.run_02b(tmp_path, tmp_path / "target", SimpleNamespace(url="http://x"),
                      tmp_path / "dumps", "02b")
    assert set(got) == {"02b_tokens", "02b_s", "02b_tokens_per_s", "02b_log_tail", "02b_bytes"}
    assert got["02b_tokens"] == 98 * 2048 and got["02b_tokens_per_s"] == 98 * 2048 / 4.0
    fp8 = gpu.run_02b(tmp_path, tmp_path / "target", SimpleNamespace(url="http://x"),
                      tmp_path / "dumps", "02b_fp8", "--dtype", "fp8")
    assert calls[-1][-2:] == ["--dtype", "fp8"] and "02b_fp8_tokens_per_s" in fp8
