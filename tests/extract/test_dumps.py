"""Tests of eagle3/extract/dumps.py, 02b's reading of a dump: from a format-3 dump (written by
the hook itself, tests/dump_helpers.py passes) 02b writes the `data_<idx>.pt` bytes it wrote from
a format-2 dump of the same states (torch.save of bf16 tensors, split and packed), for every
`--dtype`; an fp8-layout dump gives the bytes of a bf16 dump; an fp8 dump for `--dtype bf16`
stops the run naming the variable and the flag."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from dump_helpers import CAPTURE, H, forward_pass, prefill_schedule, reference, reference_ids

from eagle3.core import hidden_states as hs
from eagle3.extract import sglang_dump
from eagle3.extract.checks import BadStates, pack_checked
from eagle3.extract.dumps import Expected, convert_dump, make_rid
from eagle3.extract.teacher import TeacherHead
from eagle3.extract.writer import ExtractError, record_meta

LENGTHS = [1, 7, 130]  # one token (a [1, K] scale's column is a view), many, several chunks


def record(n: int) -> tuple[dict, str]:
    rec = {"id": f"test/rec {n}", "source": "test",
           "input_ids": None, "loss_mask": [i % 2 for i in range(n)]}
    rid = make_rid("eagle3-", rec["id"], 0)
    rec["input_ids"] = reference_ids(rid, n).tolist()
    return rec, rid


def teacher_for(dtype: str) -> TeacherHead | None:
    if dtype != "fp8-topk":
        return None
    gen = torch.Generator().manual_seed(3)
    lm_head = torch.randn(50, H, generator=gen).to(torch.bfloat16)
    hot = torch.randperm(50, generator=gen)[:16].sort().values
    return TeacherHead(lm_head, hot - torch.arange(16), 4)


def dump_through_the_hook(dump_dir: Path, rid: str, n: int, layout: str) -> Path:
    """The hook's dump of a prompt of `n` tokens, prefilled in chunks of 48 beside another
    request, through the writer thread."""
    config = sglang_dump.DumpConfig(dump_dir, 0, layout=layout)
    dump_dir.mkdir(parents=True, exist_ok=True)
    totals = {rid: n, "eagle3-other": 30}
    writer = sglang_dump.writer_for(config)
    for k, chunks in enumerate(prefill_schedule(totals, 48, 64)):
        batch, final, aux = forward_pass(chunks, pad_rows=k % 3, packed=k % 2 == 0,
                                         totals=totals)
        sglang_dump.dump_forward_pass(config, batch, final, aux, CAPTURE, writer)
    assert writer.flush(timeout_s=60)
    sglang_dump.close_writer(config)
    return sglang_dump.dump_file_path(dump_dir, rid)


def file_from_v2_dump(rec: dict, rid: str, dtype: str, path: Path) -> bytes:
    """What 02b wrote from a format-2 dump of the same states: torch.save / torch.load of the
    bf16 tensors, the aux split in captures, `pack_checked`, `save_with_sha256`."""
    aux, final = reference(rid, len(rec["input_ids"]))
    buffer = io.BytesIO()
    torch.save({"aux_hidden_states": aux, "final_hidden_states": final}, buffer)
    buffer.seek(0)
    v2 = torch.load(buffer, weights_only=True)
    data = pack_checked(rec, list(v2["aux_hidden_states"].split(H, dim=-1)),
                        v2["final_hidden_states"], record_meta(rec, CAPTURE), dtype,
                        teacher_for(dtype))
    hs.save_with_sha256(data, path)
    return path.read_bytes()


def converted(dump: Path, rid: str, rec: dict, dtype: str, out: Path) -> bytes:
    expected = Expected(H, tuple(CAPTURE), out.parent)
    convert_dump(dump, rid, rec, expected, dtype, lambda data: hs.save_with_sha256(data, out),
                 teacher_for(dtype))
    assert not dump.exists()  # picked up
    return out.read_bytes()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", hs.DTYPES)
def test_convert_dump_writes_the_format_2_bytes_when_dump_is_a_bf16_format_3_dump(
        tmp_path, dtype, n):
    rec, rid = record(n)
    dump = dump_through_the_hook(tmp_path / "dump", rid, n, "bf16")
    assert sglang_dump.load_dump(dump)["layout"] == "bf16"
    want = file_from_v2_dump(rec, rid, dtype, tmp_path / "want.pt")
    assert converted(dump, rid, rec, dtype, tmp_path / "got.pt") == want


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", ["fp8", "fp8-all", "fp8-topk"])
def test_convert_dump_writes_the_bf16_dump_bytes_when_dump_is_fp8(tmp_path, dtype, n):
    rec, rid = record(n)
    bf16 = converted(dump_through_the_hook(tmp_path / "bf16", rid, n, "bf16"), rid, rec, dtype,
                     tmp_path / "from_bf16.pt")
    dump = dump_through_the_hook(tmp_path / "fp8", rid, n, "fp8")
    data = sglang_dump.load_dump(dump)
    assert data["layout"] == "fp8" and data["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert data["aux_hidden_states"].nbytes == n * len(CAPTURE) * H  # half the bf16 bytes
    assert data["aux_hidden_states_scale"].shape == (n, len(CAPTURE))
    assert converted(dump, rid, rec, dtype, tmp_path / "from_fp8.pt") == bf16
    assert bf16 == file_from_v2_dump(rec, rid, dtype, tmp_path / "want.pt")


def test_convert_dump_refuses_fp8_dump_naming_variable_and_flag_when_dtype_is_bf16(tmp_path):
    rec, rid = record(7)
    dump = dump_through_the_hook(tmp_path / "dump", rid, 7, "fp8")
    with pytest.raises(ExtractError, match=r"EAGLE3_DUMP_LAYOUT=fp8.*--dtype bf16.*--dtype fp8"):
        converted(dump, rid, rec, "bf16", tmp_path / "got.pt")
    assert not (tmp_path / "got.pt").exists()


def test_convert_dump_skips_record_as_bad_when_fp8_dump_holds_nan(tmp_path):
    rec, rid = record(7)
    dump = dump_through_the_hook(tmp_path / "dump", rid, 7, "bf16")
    data = sglang_dump.load_dump(dump)
    aux = data["aux_hidden_states"].clone()
    aux[2, H + 1] = float("nan")  # token 2 of the second capture
    aux[4, H + 3] = float("inf")
    fp8, scale = sglang_dump._fp8.quantize_captures(aux, len(CAPTURE))
    sglang_dump.save_dump({**data, "layout": "fp8", "aux_hidden_states": fp8,
                           "aux_hidden_states_scale": scale}, dump)
    with pytest.raises(BadStates, match=r"capture layer 30 has NaN/Inf values in 2 of 7 tokens"):
        converted(dump, rid, rec, "fp8", tmp_path / "got.pt")
