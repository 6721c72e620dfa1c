"""Preflight results shared by every check: a Problem (error or warning) and the error they raise.

A check returns a list of Problems, each naming the flag or file and the fix; the caller decides
when to stop, with `raise_on_errors`. The checks live with what they check: the dump server in
`eagle3/extract/dump_server.py`, a draft folder in `eagle3/draft/check.py`, the servers a benchmark
compares in `eagle3/bench/preflight.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Problem:
    level: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


class PreflightError(RuntimeError):
    """A configuration that must not be used; the message lists every error and its fix."""


def raise_on_errors(problems: list[Problem], what: str) -> None:
    for p in problems:
        if p.level == "warning":
            log.warning("%s: %s", what, p.message)
    errors = [p for p in problems if p.level == "error"]
    if errors:
        raise PreflightError(f"{what} failed preflight:\n" + "\n".join(f"  - {p}" for p in errors))
