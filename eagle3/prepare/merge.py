"""Merge logic: tokenized datasets -> one shuffled train split and a held-out eval split.

Two passes, so that no token list is held in memory (the real run merges ~88M tokens):

1. `scan` reads every record once and keeps an index entry (file offset, id, token hash,
   lengths). A damaged line (torn, empty, not JSON, or a record that breaks the tokenized
   contract: fields, lengths, token ids that are not non-negative ints, a 0/1 loss mask) is
   skipped as `invalid` and listed in the stage's skip list (`BadRecords`, key
   `<source>/tokenized.jsonl:<line>`), which stops the stage past `--max-bad`; records over
   `max_seq_len` are dropped (`too long`) or, when the source's recipe entry says
   `"overlength": "truncate"`, cut to the limit (dropped if no supervised token is left).
   Exact duplicates (same token ids after truncation) keep the copy with the smallest id,
   whatever the order of the files. Per-source `merge_weight` (<1 keeps that share, >1 adds
   repeats `<id>~rK`) and `merge_cap` then pick records by a seeded hash of their id.
2. `write_split` streams each split's records, in their shuffled order, from the source files
   through a temp file renamed at the end.

The eval split is chosen by a hash of the conversation id (the id before `#k`/`~rK`), so a
conversation's samples never straddle the splits and a record's split does not change when
sources are added or removed; the order is a seeded shuffle of the id-sorted records, so it
does not depend on the order of the inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3.core.faults import InputFileError
from eagle3.core.progress import progress
from eagle3.core.records import RecordError, count_jsonl, tokenized_problem, validate_tokenized
from eagle3.core.stage import atomic_writer

log = logging.getLogger(__name__)


@dataclass
class SourcePolicy:
    """A source's merge settings, from its recipe entry (01's manifest)."""

    cap: int | None = None  # at most this many records (None = no cap)
    weight: float = 1.0  # <1: keep that share; >1: add repeats
    overlength: str = "drop"  # "drop" or "truncate" records over max_seq_len


@dataclass
class Entry:
    """Where one kept record lives, and what the merge decided for it."""

    source: str
    file: int  # index into the list of files
    offset: int
    id: str
    seq_len: int
    supervised: int
    digest: bytes
    truncate_to: int | None = None
    repeat: int = 0  # 0 = the record itself, k > 0 = its k-th repeat (id `<id>~rK`)
    nbytes: int = 0  # the line's size in its file (what writing it costs, about)

    @property
    def out_id(self) -> str:
        return self.id if self.repeat == 0 else f"{self.id}~r{self.repeat}"


@dataclass
class SourceStats:
    records: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0
    dropped: dict = field(default_factory=dict)
    lengths: list = field(default_factory=list)

    def drop(self, kind: str, n: int = 1) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + n

    def to_json(self) -> dict:
        lengths = np.asarray(self.lengths or [0])
        pct = {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)}
        return {"records": self.records, "tokens": self.tokens,
                "supervised_tokens": self.supervised_tokens, "truncated": self.truncated,
                "dropped": dict(sorted(self.dropped.items())),
                "length": {**pct, "max": int(lengths.max()), "mean": float(lengths.mean())}}


def check_upstream_counts(manifest: dict | None, files: dict[str, Path],
                          manifest_path: Path) -> None:
    """InputFileError when 01b's complete manifest disagrees with the files it describes: a
    dataset listed without its tokenized.jsonl (or the reverse), or a record count that differs
    from the file's lines (a torn last line counts as a line: it is skipped as damage, later).
    A manifest edited by hand, or a file changed after 01b finished, must not merge silently."""
    if not manifest or not manifest.get("complete"):
        return  # --allow-partial: nothing to hold the files to
    datasets = (manifest.get("outputs") or {}).get("datasets")
    if datasets is None:
        log.warning("%s gives no per-dataset record counts: the files are not checked "
                    "against it", manifest_path)
        return
    if not isinstance(datasets, dict):
        raise InputFileError(manifest_path, "outputs.datasets is not an object: the manifest "
                                            "was damaged or edited; re-run 01b with --force")
    for name in sorted(set(datasets) | set(files)):
        entry = datasets.get(name)
        want = entry.get("records") if isinstance(entry, dict) else None
        if name in datasets and type(want) is not int:
            raise InputFileError(manifest_path, f"outputs.datasets.{name}.records is {want!r}, "
                                                "not a count: the manifest was edited; re-run "
                                                "01b (the same command with --force)")
        have = _line_count(files[name]) if name in files else 0
        if name not in datasets or have != want:
            said = "does not list it" if want is None else f"says {want:,} records"
            raise InputFileError(manifest_path, (
                f"{name}: {manifest_path.parent / name / 'tokenized.jsonl'} holds {have:,} "
                f"lines but the manifest {said}: the manifest or the file changed after 01b "
                "finished. Restore the file, or re-run 01b (the same command with --force) "
                "to rebuild both"))


def _line_count(path: Path) -> int:
    """Lines of a file, a last line without its newline included."""
    n, last = 0, b"\n"
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def conversation_id(record_id: str) -> str:
    """The id of the conversation a record comes from (`a/b#1~r2` -> `a/b`)."""
    return record_id.split("~r")[0].split("#")[0]


def is_eval(record_id: str, eval_fraction: float) -> bool:
    """Stable split by conversation id: every sample of a conversation lands in one split."""
    h = hashlib.sha256(conversation_id(record_id).encode()).digest()[:8]
    return (int.from_bytes(h, "big") % 1_000_000) < eval_fraction * 1_000_000


def token_hash(input_ids: list[int]) -> bytes:
    return hashlib.sha256(np.asarray(input_ids, dtype=np.int64).tobytes()).digest()


def scan(files: dict[str, Path], max_seq_len: int, policies: dict[str, SourcePolicy],
         quarantine, bad) -> tuple[list[Entry], list[Path], dict[str, SourceStats]]:
    """Index every valid record under the length policy; returns (entries, files, stats).
    Damaged lines go to `bad` (a BadRecords), records dropped by a policy to `quarantine`."""
    paths = [files[s] for s in sorted(files)]
    stats = {s: SourceStats() for s in sorted(files)}
    entries: list[Entry] = []
    bar = progress(total=sum(count_jsonl(p) for p in paths), desc="merge scan", unit="rec")
    for k, (source, path) in enumerate(zip(sorted(files), paths)):
        policy = policies.get(source, SourcePolicy())
        offset = 0
        with path.open("rb") as f:
            for n, line in enumerate(f, start=1):
                here, offset = offset, offset + len(line)
                bar.update(1)
                rec, damage = parse_line(line)
                if damage:
                    stats[source].drop("invalid")
                    bad.add(f"{source}/{path.name}:{n}", damage, path)
                    continue
                entry, reason = _index(rec, source, k, here, max_seq_len, policy)
                if reason:
                    stats[source].drop(reason.split(":")[0])
                    quarantine.add(entry, reason)
                    continue
                entry.nbytes = len(line)
                stats[source].truncated += entry.truncate_to is not None
                entries.append(entry)
    bar.close()
    return entries, paths, stats


def parse_line(line: bytes) -> tuple[dict | None, str | None]:
    """(record, None) for a line of a tokenized.jsonl that holds one, else (None, why not: the
    skip list's reason)."""
    if not line.strip():
        return None, "empty line: stage 01b writes none; the file was damaged"
    if not line.endswith(b"\n"):
        return None, (f"torn line: the last line ({len(line)} bytes) has no newline; the file "
                      "was cut short (re-run 01b, or restore the file)")
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"bad JSON: {e}"
    problem = tokenized_problem(rec)
    if problem is not None:
        return None, f"bad record: {problem}"
    try:
        validate_tokenized(rec)  # the fields 01b writes, a supervised token
    except RecordError as e:
        return None, f"bad record: {e}"
    return rec, None


def _index(rec: dict, source: str, k: int, offset: int, max_seq_len: int,
           policy: SourcePolicy) -> tuple:
    """(Entry, None) for a usable record, (its id, reason) when a policy drops it."""
    ids, mask, cut = rec["input_ids"], rec["loss_mask"], None
    if rec["seq_len"] > max_seq_len:
        if policy.overlength == "drop":
            return rec["id"], f"too long: {rec['seq_len']} tokens > --max-seq-len {max_seq_len}"
        cut, ids, mask = max_seq_len, ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            return rec["id"], (f"too long: no supervised token within the first {max_seq_len} "
                               "tokens to truncate to")
    return Entry(source, k, offset, rec["id"], len(ids), sum(mask), token_hash(ids), cut), None


def dedupe(entries: list[Entry], stats: dict[str, SourceStats], quarantine) -> list[Entry]:
    """Keep one record per token sequence: the one with the smallest (id, source)."""
    best: dict[bytes, Entry] = {}
    for e in entries:
        kept = best.get(e.digest)
        if kept is None or (e.id, e.source) < (kept.id, kept.source):
            best[e.digest] = e
    out = []
    for e in entries:
        winner = best[e.digest]
        if winner is e:
            out.append(e)
        else:
            stats[e.source].drop("duplicate")
            quarantine.add(e.id, f"duplicate: same token ids as {winner.id}")
    return out


def apply_policies(entries: list[Entry], policies: dict[str, SourcePolicy],
                   stats: dict[str, SourceStats], seed: int) -> list[Entry]:
    """Per-source weight (share kept, or repeats) then cap, chosen by a seeded id hash."""
    by_source: dict[str, list[Entry]] = {}
    for e in entries:
        by_source.setdefault(e.source, []).append(e)
    out = []
    for source, group in sorted(by_source.items()):
        policy = policies.get(source, SourcePolicy())
        group.sort(key=lambda e: _rank(seed, e.id))
        whole, frac = divmod(policy.weight, 1.0)
        n = int(round(len(group) * policy.weight))
        picked = [Entry(**{**e.__dict__, "repeat": r}) for r in range(int(whole)) for e in group]
        picked += [Entry(**{**e.__dict__, "repeat": int(whole)})
                   for e in group[: n - len(picked)]]
        if policy.weight < 1:
            stats[source].drop("weight", len(group) - len(picked))
        if policy.cap is not None and len(picked) > policy.cap:
            stats[source].drop("cap", len(picked) - policy.cap)
            picked = picked[: policy.cap]
        out.extend(picked)
    return out


def _rank(seed: int, record_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{record_id}".encode()).digest()


def split_and_shuffle(entries: list[Entry], eval_fraction: float, seed: int):
    """(train, eval), each in a seeded shuffled order independent of input order."""
    entries = sorted(entries, key=lambda e: e.out_id)  # input order must not matter
    random.Random(seed).shuffle(entries)
    train = [e for e in entries if not is_eval(e.out_id, eval_fraction)]
    held = [e for e in entries if is_eval(e.out_id, eval_fraction)]
    return train, held


def write_split(path: Path, entries: list[Entry], files: list[Path],
                stats: dict[str, SourceStats] | None, desc: str) -> int:
    """Write `entries` in order to `path` (atomically); returns the tokens written."""
    handles = [p.open("rb") for p in files]
    tokens = 0
    try:
        with atomic_writer(path, expected_bytes=sum(e.nbytes for e in entries)) as out:
            for e in progress(entries, desc=desc, unit="rec"):
                f = handles[e.file]
                f.seek(e.offset)
                line = f.readline()
                if e.truncate_to is not None or e.repeat:
                    line = _rewrite(line, e)
                out.write(line)
                tokens += e.seq_len
                if stats is not None:
                    s = stats[e.source]
                    s.records += 1
                    s.tokens += e.seq_len
                    s.supervised_tokens += e.supervised
                    s.lengths.append(e.seq_len)
    finally:
        for h in handles:
            h.close()
    return tokens


def _rewrite(line: bytes, e: Entry) -> bytes:
    rec = json.loads(line)
    if e.truncate_to is not None:
        rec["input_ids"] = rec["input_ids"][: e.truncate_to]
        rec["loss_mask"] = rec["loss_mask"][: e.truncate_to]
        rec["seq_len"] = len(rec["input_ids"])
        rec["n_response_tokens"] = sum(rec["loss_mask"])
        rec["finish_reason"] = "truncated"
    rec["id"] = e.out_id
    return json.dumps(rec, ensure_ascii=False).encode() + b"\n"


def format_stats_table(stats: dict[str, dict]) -> str:
    """Per-source stats as a fixed-width table (the JSON has the same numbers)."""
    head = ("source", "records", "tokens", "supervised", "trunc", "p50", "p90", "p99", "max",
            "dropped")
    rows = [head]
    for source, s in stats.items():
        ln = s["length"]
        dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "-"
        rows.append((source, f"{s['records']:,}", f"{s['tokens']:,}",
                     f"{s['supervised_tokens']:,}", f"{s['truncated']:,}", str(ln["p50"]),
                     str(ln["p90"]), str(ln["p99"]), str(ln["max"]), dropped))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])]
        lines.append("  ".join(cells + [r[-1]]))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
