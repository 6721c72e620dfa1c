"""Stage 03 on a damaged merged train split: each bad line kind (02b's check of a merged line) is
skipped, listed in `03_vocab/skipped.jsonl` and counted in the summary, report.json and the
manifest; past `--max-bad` the stage stops with one error line naming the list; a split holding
a line the merge did not write stops it with one line naming the file and the first bad line."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.core.faults import BadRecords, TooManyBad, script_main
from eagle3.core.records import read_jsonl
from eagle3.vocab.mapping import count_supervised_by_origin

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"id": "ok", "source": "s", "finish_reason": "stop", "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1]}

# (line as written, the skip reason's kind); the file is GOOD, then this line, then GOOD again
BAD_LINES = {
    "bad_json": ('{"id": "x", "input_ids": [1, 2\n', "bad json"),
    "torn_last_line": ('{"id": "x", "input_i', "torn line"),
    "ids_out_of_vocab": (json.dumps({**GOOD, "id": "big", "input_ids": [1, 2, 99]}) + "\n",
                         "bad input_ids"),
    "negative_id": (json.dumps({**GOOD, "id": "neg", "input_ids": [1, -2, 3]}) + "\n",
                    "bad input_ids"),
    "ids_are_strings": (json.dumps({**GOOD, "id": "str", "input_ids": ["1", "2", "3"]}) + "\n",
                        "bad input_ids"),
    "ids_are_floats": (json.dumps({**GOOD, "id": "flt", "input_ids": [1.5, 2, 3]}) + "\n",
                       "bad input_ids"),
    "ids_missing": (json.dumps({"id": "none", "source": "s", "loss_mask": [1]}) + "\n",
                    "bad input_ids"),
    "not_an_object": ("[1, 2, 3]\n", "bad record"),
    "blank_line": ("  \t \n", "empty line"),
    "mask_not_binary": (json.dumps({**GOOD, "id": "m2", "loss_mask": [0, 2, 1]}) + "\n",
                        "bad loss_mask"),
    "mask_length_differs": (json.dumps({**GOOD, "id": "len", "loss_mask": [1, 1]}) + "\n",
                            "bad loss_mask"),
    "no_source": (json.dumps({k: v for k, v in GOOD.items() if k != "source"} | {"id": "ns"})
                  + "\n", "bad record"),
    "repeated_id": (json.dumps(GOOD) + "\n", "duplicate id"),  # the first line again
    "nested_too_deep": ("[" * 5000 + "\n", "bad json"),
}


def _write(path: Path, bad_line: str) -> None:
    good, other = json.dumps(GOOD) + "\n", json.dumps({**GOOD, "id": "ok2"}) + "\n"
    torn = not bad_line.endswith("\n")
    path.write_text(good + other + bad_line if torn else good + bad_line + other)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_counting_skips_and_lists_a_bad_line_when_given_a_skip_list(tmp_path, kind):
    line, reason = BAD_LINES[kind]
    _write(tmp_path / "train.jsonl", line)
    bad = BadRecords(tmp_path / "03_vocab", max_bad=5)
    counts = count_supervised_by_origin(tmp_path / "train.jsonl", 10, {}, bad=bad).sum(0)
    bad.close()
    assert counts.tolist() == [0, 0, 2, 2, 0, 0, 0, 0, 0, 0]  # the two good lines only
    rows = [json.loads(x) for x in (tmp_path / "03_vocab/skipped.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["reason"].startswith(reason), rows
    assert rows[0]["file"] == str(tmp_path / "train.jsonl")
    assert bad.summary()["skipped"] == 1


def test_counting_stops_naming_the_skip_list_past_max_bad(tmp_path):
    lines = "".join(BAD_LINES[k][0] for k in ("bad_json", "ids_out_of_vocab", "ids_are_strings"))
    (tmp_path / "train.jsonl").write_text(lines)
    with pytest.raises(TooManyBad, match="skipped.jsonl.*--max-bad"):
        count_supervised_by_origin(tmp_path / "train.jsonl", 10, {},
                                   bad=BadRecords(tmp_path, max_bad=2))


def _workdir(tmp_path: Path, vocab: int) -> Path:
    work = tmp_path / "w"
    (work / "01c_merged").mkdir(parents=True)
    good = [json.dumps({**GOOD, "id": f"g{i}", "input_ids": [i % vocab, 1, 2]}) + "\n"
            for i in range(20)]
    bad = [BAD_LINES[k][0] for k in ("bad_json", "ids_out_of_vocab", "ids_are_strings")]
    bad[1] = bad[1].replace("99", str(vocab + 5))
    (work / "01c_merged/train.jsonl").write_text("".join(good[:10] + bad + good[10:]))
    (work / "01c_merged/manifest.json").write_text(json.dumps({"complete": True}))
    return work


def test_03_counts_bad_lines_in_summary_report_and_manifest(tmp_path, tiny_target_dir, capsys):
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    work = _workdir(tmp_path, vocab)
    main = importlib.import_module("03_build_vocab_mapping").main
    assert main(["--workdir", str(work), "--target", str(tiny_target_dir), "--draft-vocab",
                 "16", "--log-level", "WARNING"]) == 0
    out = capsys.readouterr().out
    assert "bad lines skipped" in out and "3 (" in out
    # the first one named in the summary too (a run at --log-level ERROR logs no warning)
    (first,) = [line for line in out.splitlines() if "first bad line" in line]
    assert "line 11 (" in first and "bad json" in first
    report = json.loads((work / "03_vocab/report.json").read_text())
    manifest = json.loads((work / "03_vocab/manifest.json").read_text())
    for where in (report, manifest["outputs"]):
        assert where["skipped"] == 3
        assert where["skip_reasons"] == {"bad json": 1, "bad input_ids": 2}
    assert report["supervised_tokens"] == 40  # 20 good lines x 2 supervised tokens


def test_03_stops_with_one_line_naming_the_skip_list_past_max_bad(tmp_path, tiny_target_dir):
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    work = _workdir(tmp_path, vocab)
    proc = subprocess.run([sys.executable, str(ROOT / "03_build_vocab_mapping.py"), "--workdir",
                           str(work), "--target", str(tiny_target_dir), "--draft-vocab", "16",
                           "--max-bad", "1", "--log-level", "ERROR"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("03: error: 2 bad records, more than --max-bad 1")
    assert str(work / "03_vocab/skipped.jsonl") in last and "Traceback" not in proc.stderr
    assert not (work / "03_vocab/vocab_mapping.safetensors").exists()


# A line the merge did not write, inserted after line 10 of 20: damage that a line check names
# (a repeated line, a record without its source, nesting no parser takes) and damage it cannot
# (a record of the contract's shape): the merge's manifest counts 20 records.
INSERTED = {
    "a repeated line": lambda good: good[0],
    "a record without its source": lambda good: json.dumps({"id": "junk", "input_ids": [1, 2],
                                                            "loss_mask": [1, 1]}) + "\n",
    "nesting too deep to parse": lambda good: "[" * 5000 + "\n",
    "a record of the contract's shape": lambda good: json.dumps({**GOOD, "id": "junk"}) + "\n",
}


@pytest.mark.parametrize("kind", list(INSERTED))
def test_03_stops_in_one_line_naming_the_file_and_line_when_the_split_holds_a_line_the_merge_did_not_write(
        tmp_path, tiny_target_dir, capsys, kind):
    work = tmp_path / "w"
    (work / "01c_merged").mkdir(parents=True)
    good = [json.dumps({**GOOD, "id": f"g{i}", "input_ids": [i % 8, 1, 2]}) + "\n"
            for i in range(20)]
    src = work / "01c_merged/train.jsonl"
    src.write_text("".join(good[:10] + [INSERTED[kind](good)] + good[10:]))
    (work / "01c_merged/manifest.json").write_text(json.dumps(
        {"complete": True, "outputs": {"train": 20, "eval": 0}}))
    main = importlib.import_module("03_build_vocab_mapping").main
    capsys.readouterr()
    rc = script_main(lambda: main(["--workdir", str(work), "--target", str(tiny_target_dir),
                                   "--draft-vocab", "16", "--log-level", "ERROR"]), "03")
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("03: error: ")]
    assert f"{src}: 21 lines, but the merge wrote 20 records" in line
    if kind != "a record of the contract's shape":  # the line is named, and listed
        assert "first bad line: " in line and "(line 11)" in line
        (row,) = read_jsonl(work / "03_vocab/skipped.jsonl")
        assert row["reason"].endswith("(line 11)") and row["file"] == str(src)
    assert not (work / "03_vocab/vocab_mapping.safetensors").exists()
