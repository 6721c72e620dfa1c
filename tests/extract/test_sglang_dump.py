"""Tests of eagle3/extract/sglang_dump.py, driven by fake SGLang ForwardBatch objects (no SGLang needed).

Each request has reference states for its whole prompt; a forward pass carries slices of them
(and padded rows of garbage), and the dump files must equal the reference slices exactly.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from eagle3.extract import sglang_dump
from eagle3.extract.sglang_dump import DumpConfig, DumpError

H = 8  # hidden size of the fake target
CAPTURE = [2, 30, 58]


class ForwardMode(enum.IntEnum):
    """Mirror of SGLang's enum (0.5.23 order), including its broad `is_extend`."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)


def reference(rid: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-request states: aux [T, 3H] and final [T, H], bf16."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)))
    aux = torch.randn(num_tokens, 3 * H, generator=gen).to(torch.bfloat16)
    final = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    return aux, final


def reference_ids(rid: str, num_tokens: int) -> torch.Tensor:
    """Deterministic per-request prompt: int64 [T]."""
    gen = torch.Generator().manual_seed(sum(map(ord, rid)) + 1)
    return torch.randint(0, 1000, (num_tokens,), generator=gen)


def forward_pass(chunks, mode=ForwardMode.EXTEND, pad_rows=0, packed=False, totals=None):
    """A fake ForwardBatch plus the model output for `chunks` = [(rid, prefix, num_rows)].

    The states come from `reference(rid, totals[rid])`; padded rows are garbage (1e4). With
    `packed=False` the aux states are a list of 3 [rows, H] tensors (SGLang <= 0.5.16).
    """
    totals = totals or {}
    aux_rows, final_rows, positions, ids = [], [], [], []
    for rid, prefix, num_rows in chunks:
        aux, final = reference(rid, totals.get(rid, prefix + num_rows))
        ids.append(reference_ids(rid, totals.get(rid, prefix + num_rows))[prefix:prefix + num_rows])
        aux_rows.append(aux[prefix:prefix + num_rows])
        final_rows.append(final[prefix:prefix + num_rows])
        positions.append(torch.arange(prefix, prefix + num_rows))
    aux_rows.append(torch.full((pad_rows, 3 * H), 1e4, dtype=torch.bfloat16))
    final_rows.append(torch.full((pad_rows, H), 1e4, dtype=torch.bfloat16))
    lens = [n for _, _, n in chunks]
    batch = SimpleNamespace(
        forward_mode=mode,
        input_ids=torch.cat(ids + [torch.zeros(pad_rows, dtype=torch.long)]),
        rids=[rid for rid, _, _ in chunks],
        extend_start_loc=torch.tensor([sum(lens[:j]) for j in range(len(lens))]),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[prefix for _, prefix, _ in chunks],
        seq_lens_cpu=torch.tensor([prefix + n for _, prefix, n in chunks]),
        positions=torch.cat(positions + [torch.zeros(pad_rows, dtype=torch.long)]),
    )
    aux_all, final_all = torch.cat(aux_rows), torch.cat(final_rows)
    aux_out = aux_all if packed else list(aux_all.split(H, dim=-1))
    return batch, final_all, aux_out


@pytest.fixture
def config(tmp_path):
    return DumpConfig(dump_dir=tmp_path / "dump", tp_rank=0, rid_prefix="eagle3-")


def run(config, chunks, **kwargs):
    config.dump_dir.mkdir(exist_ok=True)
    batch, final, aux = forward_pass(chunks, **kwargs)
    return sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE)


def assert_matches_reference(config, rid, num_tokens):
    data = sglang_dump.load_dump(sglang_dump.dump_file_path(config.dump_dir, rid))
    aux, final = reference(rid, num_tokens)
    assert set(data) == {"format", "version", "rid", "num_tokens", "input_ids", "capture_layers",
                         "aux_hidden_states", "final_hidden_states"} == set(sglang_dump.DUMP_KEYS)
    assert (data["rid"], data["num_tokens"], data["capture_layers"]) == (rid, num_tokens, CAPTURE)
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
    assert dump_names(config) == ["eagle3-a.pt", "eagle3-b.pt", "eagle3-c.pt"]
    for rid, _, num_rows in chunks:
        assert_matches_reference(config, rid, num_rows)


def test_dump_forward_pass_reassembles_request_when_prefill_is_split_over_three_chunks(config):
    totals = {"eagle3-long": 11, "eagle3-x": 4, "eagle3-y": 3, "eagle3-z": 2}
    run(config, [("eagle3-x", 0, 4), ("eagle3-long", 0, 3)], totals=totals, pad_rows=1)
    run(config, [("eagle3-x", 4, 1)], mode=ForwardMode.DECODE, totals={"eagle3-x": 5})
    run(config, [("eagle3-long", 3, 5), ("eagle3-y", 0, 3)], totals=totals, pad_rows=2)
    run(config, [("eagle3-z", 0, 2), ("eagle3-long", 8, 3)], totals=totals, packed=True)
    assert dump_names(config) == ["eagle3-long.pt", "eagle3-x.pt", "eagle3-y.pt", "eagle3-z.pt"]
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
    assert dump_names(config) == ["eagle3-a.pt"]
    no_prefix = DumpConfig(dump_dir=tmp_path / "all", tp_rank=0, rid_prefix="")
    run(no_prefix, [(warmup, 0, 3), (health, 0, 2)])
    assert dump_names(no_prefix) == [f"{warmup}.pt"]


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

    def full_disk(obj, path):
        open(path, "wb").close()  # leave a temp file behind, as a real partial write would
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sglang_dump.torch, "save", full_disk)
    batch, final, aux = forward_pass([("eagle3-a", 0, 3), ("eagle3-b", 0, 2)])
    model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=CAPTURE))
    with caplog.at_level(logging.ERROR):
        assert sglang_dump.maybe_dump(model, batch, final, aux) is None
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


def test_ensure_dump_dir_creates_private_directory_when_missing(tmp_path):
    old_umask = os.umask(0)
    try:
        sglang_dump.ensure_dump_dir(tmp_path / "a" / "dump")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "a" / "dump").stat().st_mode & 0o777 == 0o700


def test_dump_file_path_stays_in_dump_dir_when_rid_has_separators(tmp_path):
    path = sglang_dump.dump_file_path(tmp_path, "eagle3-ultrachat/../x 1")
    assert path.parent == tmp_path and path.name == "eagle3-ultrachat%2F..%2Fx%201.pt"
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


def test_load_dump_refuses_version_1_file_naming_the_restart_when_it_has_no_input_ids(tmp_path):
    aux, final = reference("eagle3-a", 3)
    old = {"format": sglang_dump.DUMP_FORMAT, "version": 1, "rid": "eagle3-a", "num_tokens": 3,
           "capture_layers": CAPTURE, "aux_hidden_states": aux, "final_hidden_states": final}
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(sglang_dump.OldDumpError, match=r"v1 file.*input_ids.*Restart"):
        sglang_dump.load_dump(tmp_path / "old.pt")
    torch.save({**old, "version": 3}, tmp_path / "new.pt")  # newer: not an OldDumpError
    with pytest.raises(DumpError, match="version 3") as e:
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
