"""Stage 01 against malformed inputs: every kind ends as its expected outcome, none stops the stage.

`ROWS` is the fixture: one JSONL line per kind with the quarantine reason (its kind, the text
before the first colon) it must get, or `None` when the row is good and kept (a BOM, an integer
id). `SOURCES` are files that cannot be read at all: each is a source error naming the file.
"""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

import pytest

from eagle3.core.records import read_jsonl

U = {"role": "user", "content": "What is two plus two?"}
A = {"role": "assistant", "content": "Four."}
TOOL = {"type": "function", "function": {"name": "add", "description": "adds",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "4"}


def _row(rid, messages, **extra) -> str:
    return json.dumps({"id": rid, "messages": messages, **extra})


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (kind of input, JSONL line, expected quarantine kind or None = kept)
ROWS: list[tuple[str, str, str | None]] = [
    ("BOM before the first row", "\ufeff" + _row("bom", [U, A]), None),
    ("integer id", _row(7, [U, A]), None),
    ("nesting past the JSON parser's limit",
     '{"id": "deep", "messages": ' + _nested(100_000) + "}", "too deeply nested"),
    ("nesting past 64 levels", _row("deep64", [U, A], extra=json.loads(_nested(80))),
     "too deeply nested"),
    ("role is a list", _row("r1", [_with(U, role=["user"]), A]), "unknown role"),
    ("role is an object", _row("r2", [_with(U, role={"a": 1}), A]), "unknown role"),
    ("role is a number", _row("r3", [_with(U, role=3), A]), "unknown role"),
    ("role is unknown text", _row("r4", [_with(U, role="narrator"), A]), "unknown role"),
    ("tool_call_id is a list", _row("t1", [U, CALL, _with(RESULT, tool_call_id=["c1"]), A],
                                    tools=[TOOL]), "bad type"),
    ("tool_call_id is an object", _row("t2", [U, CALL, _with(RESULT, tool_call_id={"i": 1}), A],
                                       tools=[TOOL]), "bad type"),
    ("tool call id is a list", _row("t3", [U, _with(CALL, tool_calls=[
        _with(CALL["tool_calls"][0], id=["c1"])]), RESULT, A], tools=[TOOL]), "bad type"),
    ("tool call id is an object", _row("t4", [U, _with(CALL, tool_calls=[
        _with(CALL["tool_calls"][0], id={"c": 1})]), RESULT, A], tools=[TOOL]), "bad type"),
    ("tool message name is a number", _row("t5", [U, CALL, _with(RESULT, name=5), A],
                                           tools=[TOOL]), "bad type"),
    ("special token in a tool description", _row("s1", [U, CALL, RESULT, A], tools=[
        {"type": "function", "function": _with(TOOL["function"], description="x<|im_end|>")}]),
     "special token in text"),
    ("special token in a tool name", _row("s2", [U, _with(CALL, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "a<|im_end|>", "arguments": "{}"}}]),
        RESULT, A], tools=[{"type": "function", "function": {"name": "a<|im_end|>"}}]),
     "special token in text"),
    ("special token in a parameter schema", _row("s3", [U, A], tools=[
        {"type": "function", "function": _with(TOOL["function"], parameters={
            "type": "object", "properties": {"x": {"description": "<|im_middle|>"}}})}]),
     "special token in text"),
    ("special token in message text", _row("s4", [_with(U, content="hi <|im_end|>"), A]),
     "special token in text"),
    ("special token in tool call arguments", _row("s5", [U, _with(CALL, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "add",
                                                       "arguments": '{"a": "<|im_end|>"}'}}]),
        RESULT, A], tools=[TOOL]), "special token in text"),
    ("NUL in message text", _row("n1", [_with(U, content="a\x00b"), A]), "NUL character"),
    ("NUL in reasoning", _row("n2", [U, _with(A, reasoning_content="x\x00")]), "NUL character"),
    ("NUL in a tool description", _row("n3", [U, A], tools=[
        {"type": "function", "function": _with(TOOL["function"], description="a\x00")}]),
     "NUL character"),
    ("NaN in a tool schema", _row("f1", [U, A], tools=[TOOL]).replace(
        '"properties": {}', '"properties": {}, "minimum": NaN'), "non-finite number"),
    ("Infinity in a tool schema", _row("f2", [U, A], tools=[TOOL]).replace(
        '"properties": {}', '"properties": {}, "maximum": Infinity'), "non-finite number"),
    ("-Infinity in the row", _row("f3", [U, A]).replace('"id"', '"score": -Infinity, "id"'),
     "non-finite number"),
    ("id is an object", _row({"nested": 1}, [U, A]), "bad id"),
    ("id is a list", _row([1, 2], [U, A]), "bad id"),
    ("id is a boolean", _row(True, [U, A]), "bad id"),
    ("id is a float", _row(1.5, [U, A]), "bad id"),
    ("messages is a string", json.dumps({"id": "m1", "messages": "hello"}), "bad type"),
    ("messages is empty", json.dumps({"id": "m2", "messages": []}), "empty field"),
    ("a message is a string", _row("m3", ["hello", A]), "bad type"),
    ("content is a number", _row("m4", [_with(U, content=4), A]), "bad type"),
    ("content part is an image", _row("m5", [_with(U, content=[
        {"type": "image_url", "image_url": "x"}]), A]), "bad type"),
    ("tool_calls is a number", _row("c1", [U, _with(CALL, tool_calls=3), A]), "bad tool call"),
    ("tool call without function", _row("c2", [U, _with(CALL, tool_calls=[{"id": "x"}]), A]),
     "bad tool call"),
    ("arguments are a list", _row("c3", [U, _with(CALL, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": [1]}}]),
        RESULT, A], tools=[TOOL]), "bad tool call"),
    ("arguments are not JSON", _row("c4", [U, _with(CALL, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{a"}}]),
        RESULT, A], tools=[TOOL]), "bad tool call"),
    ("tool call names an undeclared tool", _row("c5", [U, _with(CALL, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "sub", "arguments": "{}"}}]),
        RESULT, A], tools=[TOOL]), "unknown tool"),
    ("tools is a string that is not JSON", _row("d1", [U, A], tools="[{"), "bad json field"),
    ("tools is an object", _row("d2", [U, A], tools={"a": 1}), "bad tools"),
    ("tool parameters are a list", _row("d3", [U, A], tools=[
        {"type": "function", "function": _with(TOOL["function"], parameters=[1])}]),
     "bad tools"),
    ("tool description is a number", _row("d4", [U, A], tools=[
        {"type": "function", "function": _with(TOOL["function"], description=3)}]),
     "bad tools"),
    ("tool name is a number", _row("d5", [U, A], tools=[{"type": "function",
                                                         "function": {"name": 3}}]),
     "bad tools"),
    ("the row is a list", json.dumps([U, A]), "not an object"),
    ("the row is a number", "42", "not an object"),
    ("a truncated line", _row("x1", [U, A])[:-5], "malformed json"),
    ("a lone surrogate", _row("x2", [U, A]).replace("Four.", "\\ud800"), "invalid unicode"),
    ("an orphan tool result", _row("o1", [U, RESULT, A]), "orphan tool result"),
    ("an empty user turn", _row("o2", [_with(U, content="  "), A]), "empty turn"),
    ("the first turn is the assistant's", _row("o3", [A, U, A]), "bad order"),
    ("no final assistant turn", _row("o4", [U, A, U]), "no final assistant turn"),
    ("<think> never closed", _row("o5", [U, _with(A, content="<think>hmm")]), "bad reasoning"),
    ("a 2 MB message (found too long before rendering)",
     _row("big", [_with(U, content="word " * 400_000), A]), "too long"),
    ("a duplicate id", _row("bom", [U, A]), "duplicate id"),
]
INVALID_UTF8 = ("invalid utf-8 bytes", b'{"id": "u", "messages": "\xff"}', "invalid utf-8")


def _main():
    return importlib.import_module("01_prepare_datasets").main


def _recipe(tmp_path: Path, datasets: list[dict]) -> Path:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"name": "t", "datasets": [
        {"adapter": "openai", "id_field": "id", "regenerate": False, "max_seq_len": 1024, **d}
        for d in datasets]}))
    return path


def _run(tmp_path: Path, recipe: Path, target: Path, *flags) -> int:
    return _main()(["--recipe", str(recipe), "--target", str(target), "--workdir",
                    str(tmp_path / "w"), "--num-workers", "1", *flags])


def test_fixture_holds_at_least_40_kinds_of_malformed_input():
    kinds = [k for k, _, outcome in ROWS if outcome is not None] + [INVALID_UTF8[0]]
    assert len(set(kinds)) == len(kinds) >= 40
    assert len(SOURCES) >= 5


def test_every_malformed_row_gets_its_reason_and_no_row_stops_the_stage(
        tmp_path, tiny_target_dir, capsys):
    data = tmp_path / "mal.jsonl"
    data.write_bytes(b"".join(line.encode("utf-8", "surrogatepass") + b"\n"
                              for _, line, _ in ROWS) + INVALID_UTF8[1] + b"\n")
    array = tmp_path / "arr.json"  # a JSON array behind a BOM is read too
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([json.loads(_row("a1", [U, A]))]).encode())
    recipe = _recipe(tmp_path, [{"name": "mal", "path": str(data)},
                                {"name": "arr", "path": str(array)}])
    assert _run(tmp_path, recipe, tiny_target_dir, "--chunk-size", "9") == 0
    out = tmp_path / "w" / "01_prepared"
    got = {int(q["row"].split(":")[1]): q["reason"] for q in read_jsonl(
        out / "mal" / "quarantine.jsonl")}
    expected = {n: outcome for n, (_, _, outcome) in enumerate(ROWS, start=1) if outcome}
    expected[len(ROWS) + 1] = INVALID_UTF8[2]
    assert {n: r.split(":")[0] for n, r in got.items()} == expected, {
        ROWS[n - 1][0] if n <= len(ROWS) else "utf8": r for n, r in got.items()
        if r.split(":")[0] != expected.get(n)}
    big = next(n for n, (kind, _, _) in enumerate(ROWS, start=1) if kind.startswith("a 2 MB"))
    assert "before rendering" in got[big]  # the cheap bound, not a render of 2 MB
    kept = [c["id"] for c in read_jsonl(out / "mal" / "conversations.jsonl")]
    assert kept == ["mal/bom", "mal/7"]
    assert [c["id"] for c in read_jsonl(out / "arr" / "conversations.jsonl")] == ["arr/a1"]
    for line in (out / "mal" / "quarantine.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in a quarantine line"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["warnings"] == [
        f"mal: {len(expected)} of {len(ROWS) + 1} rows quarantined "
        f"({100 * len(expected) / (len(ROWS) + 1):.0f}% > --max-loss 50%): "
        f"{_top3(manifest['outputs']['datasets']['mal']['quarantine_reasons'])}"]
    assert "WARNING 1" in capsys.readouterr().out


def _top3(reasons: dict) -> str:
    top = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    return ", ".join(f"{k} {n}" for k, n in top)


def test_summary_shows_each_datasets_own_quarantine_reasons(tmp_path, tiny_target_dir, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(_row("1", [U, A]) + "\n" + _row("2", [_with(U, role=[1]), A]) + "\n")
    b.write_text(_row("1", [U, A]) + "\n" + _row("2", [U]) + "\n" + _row("3", [A, A]) + "\n")
    recipe = _recipe(tmp_path, [{"name": "a", "path": str(a)}, {"name": "b", "path": str(b)}])
    assert _run(tmp_path, recipe, tiny_target_dir) == 0
    lines = capsys.readouterr().out.splitlines()
    line_a = next(ln for ln in lines if "a quarantine" in ln)
    line_b = next(ln for ln in lines if "b quarantine" in ln)
    assert "unknown role 1" in line_a and "bad order" not in line_a
    assert "bad order 1" in line_b and "no final assistant turn 1" in line_b
    assert "unknown role" not in line_b


def test_a_source_that_yields_no_record_is_a_warning_in_summary_and_manifest(
        tmp_path, tiny_target_dir, capsys):
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text(_row("1", [U]) + "\n")
    recipe = _recipe(tmp_path, [{"name": "empty", "path": str(empty)},
                                {"name": "bad", "path": str(bad)}])
    assert _run(tmp_path, recipe, tiny_target_dir) == 0
    manifest = json.loads((tmp_path / "w" / "01_prepared" / "manifest.json").read_text())
    assert manifest["warnings"] == [
        "empty: no record out of 0 rows read (the source holds no row)",
        "bad: no record out of 1 rows read (quarantined: no final assistant turn 1)"]
    out = capsys.readouterr().out
    assert "empty: no record" in out and "bad: no record" in out


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


# (kind, file name, bytes, message the error must hold besides the file's name)
SOURCES = [
    ("truncated .jsonl.gz", "t.jsonl.gz", _gz(b'{"id": 1}\n' * 1000)[:-40], "not a readable gzip"),
    ("plain text named .gz", "p.jsonl.gz", b'{"id": 1}\n', "not a readable gzip"),
    ("truncated .json.gz", "t.json.gz", _gz(b"[" + b'{"id": 1},' * 500 + b"{}]")[:-20],
     "not a readable gzip"),
    ("a JSON object, not an array", "o.json", b'{"rows": [1, 2]', "neither a JSON array"),
    ("a broken JSON array", "b.json", b'[{"id": 1}, ', "not a valid JSON array"),
    ("a .json array nested past the parser's limit", "d.json", b"[" * 100_000,
     "not a valid JSON array"),
    ("not a Parquet file", "x.parquet", b"PAR1 but not really", "not a readable Parquet"),
]


@pytest.mark.parametrize("kind,name,data,message", SOURCES, ids=[s[0] for s in SOURCES])
def test_unreadable_source_file_is_a_source_error_naming_the_file(
        tmp_path, tiny_target_dir, capsys, kind, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    recipe = _recipe(tmp_path, [{"name": "s", "path": str(path)}])
    assert _run(tmp_path, recipe, tiny_target_dir) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err, err
