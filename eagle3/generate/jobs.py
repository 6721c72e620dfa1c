"""Stage 01b logic: conversations -> tokenized records, regenerating responses with the target.

For a dataset marked `regenerate`, each conversation is cut before its last assistant turn, the
prompt is rendered with the target's template (exactly what serving feeds it), and the target
generates the reply greedily. Three backends generate (see `eagle3.generate.backends` and
`eagle3.generate.runner` for the two server backends):

- `sglang`: SGLang's native `/generate` with our prompt ids in; the record keeps the exact
  `output_ids` the server produced (no decode and re-encode);
- `openai`: any `/v1/chat/completions` server; the reply (content, reasoning, tool calls) is
  re-rendered with the template, so its tokens are the template's, not necessarily the server's;
- `hf`: in-process transformers, in fixed batches (the demo, the tests, small targets), by
  one of two engines: `fast` (eagle3/generate/fast.py: static KV cache, CUDA-graph decoding on a
  GPU, greedy or sampled) or `generate` (transformers' `model.generate`, greedy).

For other datasets the existing replies are rendered with their loss masks.

Files per dataset (append-only JSONL, resumed by record id, a torn last line cut):
`tokenized.jsonl` (the records), `raw.jsonl` (every answer as received, `kept` telling whether
it became a record; after a kill between the two writes a raw line may repeat, the last one
wins), `failures.jsonl` (records that failed for good this run, with the reason) and
`quarantine.jsonl` (conversations that cannot be rendered); `text_mismatch.jsonl` lists the
records kept whose server's text disagreed with their ids (built from `raw.jsonl`). A record is done when it is in
`tokenized.jsonl` or its raw answer says `"kept": false` (dropped on purpose, e.g. cut by the
length limit under `--no-keep-length`). Lines are appended as answers complete; once every job
of a dataset has its answer, `write_in_job_order` rewrites the three files in the order of the
conversations (one line per id, the last one of a repeated raw line), so a killed and resumed
run ends with the same files as an uninterrupted one, whatever the completion order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from eagle3.core.chat import ChatRenderer, RenderError, split_for_generation
from eagle3.core.faults import DiskError, disk_errors_named
from eagle3.core.records import JsonlAppender, TokenizedRecord
from eagle3.core.stage import atomic_write_bytes, atomic_writer

log = logging.getLogger(__name__)


@dataclass
class GenerationJob:
    """One conversation to regenerate: its id, source, serving prompt and budget."""

    id: str
    source: str
    prompt_ids: array  # int32; built from a list of ints
    max_new_tokens: int
    # The prompt as messages (what an OpenAI-compatible server is sent) and its tools.
    messages: list[dict] = field(default_factory=list)
    tools: list | None = None

    def __post_init__(self) -> None:
        # 4 bytes a token instead of ~36 for a list of ints: 100K long prompts stay in memory.
        self.prompt_ids = array("i", self.prompt_ids)

    @property
    def context_tokens(self) -> int:
        """Prompt plus generation budget: the context the server must hold for it."""
        return len(self.prompt_ids) + self.max_new_tokens


# Records are written with "id" first (dict order): reading ids needs no full JSON parse, which
# matters when resuming over GBs of token ids.
_ID_PREFIX = re.compile(rb'\{"id": ("(?:[^"\\]|\\.)*")')


def line_ids(path: Path, suffix: bytes | None = None) -> set[str]:
    """Ids of the complete lines of a JSONL file (a torn last line is ignored), optionally only
    of lines ending with `suffix`."""
    ids = set()
    if not Path(path).exists():
        return ids
    with Path(path).open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a torn last line: JsonlAppender cuts it before appending
            if suffix is not None and not line.rstrip().endswith(suffix):
                continue
            m = _ID_PREFIX.match(line)
            ids.add(json.loads(m.group(1)) if m else json.loads(line)["id"])
    return ids


def write_in_job_order(path: Path, ids: list[str]) -> None:
    """Rewrite a JSONL output with one line per id, in the order of `ids` (lines of other ids
    after them, in file order); of lines sharing an id the last wins. Streams: only each line's
    offset is held, so a multi-GB file costs its index, not its size. Atomic: a kill leaves the
    old file (and a temp the next run sweeps)."""
    path = Path(path)
    if not path.exists():
        return
    where: dict[str, tuple[int, int]] = {}
    with path.open("rb") as f:
        offset = 0
        for line in f:
            if not line.endswith(b"\n"):
                break  # a torn last line: not a record
            m = _ID_PREFIX.match(line)
            rid = json.loads(m.group(1)) if m else json.loads(line)["id"]
            where.pop(rid, None)  # the last line of an id wins, at its own place
            where[rid] = (offset, len(line))
            offset += len(line)
    rank = {rid: k for k, rid in enumerate(ids)}
    order = sorted(where, key=lambda rid: rank.get(rid, len(rank)))  # stable: others in file order
    need = sum(size for _, size in where.values())
    with path.open("rb") as src, atomic_writer(path, expected_bytes=need) as out:
        for rid in order:
            start, size = where[rid]
            src.seek(start)
            out.write(src.read(size))


def done_ids(out_dir: Path) -> set[str]:
    """Ids finished by earlier runs: in tokenized.jsonl, or answered and dropped on purpose."""
    out_dir = Path(out_dir)
    return line_ids(out_dir / "tokenized.jsonl") | line_ids(out_dir / "raw.jsonl",
                                                            b'"kept": false}')


def tokenize_kept(conv: dict, renderer: ChatRenderer, max_seq_len: int) -> Iterator[dict]:
    """Records for a conversation kept as is: one per user segment (see eagle3.core.chat)."""
    samples = list(renderer.supervised_samples(conv["messages"], conv.get("tools")))
    for k, (ids, mask, n_prompt) in enumerate(samples):
        if len(ids) > max_seq_len:
            raise RenderError(f"too long: {len(ids)} tokens > max_seq_len {max_seq_len}")
        rid = conv["id"] if len(samples) == 1 else f"{conv['id']}#{k}"
        yield TokenizedRecord(rid, conv["source"], ids, mask, n_prompt, "dataset").to_json()


def build_job(conv: dict, renderer: ChatRenderer, max_seq_len: int,
              max_new_tokens: int) -> GenerationJob:
    """The generation job of a conversation, or RenderError saying why it has none."""
    prompt_msgs, _ = split_for_generation(conv["messages"])
    if not prompt_msgs or prompt_msgs[-1]["role"] not in ("user", "tool"):
        raise RenderError("no prompt: the conversation does not end in a user or tool turn "
                          "before its last assistant reply")
    prompt = renderer.prompt_ids(prompt_msgs, conv.get("tools"))
    budget = min(max_new_tokens, max_seq_len - len(prompt))
    if budget < 1:
        raise RenderError(f"too long: prompt has {len(prompt)} tokens, max_seq_len {max_seq_len}")
    return GenerationJob(conv["id"], conv["source"], prompt, budget, prompt_msgs,
                         conv.get("tools"))


def generated_record(job: GenerationJob, output_ids: list[int], finish_reason: str) -> dict:
    """The tokenized record of a reply generated as ids: prompt + output, output supervised."""
    return TokenizedRecord(job.id, job.source, job.prompt_ids.tolist() + output_ids,
                           [0] * len(job.prompt_ids) + [1] * len(output_ids),
                           len(job.prompt_ids), finish_reason).to_json()


TEXT_MISMATCH_LIST = "text_mismatch.jsonl"


def list_text_mismatches(out_dir: Path) -> dict:
    """`<out_dir>/text_mismatch.jsonl`: the records kept whose answer's text disagreed with its
    output ids, one `{"id", "file", "reason"}` line each (the skip list's shape), rebuilt from
    `raw.jsonl` (the last line of each id, as `write_in_job_order` leaves it), so that a
    resumed run lists those of every run; removed when there are none. Returns the manifest's
    counts: `text_mismatch`, `text_mismatch_list` (None when empty), `text_mismatch_first`."""
    raw_path, path = Path(out_dir) / "raw.jsonl", Path(out_dir) / TEXT_MISMATCH_LIST
    rows: dict[str, dict] = {}
    if raw_path.exists():
        with raw_path.open("rb") as f:
            for line in f:  # streams; only the lines naming a mismatch are parsed
                if b'"text_mismatch": "' not in line or not line.endswith(b"\n"):
                    continue
                raw = json.loads(line)
                if raw.get("kept") and isinstance(raw.get("text_mismatch"), str):
                    rows[raw["id"]] = {"id": raw["id"], "file": str(raw_path),
                                       "reason": raw["text_mismatch"]}
    if rows:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values())
        atomic_write_bytes(path, lines.encode())
    else:
        path.unlink(missing_ok=True)
    first = next(iter(rows.values()), None)
    return {"text_mismatch": len(rows), "text_mismatch_list": str(path) if rows else None,
            "text_mismatch_first": f"{first['id']}: {first['reason']}" if first else None}


class RecordSink:
    """The three append-only outputs of a regenerated dataset, written in a crash-safe order.
    `todo`: the answers this run expects, for the bytes a full disk would still need."""

    def __init__(self, out_dir: Path, keep_length: bool = True, todo: int = 0):
        self.out = JsonlAppender(out_dir / "tokenized.jsonl")
        self.raw = JsonlAppender(out_dir / "raw.jsonl")
        # Rebuilt on every run: the records that failed before are tried again.
        (out_dir / "failures.jsonl").unlink(missing_ok=True)
        self.failures = JsonlAppender(out_dir / "failures.jsonl")
        self.keep_length, self.todo = keep_length, todo
        self.counts = {"generated": 0, "stop": 0, "length": 0, "dropped_length": 0,
                       "failed": 0, "output_tokens": 0}
        self.failure_reasons: dict[str, int] = {}
        self.line_bytes = 0  # bytes of the lines given to the appenders so far

    def add(self, record: dict, raw: dict) -> bool:
        """Write one answer (raw) and its record unless dropped; True when the record is kept."""
        reason = record["finish_reason"]
        kept = self.keep_length or reason != "length"
        # raw first: a kill between the two writes repeats this raw line on resume (harmless)
        # rather than losing it; `kept: false` marks the record done without a record.
        self._write(self.raw, {**raw, "kept": kept})
        with self._disk(self.raw, 0):
            self.raw.hand_to_os()  # else a kill could keep the record and lose its raw line
        self.counts["generated"] += 1
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.counts["output_tokens"] += record["n_response_tokens"]
        if kept:
            self._write(self.out, record)
        else:
            self.counts["dropped_length"] += 1
        return kept

    def _write(self, appender: JsonlAppender, line: dict) -> None:
        size = len(json.dumps(line, ensure_ascii=False).encode()) + 1
        with self._disk(appender, size):
            appender.write(line)
        self.line_bytes += size

    def _disk(self, appender: JsonlAppender, size: int):
        """DiskError naming the file, with the bytes the rest of this run needs: this line
        plus the answers still to come at the mean size of those written so far."""
        done = self.counts["generated"] + self.counts["failed"]
        left = max(self.todo - done, 0) * self.line_bytes // max(done, 1)
        return disk_errors_named(appender.path, size + left or None)

    def fail(self, record_id: str, kind: str, reason: str, attempts: int) -> None:
        """A record that could not be generated (`kind`: a short class of `reason`, for the
        summary); re-running the stage tries it again."""
        self._write(self.failures, {"id": record_id, "kind": kind, "reason": reason,
                                    "attempts": attempts})
        self.counts["failed"] += 1
        self.failure_reasons[kind] = self.failure_reasons.get(kind, 0) + 1
        log.debug("record %s failed after %d attempts: %s", record_id, attempts, reason)

    def flush(self) -> None:
        for f in (self.raw, self.out, self.failures):
            with self._disk(f, 0):
                f.flush()

    def close(self) -> None:
        """Close every file, then raise the first error (a full disk) of any."""
        first = None
        for f in (self.raw, self.out, self.failures):
            try:
                with self._disk(f, 0):
                    f.close()
            except DiskError as e:
                first = first or e
        if first is not None:
            raise first


class HFGenerator:
    """Greedy generation through transformers' `model.generate` (`--hf-engine generate`: any
    target transformers runs; the reference the fast engine is tested against)."""

    def __init__(self, model, eos_ids: list[int], pad_id: int):
        self.model = model
        self.eos_ids = eos_ids
        self.pad_id = pad_id

    def generate(self, jobs: list[GenerationJob]) -> list[tuple[list[int], str]]:
        """(output ids, finish reason) per job; output stops after the first eos id."""
        import torch

        device = self.model.device
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, j in enumerate(jobs):  # left padding: generation continues every row at the end
            ids[b, width - len(j.prompt_ids):] = torch.tensor(j.prompt_ids.tolist())
            attn[b, width - len(j.prompt_ids):] = 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                max_new_tokens=max(j.max_new_tokens for j in jobs),
                do_sample=False,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
            )[:, width:].tolist()
        return [cut_output(row, j.max_new_tokens, self.eos_ids)
                for j, row in zip(jobs, out, strict=True)]


def seed_of(*parts) -> int:
    """A 63-bit sampling seed from what names a batch (a dataset seed, a round, a record id)."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def padding_id(tokenizer, fallback: int) -> int:
    """The id left padding uses: the tokenizer's pad token, else `fallback` (an eos id; padded
    positions are masked, so any id serves)."""
    return fallback if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def cut_output(row: list[int], budget: int, eos_ids) -> tuple[list[int], str]:
    """Generated ids cut to `budget` and after the first eos id (kept): (ids, 'stop'|'length')."""
    row = row[:budget]
    stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
    return (row, "length") if stop is None else (row[: stop + 1], "stop")


def run_generation(jobs: list[GenerationJob], generator, sink: RecordSink,
                   done: set[str], batch_size: int, bar, stop=None) -> dict:
    """hf backend: generate every job not in `done` in fixed batches; returns the sink's counts.
    `stop` (an `eagle3.core.faults.StopSignals`) is checked after each batch is written.

    Fixed batches over a fixed order (longest first) are identical on every run, and a batch
    with any missing record is regenerated whole, so a resumed run writes the same tokens as an
    uninterrupted one (padding changes a batch's numerics, so batches must not be re-formed).
    """
    order = sorted(jobs, key=lambda j: (-len(j.prompt_ids), j.id))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        if all(j.id in done for j in batch):
            bar.update(len(batch))
            continue
        for job, (output, reason) in zip(batch, generator.generate(batch), strict=True):
            if job.id in done:
                continue
            sink.add(generated_record(job, output, reason),
                     {"id": job.id, "backend": "hf", "output_ids": output,
                      "finish_reason": reason})
        sink.flush()
        bar.update(len(batch))
        if stop is not None:
            stop.check()
    return sink.counts
