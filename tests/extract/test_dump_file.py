"""Tests of eagle3/extract/dump_file.py, dump format version 3: a safetensors file any
safetensors reader opens, byte for byte what `safetensors.torch.save_file` writes (its metadata
in key order), tensors given in parts or as views of one buffer; `load_dump` reads only a whole file as written (truncated, padded,
announcing a huge header, or of another format: DumpError; versions 1 and 2: OldDumpError);
`peek_num_tokens` reads the header alone, never blocking."""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import torch

from eagle3.extract import dump_file
from eagle3.extract.dump_file import DumpError


def write(path, **tensors) -> dict:
    gen = torch.Generator().manual_seed(0)
    record = {"rid": "eagle3-a", "num_tokens": 3, "capture_layers": [2, 30, 58],
              "layout": "bf16", "input_ids": torch.arange(3),
              "aux_hidden_states": torch.randn(3, 12, generator=gen).to(torch.bfloat16),
              "final_hidden_states": torch.randn(3, 4, generator=gen).to(torch.bfloat16),
              **tensors}
    dump_file.save_dump(record, path)
    return record


def test_save_dump_writes_a_safetensors_file_with_the_format_metadata(tmp_path):
    path = dump_file.dump_file_path(tmp_path, "eagle3-a")
    record = write(path)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "eagle3-sglang-dump", "version": "3",
                                "rid": "eagle3-a", "num_tokens": "3",
                                "capture_layers": "[2, 30, 58]", "layout": "bf16"}
        assert set(f.keys()) == {"input_ids", "aux_hidden_states", "final_hidden_states"}
    data = dump_file.load_dump(path)
    assert set(data) == set(dump_file.DUMP_KEYS) and data["version"] == 3
    for key in ("input_ids", "aux_hidden_states", "final_hidden_states"):
        assert torch.equal(data[key], record[key]) and data[key].dtype == record[key].dtype
    assert os.listdir(tmp_path) == [path.name]  # no temp file left
    assert dump_file.peek_num_tokens(path) == 3


@pytest.mark.parametrize("damage,words", [
    (lambda b: b[:len(b) - 5], "truncated"),
    (lambda b: b + b"\0", "bytes after"),
    (lambda b: (10 ** 9).to_bytes(8, "little") + b[8:], "header of 1,000,000,000"),
    (lambda b: b[:8] + b"x" + b[9:], "unreadable header"),
    (lambda b: b[:3], "shorter than"),
])
def test_load_dump_refuses_a_damaged_file(tmp_path, damage, words):
    path = tmp_path / "x.safetensors"
    write(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DumpError, match=words):
        dump_file.load_dump(path)


def test_load_dump_refuses_another_safetensors_file_and_a_newer_version(tmp_path):
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    with pytest.raises(DumpError, match="no string metadata"):
        dump_file.load_dump(tmp_path / "w.safetensors")
    path = tmp_path / "new.safetensors"
    write(path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"version":"3"', b'"version":"4"')
    path.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(DumpError, match="version '4'") as e:
        dump_file.load_dump(path)
    assert not isinstance(e.value, dump_file.OldDumpError)


def test_peek_num_tokens_is_none_when_path_is_not_a_whole_v3_header(tmp_path):
    assert dump_file.peek_num_tokens(tmp_path / "missing") is None
    os.mkfifo(tmp_path / "fifo")
    assert dump_file.peek_num_tokens(tmp_path / "fifo") is None  # no writer: never blocks
    torch.save({"format": "eagle3-sglang-dump", "version": 2}, tmp_path / "old.pt")
    assert dump_file.peek_num_tokens(tmp_path / "old.pt") is None
    (tmp_path / "junk").write_bytes(b"\x05" + b"\0" * 7 + b"{}")
    assert dump_file.peek_num_tokens(tmp_path / "junk") is None


def test_remove_stale_temp_files_removes_only_the_temp_files_of_dead_processes(tmp_path):
    dead = 2 ** 22 + 12345  # above Linux's pid_max default: no such process
    live = os.getppid()
    for name in (f".eagle3-a.safetensors.{dead}.tmp", f".eagle3-b.safetensors.{live}.tmp",
                 "eagle3-c.safetensors", ".eagle3_writer_stats.json"):
        (tmp_path / name).write_bytes(b"x")
    assert dump_file.remove_stale_temp_files(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == [f".eagle3-b.safetensors.{live}.tmp",
                                            ".eagle3_writer_stats.json", "eagle3-c.safetensors"]


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
def test_save_dump_writes_safetensors_own_bytes_with_the_metadata_in_key_order(tmp_path, layout):
    # save_file orders __metadata__ by its hash map (a new order each process); all else is
    # fixed: the tensors by dtype alignment then name, compact JSON, space padding to 8.
    import safetensors.torch

    gen = torch.Generator().manual_seed(1)
    tensors = {"input_ids": torch.randint(0, 10**6, (5,), generator=gen),
               "final_hidden_states": torch.randn(5, 4, generator=gen).to(torch.bfloat16)}
    aux = torch.randn(5, 12, generator=gen)
    if layout == "fp8":
        tensors.update(aux_hidden_states=aux.to(torch.float8_e4m3fn),
                       aux_hidden_states_scale=torch.rand(5, 3, generator=gen))
    else:
        tensors["aux_hidden_states"] = aux.to(torch.bfloat16)
    rid = 'eagle3-ü "q" \\ \x01\x1f\x7f\u2028/x'  # what JSON escapes, and what it leaves
    record = {"rid": rid, "num_tokens": 5, "capture_layers": [2, 30, 58], "layout": layout,
              **tensors}
    ours = tmp_path / "ours.safetensors"
    dump_file.save_dump(record, ours)
    theirs = tmp_path / "theirs.safetensors"
    metadata = {"rid": rid, "num_tokens": "5", "capture_layers": "[2, 30, 58]",
                "layout": layout, "format": "eagle3-sglang-dump", "version": "3"}
    safetensors.torch.save_file(tensors, theirs, metadata=metadata)
    raw = theirs.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (n - len(head))
    assert ours.read_bytes() == raw[:8] + head + raw[8 + n:]


def test_save_dump_joins_parts_and_takes_views_of_one_buffer(tmp_path):
    buffer = torch.randn(400).to(torch.bfloat16)  # one storage for every tensor
    ids = buffer.view(torch.int64)[:6]
    aux_a, aux_b = buffer[100:136].view(3, 12), buffer[200:236].view(3, 12)
    final = buffer[300:324].view(6, 4)
    path = tmp_path / "x.safetensors"
    dump_file.save_dump({"rid": "eagle3-a", "num_tokens": 6, "capture_layers": [2, 30, 58],
                         "layout": "bf16", "input_ids": ids,
                         "aux_hidden_states": [aux_a, aux_b],
                         "final_hidden_states": [final[:2], final[2:]]}, path)
    data = dump_file.load_dump(path)
    assert torch.equal(data["input_ids"], ids)
    assert torch.equal(data["aux_hidden_states"], torch.cat([aux_a, aux_b]))
    assert torch.equal(data["final_hidden_states"], final)
    with safetensors.safe_open(str(path), "pt") as f:  # any safetensors reader opens it
        assert torch.equal(f.get_tensor("aux_hidden_states"), torch.cat([aux_a, aux_b]))


def test_save_dump_refuses_parts_of_different_dtypes_or_row_shapes(tmp_path):
    parts = [torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 5, dtype=torch.bfloat16)]
    with pytest.raises(DumpError, match="one row shape"):
        write(tmp_path / "x.safetensors", final_hidden_states=parts)
    assert os.listdir(tmp_path) == []  # no temp file left
