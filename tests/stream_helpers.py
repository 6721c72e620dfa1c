"""Work folders for stream-mode tests: what 02b and 04 need, taken from the demo run."""

from __future__ import annotations

import shutil
from pathlib import Path


def stream_workdir(demo_run: Path, dst: Path) -> Path:
    """The demo's merged splits and vocab copied, its target linked: 02b and 04 to run (what
    the reference pipeline's phase 1 plus 03 leave)."""
    dst.mkdir(parents=True)
    for name in ("01c_merged", "03_vocab"):
        shutil.copytree(demo_run / name, dst / name)
    (dst / "target").symlink_to(demo_run / "target")
    return dst
