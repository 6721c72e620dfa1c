"""Stage 01 logic for one chunk of rows, and the assembly of a dataset's chunks.

A row goes: parse (JSONL bytes) -> adapter -> clean-up (eagle3.prepare.conversations) -> special-token
and unicode checks -> render with the target's template. Kept replies are tokenized with their
loss masks (eagle3.core.chat; a conversation over the context limit is cut to its longest prefix
that ends in an assistant turn and fits); records to regenerate have their serving prompt
measured. Every rejected row becomes a quarantine line with its reason.

Chunk `c` of a dataset (rows `c*S … c*S+S-1` of the dataset's order) is written as four files
under `<dataset>/parts/`: `cNNNNNN.conv.jsonl`, `.tok.jsonl`, `.bad.jsonl` and, last,
`.meta.json` (the outcome of every row, in order), each through a temp file and a rename, so a
chunk exists whole or not at all. Assembly then reads the chunks in order, drops repeated ids,
stops at the recipe's `count`, and writes the dataset's outputs the same way: the result does
not depend on how often the stage was killed or how many processes ran it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.core.chat import ChatRenderer, RenderError, Sample, split_for_generation
from eagle3.core.progress import progress
from eagle3.core.records import RecordError, TokenizedRecord
from eagle3.core.stage import atomic_write_bytes, atomic_write_json, atomic_writer
from eagle3.prepare.conversations import to_conversation
from eagle3.prepare.recipes import DatasetSpec
from eagle3.prepare.sources import RawRow, parse_row, raw_for_quarantine
from eagle3.prepare.validate import check_depth, check_values, min_tokens

log = logging.getLogger(__name__)

OUTPUTS = ("conversations.jsonl", "tokenized.jsonl", "quarantine.jsonl")


class RenderMismatch(RuntimeError):
    """The fast tokenization disagreed with the exact one (a tokenizer the fast path does not
    handle): re-run with --exact-render to use the exact path throughout."""


@dataclass
class Outcome:
    """What became of one row."""

    key: str
    id: str | None = None
    conv_line: bytes = b""
    tok_lines: list[bytes] = field(default_factory=list)
    bad_line: bytes = b""
    tokens: int = 0  # tokens of its samples (kept) or of its prompt (regenerated)
    supervised: int = 0
    truncated: bool = False


@dataclass
class RowContext:
    """What a worker needs besides the rows."""

    renderer: ChatRenderer
    verify_every: int = 100  # re-check 1 in N kept records against the exact path (0 = never)
    exact: bool = False  # use the exact (slow) tokenization for every record
    max_token_chars: int = 0  # characters of the longest token (0 = no cheap length bound)


def json_line(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"


def quarantine_line(source: str, key: str, rid: str | None, reason: str, raw) -> bytes:
    # ensure_ascii: the raw row may hold lone surrogates, which UTF-8 cannot carry
    line = {"source": source, "row": key, "id": rid, "reason": reason,
            "raw": raw_for_quarantine(raw)}
    try:
        text = json.dumps(line, ensure_ascii=True, allow_nan=False, default=str)
    except (ValueError, RecursionError):  # NaN or nesting past the limit: keep its repr
        line["raw"] = repr(raw)[:100_000]
        text = json.dumps(line, ensure_ascii=True)
    return text.encode() + b"\n"


def prepare_row(key: str, payload, spec: DatasetSpec, ctx: RowContext) -> Outcome:
    """Convert one source row; never raises for a bad row (it becomes a quarantine line)."""
    out = Outcome(key)
    row = None
    try:
        row, error = parse_row(payload)
        if error is not None:
            raise RecordError(error)
        check_depth(row)
        conv = to_conversation(row, spec.name, spec.adapter, spec.id_field, spec.mode,
                               spec.drop_system)
        out.id = conv["id"]
        check_values(conv)
        out.conv_line = _encode_line(conv)
        hit = ctx.renderer.special_text_in(conv["messages"], conv.get("tools"))
        if hit:
            raise RecordError(f"special token in text: {hit}")
        if unrendered := ctx.renderer.unrendered_tool_use(conv["messages"], conv.get("tools")):
            raise RecordError(f"tool use: {unrendered}")
        if spec.mode == "keep":
            _render_kept(conv, spec, ctx, out)
        else:
            _measure_prompt(conv, spec, ctx, out)
    except (RecordError, RenderError) as e:
        reason = str(e)
    except RenderMismatch:
        raise  # the tokenizer, not the row: the stage stops (see --exact-render)
    except (MemoryError, RecursionError) as e:
        reason = f"too large: converting the row raised {type(e).__name__}"
    except Exception as e:  # noqa: BLE001 - no row may stop the stage; the reason says what
        log.warning("row %s of %s raised %s; quarantined", key, spec.name, type(e).__name__)
        reason = f"unexpected error: {type(e).__name__} ({str(e)[:200]})"
    else:
        return out
    out.bad_line = quarantine_line(spec.name, key, out.id, reason,
                                   payload if row is None else row)
    out.conv_line, out.tok_lines = b"", []
    return out


def _encode_line(conv: dict) -> bytes:
    try:
        return json_line(conv)
    except UnicodeEncodeError as e:
        raise RecordError("invalid unicode: the row holds a lone surrogate "
                          f"({e.object[e.start:e.end]!a})") from e


def _render_kept(conv: dict, spec: DatasetSpec, ctx: RowContext, out: Outcome) -> None:
    samples = _fit(conv, spec.max_seq_len, ctx, out)
    if ctx.verify_every and zlib.crc32(conv["id"].encode()) % ctx.verify_every == 0:
        exact = ctx.renderer.samples(conv["messages"], conv.get("tools"), exact=True)
        if [(s.input_ids, s.loss_mask, s.n_prompt_tokens) for s in exact] != [
                (s.input_ids, s.loss_mask, s.n_prompt_tokens) for s in samples]:
            raise RenderMismatch(f"record {conv['id']}: the fast tokenization differs from the "
                                 "exact one for this tokenizer; re-run with --exact-render")
    for k, s in enumerate(samples):
        rid = conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}"
        rec = TokenizedRecord(rid, spec.name, s.input_ids, s.loss_mask, s.n_prompt_tokens,
                              "dataset")
        out.tok_lines.append(tokenized_line(rec))
        out.tokens += len(s.input_ids)
        out.supervised += sum(s.loss_mask)


def tokenized_line(rec: TokenizedRecord) -> bytes:
    """`json_line(rec.to_json())`, byte for byte, written faster: the loss mask is a few runs
    of 0s and 1s, written run by run (JSON encoding is a visible share of the stage's time)."""
    d = rec.to_json()
    head = json.dumps({"id": d["id"], "source": d["source"]}, ensure_ascii=False)[:-1]
    tail = json.dumps({k: d[k] for k in ("seq_len", "n_prompt_tokens", "n_response_tokens",
                                         "finish_reason")}, ensure_ascii=False)[1:]
    return (f'{head}, "input_ids": {json.dumps(d["input_ids"])}, "loss_mask": '
            f'[{_mask_text(d["loss_mask"])}], {tail}\n').encode("utf-8")


def _mask_text(mask: list[int]) -> str:
    parts, i, n = [], 0, len(mask)
    while i < n:
        v = mask[i]
        try:
            j = mask.index(1 - v, i)
        except ValueError:
            j = n
        parts.append(("1, " if v else "0, ") * (j - i))
        i = j
    return "".join(parts)[:-2]


def _fit(conv: dict, limit: int, ctx: RowContext, out: Outcome) -> list[Sample]:
    """The conversation's samples; over the limit, cut it after its latest assistant turn
    whose samples all fit (the record written is the cut one, so 01b renders the same).

    Turns whose prefix is over the limit by the cheap bound (validate.min_tokens) are cut
    before anything is rendered, so a huge conversation costs what its fitting part costs."""
    messages, tools = conv["messages"], conv.get("tools")
    if ctx.max_token_chars:
        bound = min_tokens(messages, ctx.max_token_chars)
        if bound[-1] > limit:
            ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"
                    and bound[i] <= limit]
            if not ends:
                raise RecordError(f"too long: at least {bound[-1]} tokens > max_seq_len "
                                  f"{limit} (bound from its characters, before rendering), and "
                                  "no earlier assistant turn ends a shorter conversation that "
                                  "fits")
            return _fit(_cut(conv, ends[-1], out), limit, ctx, out)
    # One render of the text and one encode (linear in its length) before `samples`, whose
    # per-turn rendering grows with turns x length (a 400-turn conversation: 0.2 s vs 24 s).
    if _text_tokens(messages, tools, ctx) > limit:
        ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        lo, hi = 0, len(ends)  # ends[:lo] fit; binary search on the prefix length
        while lo < hi:
            mid = (lo + hi) // 2
            if _text_tokens(messages[: ends[mid] + 1], tools, ctx) <= limit:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            raise RecordError(f"too long: {_text_tokens(messages, tools, ctx)} tokens > "
                              f"max_seq_len {limit}, and no earlier assistant turn ends a "
                              "shorter conversation that fits")
        conv = _cut(conv, ends[lo - 1], out)
        messages = conv["messages"]
    samples = ctx.renderer.samples(messages, tools, exact=ctx.exact)
    longest = max(len(s.input_ids) for s in samples)
    if longest <= limit:
        return samples
    # Token length of the conversation through each assistant turn, from the samples.
    through = {i: stop for s in samples for i, (_, stop) in zip(s.supervised_turns, s.spans)}
    for end in sorted((i for i, n in through.items() if n <= limit), reverse=True):
        cut = messages[: end + 1]
        samples = ctx.renderer.samples(cut, tools, exact=ctx.exact)
        if max(len(s.input_ids) for s in samples) <= limit:
            conv["messages"] = cut
            out.conv_line = json_line(conv)
            out.truncated = True
            return samples
    raise RecordError(f"too long: {longest} tokens > max_seq_len {limit}, and no earlier "
                      "assistant turn ends a shorter conversation that fits")


def _cut(conv: dict, end: int, out: Outcome) -> dict:
    """The conversation through message `end`, recorded as the one written out."""
    conv["messages"] = conv["messages"][: end + 1]
    out.conv_line = json_line(conv)
    out.truncated = True
    return conv


def _text_tokens(messages: list[dict], tools, ctx: RowContext) -> int:
    return len(ctx.renderer.encode(ctx.renderer.render_text(messages, tools, False)))


def _measure_prompt(conv: dict, spec: DatasetSpec, ctx: RowContext, out: Outcome):
    prompt, _ = split_for_generation(conv["messages"])
    if ctx.max_token_chars and (n := min_tokens(prompt, ctx.max_token_chars)[-1]) >= \
            spec.max_seq_len:
        raise RecordError(f"too long: the prompt has at least {n} tokens >= max_seq_len "
                          f"{spec.max_seq_len} (bound from its characters), no room to generate")
    n = len(ctx.renderer.prompt_ids(prompt, conv.get("tools")))
    if n >= spec.max_seq_len:
        raise RecordError(f"too long: the prompt has {n} tokens >= max_seq_len "
                          f"{spec.max_seq_len}, no room to generate")
    out.tokens = n


# ---------------------------------------------------------------- chunks


def chunk_stem(parts: Path, chunk: int) -> Path:
    return parts / f"c{chunk:06d}"


def process_chunk(spec: DatasetSpec, chunk: int, rows: list[RawRow], parts: Path,
                  ctx: RowContext) -> dict:
    """Prepare one chunk and write its four files; returns its summary (the meta)."""
    t0 = time.perf_counter()
    outcomes = [prepare_row(key, payload, spec, ctx) for key, payload in rows]
    stem = chunk_stem(parts, chunk)
    atomic_write_bytes(stem.with_suffix(".conv.jsonl"), b"".join(o.conv_line for o in outcomes))
    atomic_write_bytes(stem.with_suffix(".tok.jsonl"),
                       b"".join(line for o in outcomes for line in o.tok_lines))
    atomic_write_bytes(stem.with_suffix(".bad.jsonl"), b"".join(o.bad_line for o in outcomes))
    meta = {
        "chunk": chunk, "rows": len(rows), "seconds": round(time.perf_counter() - t0, 4),
        # per row: [id, tokenized lines, tokens, supervised, truncated, row], or [null, kind]
        "outcomes": [[o.id, len(o.tok_lines), o.tokens, o.supervised, int(o.truncated), o.key]
                     if not o.bad_line else [None, _kind(o.bad_line)] for o in outcomes],
    }
    atomic_write_json(stem.with_suffix(".meta.json"), meta)
    return meta


def load_chunk_meta(parts: Path, chunk: int) -> dict | None:
    path = chunk_stem(parts, chunk).with_suffix(".meta.json")
    return json.loads(path.read_text()) if path.exists() else None


def good_ids(meta: dict) -> list[str]:
    return [o[0] for o in meta["outcomes"] if o[0] is not None]


def _kind(bad_line: bytes) -> str:
    return json.loads(bad_line)["reason"].split(":")[0]


# ---------------------------------------------------------------- assembly


def assemble(spec: DatasetSpec, out_dir: Path, n_chunks: int) -> dict:
    """Concatenate chunks 0..n_chunks-1 in order into the dataset's outputs; returns counts."""
    parts = out_dir / "parts"
    counts = {"rows_read": 0, "records": 0, "samples": 0, "tokens": 0, "supervised_tokens": 0,
              "truncated": 0, "quarantined": 0, "quarantine_reasons": {}}
    seen: set[str] = set()
    names = OUTPUTS if spec.mode == "keep" else [n for n in OUTPUTS if n != "tokenized.jsonl"]
    with ExitStack() as stack:  # every output is renamed into place only if all succeed
        writers = {name: stack.enter_context(atomic_writer(out_dir / name)) for name in names}
        writers.setdefault("tokenized.jsonl", _NoTokenized())
        for chunk in progress(range(n_chunks), desc=f"01 assemble {spec.name}", unit="chunk"):
            if not _assemble_chunk(spec, parts, chunk, writers, seen, counts):
                break
    return counts


def _assemble_chunk(spec, parts, chunk, writers, seen, counts) -> bool:
    """Copy one chunk's lines; False once `count` records are out (stop reading)."""
    meta = load_chunk_meta(parts, chunk)
    stem = chunk_stem(parts, chunk)
    with stem.with_suffix(".conv.jsonl").open("rb") as conv, \
            stem.with_suffix(".tok.jsonl").open("rb") as tok, \
            stem.with_suffix(".bad.jsonl").open("rb") as bad:
        for outcome in meta["outcomes"]:
            if spec.count is not None and counts["records"] >= spec.count:
                return False
            counts["rows_read"] += 1
            rid = outcome[0]
            if rid is None:
                _count_bad(counts, outcome[1])
                writers["quarantine.jsonl"].write(bad.readline())
                continue
            line = conv.readline()
            tok_lines = [tok.readline() for _ in range(outcome[1])]
            if rid in seen:
                reason = f"duplicate id: {rid} came earlier in this dataset"
                writers["quarantine.jsonl"].write(quarantine_line(
                    spec.name, outcome[5], rid, reason, json.loads(line)))
                _count_bad(counts, "duplicate id")
                continue
            seen.add(rid)
            writers["conversations.jsonl"].write(line)
            for t in tok_lines:
                writers["tokenized.jsonl"].write(t)
            counts["records"] += 1
            counts["samples"] += outcome[1]
            counts["tokens"] += outcome[2]
            counts["supervised_tokens"] += outcome[3]
            counts["truncated"] += outcome[4]
    return True


def _count_bad(counts: dict, kind: str) -> None:
    counts["quarantined"] += 1
    counts["quarantine_reasons"][kind] = counts["quarantine_reasons"].get(kind, 0) + 1


def remove_parts(out_dir: Path) -> None:
    shutil.rmtree(out_dir / "parts", ignore_errors=True)


class _NoTokenized:
    """Stands in for the tokenized output of datasets whose replies are regenerated."""

    def write(self, data: bytes) -> None:
        raise AssertionError("a dataset to regenerate produced tokenized lines")
