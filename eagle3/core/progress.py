"""Progress bars with rate and ETA, and the one-screen summary every stage ends with."""

from __future__ import annotations

import logging
import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

log = logging.getLogger(__name__)
T = TypeVar("T")


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it") -> tqdm:
    """A tqdm bar on stderr showing count, rate and ETA; refreshes at most twice a second.

    Under a non-interactive stderr (logs, CI) it still prints, at a lower rate.
    """
    interactive = sys.stderr.isatty()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        mininterval=0.5 if interactive else 10.0,
        smoothing=0.1,
        file=sys.stderr,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def human_seconds(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def format_summary(title: str, rows: dict) -> str:
    """A boxed key/value table."""
    width = max([len(k) for k in rows] + [10])
    lines = [f"== {title} " + "=" * max(0, 60 - len(title))]
    for k, v in rows.items():
        if isinstance(v, float):
            v = f"{v:,.3f}"
        elif isinstance(v, int):
            v = f"{v:,}"
        lines.append(f"  {k:<{width}}  {v}")
    lines.append("=" * 64)
    return "\n".join(lines)
