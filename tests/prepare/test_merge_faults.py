"""Merge stage under faults: damaged lines of 01b's tokenized.jsonl (each kind skipped, listed in
`01c_merged/skipped.jsonl`, counted in stats.json and the manifest, up to `--max-bad`), a 01b
manifest edited by hand (a clear error), a full disk while writing train/eval.jsonl (DiskError,
no partial file, and a re-run after space is back gives the bytes of a clean run).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from fault_helpers import fill_disk, small_disk
from stage_helpers import assert_same_folder

from eagle3.core.faults import DiskError, InputFileError, TooManyBad
from eagle3.core.records import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "datasets" / "merge_and_shuffle.py"
OUT = "01c_merged"


def _main():
    if "merge_and_shuffle" not in sys.modules:
        spec = importlib.util.spec_from_file_location("merge_and_shuffle", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["merge_and_shuffle"] = module
        spec.loader.exec_module(module)
    return sys.modules["merge_and_shuffle"].main


def merge(workdir: Path, *flags: str) -> int:
    return _main()(["--workdir", str(workdir), "--eval-fraction", "0.2", "--log-level", "ERROR",
                    *flags])


def rec(rid: str, start: int, n: int = 8) -> dict:
    ids, mask = list(range(start, start + n)), [0, 0] + [1] * (n - 2)
    return {"id": rid, "source": rid.split("/")[0], "input_ids": ids, "loss_mask": mask,
            "seq_len": n, "n_prompt_tokens": 2, "n_response_tokens": n - 2,
            "finish_reason": "stop"}


def _line(r) -> bytes:
    return json.dumps(r).encode() + b"\n"


# (kind, damaged line, the skip list's reason kind)
BAD_LINES = [
    ("bad JSON", b'{"id": "a/bj", "input_ids": [1, 2\n', "bad JSON"),
    ("float token id", _line({**rec("a/f", 900), "input_ids": [1.5] + list(range(7))}),
     "bad record"),
    ("string token id", _line({**rec("a/s", 910), "input_ids": ["1"] + list(range(7))}),
     "bad record"),
    ("true as a token id", _line({**rec("a/t", 920), "input_ids": [True] + list(range(7))}),
     "bad record"),
    ("negative token id", _line({**rec("a/n", 930), "input_ids": [-1] + list(range(7))}),
     "bad record"),
    ("loss_mask shorter than input_ids", _line({**rec("a/m", 940), "loss_mask": [0, 1]}),
     "bad record"),
    ("loss mask of floats", _line({**rec("a/mf", 950), "loss_mask": [0.0] * 2 + [1.0] * 6}),
     "bad record"),
    ("empty record", b"{}\n", "bad record"),
    ("no tokens", _line({**rec("a/e", 0), "input_ids": [], "loss_mask": [], "seq_len": 0}),
     "bad record"),
    ("not an object", b"[1, 2, 3]\n", "bad record"),
    ("empty line", b"\n", "empty line"),
]
TORN = b'{"id": "a/torn", "input_ids": [1, 2'


def write_upstream(workdir: Path, sources: dict[str, bytes], counts: dict | None = None) -> None:
    """01b's folder: each source's tokenized.jsonl bytes and a complete manifest whose record
    counts are the files' lines (or `counts`)."""
    outputs = {}
    for name, data in sources.items():
        (workdir / "01b_generated" / name).mkdir(parents=True, exist_ok=True)
        (workdir / "01b_generated" / name / "tokenized.jsonl").write_bytes(data)
        lines = data.count(b"\n") + (not data.endswith(b"\n"))
        outputs[name] = {"regenerate": True, "records": (counts or {}).get(name, lines)}
    (workdir / "01b_generated/manifest.json").write_text(json.dumps(
        {"stage": "01b_generated", "complete": True, "outputs": {"datasets": outputs}}))


def damaged_sources() -> dict[str, bytes]:
    good = [_line(rec(f"a/{i}", 10 * i)) for i in range(20)]
    lines = good[:5] + [line for _, line, _ in BAD_LINES] + good[5:]
    return {"a": b"".join(lines) + TORN,
            "b": b"".join(_line(rec(f"b/{i}", 5000 + 10 * i)) for i in range(10))}


def test_each_damaged_line_is_skipped_listed_and_counted_up_to_max_bad(tmp_path):
    write_upstream(tmp_path, damaged_sources())
    n_bad = len(BAD_LINES) + 1
    with pytest.raises(TooManyBad, match=f"more than --max-bad {n_bad - 1}"):
        merge(tmp_path, "--max-bad", str(n_bad - 1))
    assert not (tmp_path / OUT / "train.jsonl").exists()
    assert merge(tmp_path, "--max-bad", str(n_bad)) == 0
    skipped = list(read_jsonl(tmp_path / OUT / "skipped.jsonl"))
    assert [s["id"] for s in skipped] == [f"a/tokenized.jsonl:{n}"
                                          for n in [*range(6, 6 + len(BAD_LINES)), 32]]
    assert [s["reason"].split(":")[0] for s in skipped] == [k for *_, k in BAD_LINES] + [
        "torn line"]
    kept = [r["id"] for split in ("train", "eval") for r in read_jsonl(tmp_path / OUT /
                                                                        f"{split}.jsonl")]
    assert sorted(kept) == sorted([f"a/{i}" for i in range(20)] + [f"b/{i}" for i in range(10)])
    stats = json.loads((tmp_path / OUT / "stats.json").read_text())
    assert stats["a"]["dropped"] == {"invalid": n_bad} and stats["b"]["dropped"] == {}
    outputs = json.loads((tmp_path / OUT / "manifest.json").read_text())["outputs"]
    assert outputs["skipped"] == n_bad and outputs["skip_list"].endswith("skipped.jsonl")


def test_rerun_over_damaged_inputs_gives_identical_bytes(tmp_path):
    for w in ("ref", "run"):
        write_upstream(tmp_path / w, damaged_sources())
    assert merge(tmp_path / "ref", "--max-bad", "-1") == 0
    assert merge(tmp_path / "run", "--max-bad", "-1") == 0
    (tmp_path / "run" / OUT / "manifest.json").unlink()  # as if killed before the end
    assert merge(tmp_path / "run", "--max-bad", "-1") == 0
    assert_same_folder(tmp_path / "run" / OUT, tmp_path / "run", tmp_path / "ref" / OUT,
                       tmp_path / "ref")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["outputs"]["datasets"]["a"].update(records=7), "holds 10 lines but the "
                                                                "manifest says 7 records"),
    (lambda m: m["outputs"]["datasets"].pop("b"), "does not list it"),
    (lambda m: m["outputs"]["datasets"]["a"].update(records="10"), "not a count"),
    (lambda m: m["outputs"]["datasets"].update(c={"records": 3}), "holds 0 lines"),
])
def test_upstream_manifest_edited_by_hand_is_a_clear_error(tmp_path, edit, match):
    write_upstream(tmp_path, {n: b"".join(_line(rec(f"{n}/{i}", 100 * k + i)) for i in range(10))
                              for k, n in enumerate("ab")})
    path = tmp_path / "01b_generated/manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(InputFileError, match=match) as err:
        merge(tmp_path)
    assert str(path) in str(err.value) and "--force" in str(err.value)


def test_full_disk_while_writing_splits_leaves_no_partial_file_and_rerun_is_identical(tmp_path):
    sources = {"a": b"".join(_line(rec(f"a/{i}", i, 200)) for i in range(300))}
    write_upstream(tmp_path / "ref", sources)
    assert merge(tmp_path / "ref") == 0
    train_bytes = (tmp_path / "ref" / OUT / "train.jsonl").stat().st_size
    with small_disk(tmp_path / "disk", kib=4096) as disk:
        if disk is None:
            pytest.skip("cannot mount a tmpfs here")
        run = disk / "run"
        write_upstream(run, sources)
        fill_disk(disk, leave=train_bytes // 2)
        with pytest.raises(DiskError) as err:
            merge(run)
        assert "no space left" in str(err.value) and str(run / OUT) in str(err.value)
        assert f"needed {train_bytes:,} bytes" in str(err.value)
        assert list((run / OUT).iterdir()) == []  # no train.jsonl, no temp file
        (disk / "ballast").unlink()
        assert merge(run) == 0
        assert_same_folder(run / OUT, run, tmp_path / "ref" / OUT, tmp_path / "ref")
