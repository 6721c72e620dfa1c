#!/usr/bin/env python3
"""Loop share of any results file: the library's definition (eagle3/core/loops.py) on every
list stored under a key named `output_ids`.

    python reference/loop_share.py RESULTS.json     # any JSON holding per-prompt output ids
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3.core.loops import LoopStats, loop_mask, loop_stats  # noqa: F401  (re-exported)


def find_output_ids(obj) -> list[list[int]]:
    """Every list stored under a key named `output_ids` (lists of ints), depth first."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "output_ids" and isinstance(v, list) and all(isinstance(t, int) for t in v):
                found.append(v)
            else:
                found.extend(find_output_ids(v))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(find_output_ids(v))
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python reference/loop_share.py RESULTS.json", file=sys.stderr)
        return 2
    outputs = find_output_ids(json.loads(Path(argv[0]).read_text()))
    stats = loop_stats(outputs)
    print(json.dumps({k: v for k, v in stats.to_dict().items() if k != "first_loop"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
