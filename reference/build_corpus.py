#!/usr/bin/env python3
"""Reference corpus: the interpreter's standard library cast as chat samples.

Every `.py` file of the running interpreter's standard library (`sysconfig` "stdlib" path; test
folders, site-packages and generated tables excluded) is cut where a definition starts (`def`,
`async def`, `class`, or the first decorator above one). A sample at cut c is

    user:      an instruction naming the file, then the file's text before c (whole lines,
               at most --max-context-chars: the file's beginning when it is short enough)
    assistant: the text from c up to a later cut (at least --min-continuation-chars, at most
               --max-continuation-chars, whole lines), so replies end where a definition ends

Files are split into train and held-out sets by a hash of their path: held-out files give the
evaluation prompts (one per file, at its first cut) and nothing else, so neither the target, the
generation stage nor the draft ever sees them.

Writes into --out (`corpus.json` last; its presence with the same config means done):
    target_train.jsonl    every train-file sample: what the reference target is trained on
    pipeline_train.jsonl  a fixed subset of them, the rows stage 01 prepares and 01b regenerates
    heldout.jsonl         held-out prompts (with the file's real continuation as the reply)
    recipe_train.json     stage-01 recipe of pipeline_train.jsonl (OpenAI `messages` adapter)
  recipe_heldout.json   stage-01 recipe of heldout.jsonl (never regenerated: prompts for 05)
    split.json            the train and held-out file lists

    python reference/build_corpus.py --out /tmp/ref/corpus
    python reference/build_corpus.py --out /tmp/smoke/corpus --max-files 30 --pipeline-samples 40
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import arg, config_dict, parse_config, setup_logging
from eagle3.core.progress import format_summary
from eagle3.core.stage import atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

# Folders never read: tests (the brief: real library code only), installed packages, caches,
# and folders of generated tables (codec charmaps, pydoc topic dumps) that are not code anyone
# writes and would teach the target to repeat.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__", "encodings", "pydoc_data"})
EXCLUDED_PREFIXES = ("_sysconfigdata",)  # generated build-configuration dumps
DEFINITION = re.compile(r"^\s*(def |async def |class |@)")
INSTRUCTION = "Continue the Python file `{path}` from where it stops: write the next definition."
DATASET_TRAIN = "stdlib_train"
DATASET_HELDOUT = "stdlib_heldout"


@dataclass
class CorpusConfig:
    out: Path = arg(help="folder the corpus files are written to")
    stdlib: Path | None = arg(None, "standard library folder (default: the running "
                                    "interpreter's, sysconfig.get_paths()['stdlib'])")
    heldout_share: float = arg(0.08, "share of files held out, by path hash (0-0.5)")
    min_context_chars: int = arg(200, "a cut needs at least this much text before it")
    max_context_chars: int = arg(1500, "user text: at most this many characters before the cut")
    min_continuation_chars: int = arg(120, "reply: at least this many characters (merging "
                                           "definitions until reached)")
    max_continuation_chars: int = arg(1200, "reply: at most this many characters (whole lines)")
    pipeline_samples: int = arg(3000, "train samples handed to stage 01 (0 = all)")
    max_files: int = arg(0, "read only N files, chosen by path hash (0 = all; for smoke runs)")
    max_file_bytes: int = arg(400_000, "skip larger files (generated data, not code)")
    max_seq_len: int = arg(1024, "recipe context limit, tokens (prompt + reply) for 01/01b")
    force: bool = arg(False, "rebuild even when a complete corpus with this config exists")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if not 0 < self.heldout_share <= 0.5:
            raise ValueError("--heldout-share must be within (0, 0.5]")
        if self.min_continuation_chars > self.max_continuation_chars:
            raise ValueError("--min-continuation-chars must not exceed --max-continuation-chars")


def stdlib_root(cfg: CorpusConfig) -> Path:
    return Path(cfg.stdlib or sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path, max_file_bytes: int) -> tuple[list[tuple[str, Path]], dict]:
    """(relative path, file) of every usable `.py` file, sorted by path; and skip counts."""
    files, skipped = [], {"excluded_dir": 0, "generated": 0, "too_large": 0}
    for path in sorted(Path(root).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in rel.split("/")[:-1]):
            skipped["excluded_dir"] += 1
        elif path.name.startswith(EXCLUDED_PREFIXES):
            skipped["generated"] += 1
        elif path.stat().st_size > max_file_bytes:
            skipped["too_large"] += 1
        else:
            files.append((rel, path))
    return files, skipped


def path_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def is_heldout(rel_path: str, share: float) -> bool:
    """Stable split by path: the same file always lands on the same side."""
    return path_hash(rel_path) % 1_000_000 < share * 1_000_000


def cut_points(lines: list[str]) -> list[int]:
    """Indices of lines where a definition starts; a decorated one starts at its first `@`."""
    cuts = []
    for i, line in enumerate(lines):
        if DEFINITION.match(line) and not (i and lines[i - 1].lstrip().startswith("@")):
            cuts.append(i)
    return cuts


def _context(lines: list[str], cut: int, max_chars: int) -> str:
    """The whole lines before `cut`, as many as fit in `max_chars` counted back from the cut."""
    kept, size = [], 0
    for line in reversed(lines[:cut]):
        if size + len(line) > max_chars:
            break
        kept.append(line)
        size += len(line)
    return "".join(reversed(kept))


def _continuation(lines: list[str], cut: int, later_cuts: list[int], cfg: CorpusConfig) -> str:
    """From `cut` to the first later cut giving >= min chars, capped at max chars (whole lines)."""
    end = len(lines)
    for c in later_cuts:
        if sum(len(x) for x in lines[cut:c]) >= cfg.min_continuation_chars:
            end = c
            break
    text, size = [], 0
    for line in lines[cut:end]:
        if size + len(line) > cfg.max_continuation_chars:
            break
        text.append(line)
        size += len(line)
    return "".join(text).rstrip() + "\n" if text else ""


def make_row(rel_path: str, line: int, context: str, continuation: str) -> dict:
    """A conversation row in the OpenAI `messages` schema (stage 01's `openai` adapter)."""
    user = f"{INSTRUCTION.format(path=rel_path)}\n\n```python\n{context}```"
    return {"id": f"{rel_path}:{line + 1}", "path": rel_path, "line": line + 1,
            "messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": continuation}]}


def file_rows(rel_path: str, text: str, cfg: CorpusConfig, first_only: bool = False) -> list[dict]:
    """The samples of one file (only the first usable cut when `first_only`)."""
    lines = text.replace("\r\n", "\n").splitlines(keepends=True)
    cuts = cut_points(lines)
    rows = []
    for k, cut in enumerate(cuts):
        context = _context(lines, cut, cfg.max_context_chars)
        if len(context) < cfg.min_context_chars:
            continue
        continuation = _continuation(lines, cut, cuts[k + 1:], cfg)
        if len(continuation.strip()) == 0:
            continue
        rows.append(make_row(rel_path, cut, context, continuation))
        if first_only:
            break
    return rows


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def _recipe(name: str, dataset: str, file: str, max_seq_len: int, regenerate: bool) -> dict:
    return {"name": name,
            "description": "Python standard library files as chat samples (reference "
                           "benchmark; built by reference/build_corpus.py)",
            "datasets": [{"name": dataset, "adapter": "openai", "path": file, "id_field": "id",
                          "regenerate": regenerate, "max_seq_len": max_seq_len}]}


def build_corpus(cfg: CorpusConfig) -> dict:
    """Write every corpus file into `cfg.out`; returns the counts (also in corpus.json)."""
    out = Path(cfg.out)
    marker = out / "corpus.json"
    settings = {k: v for k, v in config_dict(cfg).items() if k not in ("force", "log_level")}
    if marker.exists() and not cfg.force:
        done = json.loads(marker.read_text())
        if done.get("config") == settings:
            log.info("corpus already built in %s", out)
            return done
    root = stdlib_root(cfg)
    files, skipped = stdlib_files(root, cfg.max_file_bytes)
    if cfg.max_files:  # a spread-out subset (by path hash), read in path order
        files = sorted(sorted(files, key=lambda f: path_hash(f[0]))[: cfg.max_files])
    train_rows, heldout_rows, split = [], [], {"train": [], "heldout": []}
    for rel, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            log.warning("skipping %s: %s", path, e)
            skipped["unreadable"] = skipped.get("unreadable", 0) + 1
            continue
        held = is_heldout(rel, cfg.heldout_share)
        split["heldout" if held else "train"].append(rel)
        (heldout_rows if held else train_rows).extend(file_rows(rel, text, cfg, first_only=held))
    if not train_rows or not heldout_rows:
        raise RuntimeError(f"{root}: {len(train_rows)} train and {len(heldout_rows)} held-out "
                           "samples; read more files (--max-files) or change --heldout-share")
    # A fixed subset for the pipeline, chosen by id hash (independent of file order).
    ranked = sorted(train_rows, key=lambda r: path_hash(r["id"]))
    pipeline = ranked[: cfg.pipeline_samples] if cfg.pipeline_samples else ranked
    atomic_write_bytes(out / "target_train.jsonl", _jsonl(train_rows))
    atomic_write_bytes(out / "pipeline_train.jsonl", _jsonl(pipeline))
    atomic_write_bytes(out / "heldout.jsonl", _jsonl(heldout_rows))
    atomic_write_json(out / "recipe_train.json", _recipe(
        "stdlib_reference", DATASET_TRAIN, "pipeline_train.jsonl", cfg.max_seq_len, True))
    atomic_write_json(out / "recipe_heldout.json", _recipe("stdlib_reference_heldout",
                                                           DATASET_HELDOUT, "heldout.jsonl",
                                                           cfg.max_seq_len, False))
    atomic_write_json(out / "split.json", split)
    counts = {"config": settings, "stdlib": str(root), "python": sys.version.split()[0],
              "files_train": len(split["train"]), "files_heldout": len(split["heldout"]),
              "files_skipped": skipped, "samples_train": len(train_rows),
              "samples_pipeline": len(pipeline), "samples_heldout": len(heldout_rows),
              "chars_train": sum(len(m["content"]) for r in train_rows for m in r["messages"])}
    atomic_write_json(marker, counts)
    return counts


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(CorpusConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    counts = build_corpus(cfg)
    rows = {k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in counts.items()
            if k != "config"}
    rows["output"] = str(cfg.out)
    print(format_summary("reference corpus", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
