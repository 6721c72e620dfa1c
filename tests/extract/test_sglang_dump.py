"""Tests of eagle3/extract/sglang_dump.py, driven by fake SGLang ForwardBatch objects (no SGLang
needed: tests/dump_helpers.py).

Each request has reference states for its whole prompt; a forward pass carries slices of them
(and padded rows of garbage), and the dump files must equal the reference slices exactly.
"""

from __future__ import annotations

import errno
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from dump_helpers import CAPTURE, ForwardMode, H, forward_pass, reference, reference_ids

from eagle3.extract import dump_file, sglang_dump
from eagle3.extract.sglang_dump import DumpConfig, DumpError


@pytest.fixture
def config(tmp_path):
    yield DumpConfig(dump_dir=tmp_path / "dump", tp_rank=0, rid_prefix="eagle3-")
    sglang_dump.close_writers()  # the writer threads maybe_dump started


def run(config, chunks, **kwargs):
    config.dump_dir.mkdir(exist_ok=True)
    batch, final, aux = forward_pass(chunks, **kwargs)
    return sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE)


def assert_matches_reference(config, rid, num_tokens):
    data = sglang_dump.load_dump(sglang_dump.dump_file_path(config.dump_dir, rid))
    aux, final = reference(rid, num_tokens)
    assert set(data) == {"format", "version", "rid", "num_tokens", "input_ids", "capture_layers",
                         "layout", "aux_hidden_states", "final_hidden_states"} == set(
                             sglang_dump.DUMP_KEYS)
    assert (data["rid"], data["num_tokens"], data["capture_layers"]) == (rid, num_tokens, CAPTURE)
    assert (data["format"], data["version"], data["layout"]) == ("eagle3-sglang-dump", 3, "bf16")
    assert data["input_ids"].dtype == torch.int64
    assert torch.equal(data["input_ids"], reference_ids(rid, num_tokens))  # every chunk's ids
    assert data["aux_hidden_states"].dtype == data["final_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(data["aux_hidden_states"], aux)
    assert torch.equal(data["final_hidden_states"], final)


def dump_names(config):
    return sorted(path.name for path in config.dump_dir.iterdir())


@pytest.mark.parametrize("packed", [False, True], ids=["aux_list", "aux_packed"])
def test_dump_forward_pass_writes_one_file_per_request_when_pass_holds_several(config, packed):
    chunks = [("eagle3-a", 0, 5), ("eagle3-b", 0, 1), ("eagle3-c", 0, 7)]
    written = run(config, chunks, pad_rows=3, packed=packed)
    assert len(written) == 3
    assert dump_names(config) == ["eagle3-a.safetensors", "eagle3-b.safetensors",
                                  "eagle3-c.safetensors"]
    for rid, _, num_rows in chunks:
        assert_matches_reference(config, rid, num_rows)


def test_dump_forward_pass_reassembles_request_when_prefill_is_split_over_three_chunks(config):
    totals = {"eagle3-long": 11, "eagle3-x": 4, "eagle3-y": 3, "eagle3-z": 2}
    run(config, [("eagle3-x", 0, 4), ("eagle3-long", 0, 3)], totals=totals, pad_rows=1)
    run(config, [("eagle3-x", 4, 1)], mode=ForwardMode.DECODE, totals={"eagle3-x": 5})
    run(config, [("eagle3-long", 3, 5), ("eagle3-y", 0, 3)], totals=totals, pad_rows=2)
    run(config, [("eagle3-z", 0, 2), ("eagle3-long", 8, 3)], totals=totals, packed=True)
    assert dump_names(config) == [f"eagle3-{r}.safetensors" for r in ("long", "x", "y", "z")]
    for rid, total in totals.items():
        assert_matches_reference(config, rid, total)


def test_dump_forward_pass_writes_nothing_when_tp_rank_is_not_zero(tmp_path):
    config = DumpConfig(dump_dir=tmp_path / "dump", tp_rank=1)
    assert run(config, [("eagle3-a", 0, 4)]) == []
    assert dump_names(config) == []


@pytest.mark.parametrize("mode", [m for m in ForwardMode if m != ForwardMode.EXTEND],
                         ids=lambda m: m.name)
def test_dump_forward_pass_writes_nothing_when_mode_is_not_extend(config, mode):
    assert run(config, [("eagle3-a", 0, 4), ("eagle3-b", 3, 1)], mode=mode) == []
    assert dump_names(config) == []


def test_dump_forward_pass_ignores_request_when_rid_is_warmup_or_health_check(config, tmp_path):
    warmup, health = "9f1c2d3e4b5a69788796a5b4c3d2e1f0", "HEALTH_CHECK_1764440000.123"
    run(config, [(warmup, 0, 3), (health, 0, 2), ("eagle3-a", 0, 4)])
    assert dump_names(config) == ["eagle3-a.safetensors"]
    no_prefix = DumpConfig(dump_dir=tmp_path / "all", tp_rank=0, rid_prefix="")
    run(no_prefix, [(warmup, 0, 3), (health, 0, 2)])
    assert dump_names(no_prefix) == [f"{warmup}.safetensors"]


def test_dump_forward_pass_drops_request_when_chunk_does_not_continue_the_file(config, caplog):
    run(config, [("eagle3-a", 0, 4)], totals={"eagle3-a": 9})
    with caplog.at_level(logging.ERROR):
        run(config, [("eagle3-a", 6, 3), ("eagle3-b", 2, 2)], totals={"eagle3-a": 9})
    assert dump_names(config) == []  # the stale 4-token file is gone, b never had its start
    assert "disable-radix-cache" in caplog.text


def test_dump_forward_pass_raises_when_states_have_fewer_rows_than_tokens(config):
    batch, final, aux = forward_pass([("eagle3-a", 0, 6)])
    with pytest.raises(DumpError, match="do not fit"):
        sglang_dump.dump_forward_pass(config, batch, final[:4], aux, CAPTURE)


def test_dump_forward_pass_writes_only_own_rows_when_slices_share_storage(config):
    run(config, [("eagle3-a", 0, 2), ("eagle3-b", 0, 300)])
    size = sglang_dump.dump_file_path(config.dump_dir, "eagle3-a").stat().st_size
    assert size < 300 * 4 * H * 2  # far less than the whole pass: not the shared buffer


def test_maybe_dump_logs_and_keeps_serving_when_disk_is_full(config, monkeypatch, caplog):
    config.dump_dir.mkdir()
    monkeypatch.setattr(sglang_dump, "server_config", lambda: config)

    def full_disk(tensors, path, metadata=None):
        open(path, "wb").close()  # leave a temp file behind, as a real partial write would
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dump_file, "write_safetensors", full_disk)
    batch, final, aux = forward_pass([("eagle3-a", 0, 3), ("eagle3-b", 0, 2)])
    model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=CAPTURE))
    with caplog.at_level(logging.ERROR):
        assert sglang_dump.maybe_dump(model, batch, final, aux) is None
        assert sglang_dump.writer_for(config).flush(timeout_s=30)  # the writer thread's errors
    assert sglang_dump.writer_for(config).snapshot()["jobs_failed"] == 2
    assert sglang_dump.writer_for(config).ring.in_use() == 0  # the failed jobs' slots came back
    assert dump_names(config) == []  # no final file, no temp file
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("No space left on device" in e for e in errors)


def test_maybe_dump_warns_and_returns_when_pass_has_no_rids(config, monkeypatch, caplog):
    monkeypatch.setattr(sglang_dump, "server_config", lambda: config)
    batch, final, aux = forward_pass([("eagle3-a", 0, 3)])
    batch.rids = None  # as in a prefill CUDA graph replay of SGLang 0.5.10
    model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=CAPTURE))
    with caplog.at_level(logging.WARNING):
        sglang_dump.maybe_dump(model, batch, final, aux)
    assert "without rids" in caplog.text
    assert not config.dump_dir.exists()


def test_config_from_env_reads_dir_and_prefix_when_set(tmp_path):
    env = {sglang_dump.ENV_DUMP_DIR: str(tmp_path), sglang_dump.ENV_RID_PREFIX: "run7-"}
    assert sglang_dump.config_from_env(env, 3) == DumpConfig(tmp_path, 3, "run7-")
    assert sglang_dump.config_from_env({sglang_dump.ENV_DUMP_DIR: "d"}, 0).rid_prefix == "eagle3-"
    with pytest.raises(DumpError, match=sglang_dump.ENV_DUMP_DIR):
        sglang_dump.config_from_env({}, 0)


def test_config_from_env_reads_layout_queue_bound_and_stats_file_when_set(tmp_path):
    env = {sglang_dump.ENV_DUMP_DIR: str(tmp_path), sglang_dump.ENV_LAYOUT: "fp8",
           sglang_dump.ENV_MAX_PENDING_MB: "64", sglang_dump.ENV_STATS_FILE: "/x/stats.json"}
    config = sglang_dump.config_from_env(env, 0)
    assert (config.layout, config.max_pending_bytes) == ("fp8", 64 << 20)
    assert config.stats_file == sglang_dump.Path("/x/stats.json")
    default = sglang_dump.config_from_env({sglang_dump.ENV_DUMP_DIR: "d"}, 0)
    assert (default.layout, default.max_pending_bytes, default.stats_file,
            default.fp8_on_gpu) == ("bf16", 2048 << 20, None, False)
    assert sglang_dump.config_from_env({**env, sglang_dump.ENV_FP8_ON_GPU: "1"}, 0).fp8_on_gpu
    for var, value in ((sglang_dump.ENV_LAYOUT, "fp4"), (sglang_dump.ENV_MAX_PENDING_MB, "0"),
                       (sglang_dump.ENV_MAX_PENDING_MB, "1.5"),
                       (sglang_dump.ENV_FP8_ON_GPU, "yes")):
        with pytest.raises(DumpError, match=var):
            sglang_dump.config_from_env({sglang_dump.ENV_DUMP_DIR: "d", var: value}, 0)


def test_ensure_dump_dir_creates_private_directory_when_missing(tmp_path):
    old_umask = os.umask(0)
    try:
        sglang_dump.ensure_dump_dir(tmp_path / "a" / "dump")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "a" / "dump").stat().st_mode & 0o777 == 0o700


def test_dump_file_path_stays_in_dump_dir_when_rid_has_separators(tmp_path):
    path = sglang_dump.dump_file_path(tmp_path, "eagle3-ultrachat/../x 1")
    assert path.parent == tmp_path and path.name == "eagle3-ultrachat%2F..%2Fx%201.safetensors"
    assert sglang_dump.dump_file_path(tmp_path, ".x").name == "%2Ex.safetensors"  # no dot name
    long_a = sglang_dump.dump_file_path(tmp_path, "eagle3-" + "a" * 300)
    long_b = sglang_dump.dump_file_path(tmp_path, "eagle3-" + "a" * 299 + "b")
    assert long_a != long_b and len(long_a.name) < 255
    with pytest.raises(DumpError):
        sglang_dump.dump_file_path(tmp_path, "")


def test_capture_argument_is_one_less_when_captures_start_at_two():
    assert sglang_dump.default_capture_layers(61) == [2, 30, 58]
    assert sglang_dump.capture_argument([2, 30, 58]) == [1, 29, 57]
    with pytest.raises(sglang_dump.CaptureSetupError):
        sglang_dump.capture_argument([3, 30, 58])


def test_enable_capture_raises_when_sglang_captures_nothing(monkeypatch, config):
    monkeypatch.setattr(sglang_dump, "server_config", lambda: config)
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=61),
                            model=SimpleNamespace(layers_to_capture=[]),
                            capture_aux_hidden_states=False,
                            set_eagle3_layers_to_capture=lambda ids: None)  # a non-last PP rank
    with pytest.raises(sglang_dump.CaptureSetupError, match="pp-size"):
        sglang_dump.enable_capture(model)


def test_default_capture_layers_agree_with_the_library_when_loaded_inside_sglang():
    from eagle3.core import target
    from eagle3.extract import sglang_dump

    for num_layers in range(7, 129):  # below 7 layers the library refuses: no 3 distinct
        assert (sglang_dump.default_capture_layers(num_layers)
                == target.default_capture_layers(num_layers)), num_layers


@pytest.mark.parametrize("version", [1, 2])
def test_load_dump_refuses_torch_file_of_version_1_or_2_naming_the_restart(tmp_path, version):
    aux, final = reference("eagle3-a", 3)
    old = {"format": sglang_dump.DUMP_FORMAT, "version": version, "rid": "eagle3-a",
           "num_tokens": 3, "capture_layers": CAPTURE, "aux_hidden_states": aux,
           "final_hidden_states": final}
    if version == 2:
        old["input_ids"] = reference_ids("eagle3-a", 3)
    path = sglang_dump.legacy_dump_path(tmp_path, "eagle3-a")
    torch.save(old, path)
    with pytest.raises(sglang_dump.OldDumpError, match=rf"v{version} file.*Restart"):
        sglang_dump.load_dump(path)
    torch.save({**old, "version": 3}, tmp_path / "new.pt")  # v3 in a zip: not a dump at all
    with pytest.raises(DumpError, match="not an eagle3-sglang-dump v3") as e:
        sglang_dump.load_dump(tmp_path / "new.pt")
    assert not isinstance(e.value, sglang_dump.OldDumpError)


def test_maybe_dump_writes_nothing_when_pass_has_no_input_ids_for_its_rows(config, monkeypatch,
                                                                          caplog):
    monkeypatch.setattr(sglang_dump, "server_config", lambda: config)
    config.dump_dir.mkdir()
    model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=CAPTURE))
    for ids in (None, torch.zeros(2, dtype=torch.long)):  # absent, or fewer than the 3 rows
        batch, final, aux = forward_pass([("eagle3-a", 0, 3)])
        batch.input_ids = ids
        with caplog.at_level(logging.WARNING):
            sglang_dump.maybe_dump(model, batch, final, aux)
        assert dump_names(config) == []
    assert "input_ids" in caplog.text


def test_dump_forward_pass_stores_int64_ids_when_the_pass_holds_int32_ids(config):
    batch, final, aux = forward_pass([("eagle3-a", 0, 5)], pad_rows=2)
    batch.input_ids = batch.input_ids.to(torch.int32)
    config.dump_dir.mkdir()
    sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE)
    assert_matches_reference(config, "eagle3-a", 5)
