"""Preflight of the dump server 02b reads: every flag that makes the dump incomplete is refused."""

from __future__ import annotations

import pytest

from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.extract.dump_server import check_dump_server


def test_raise_on_errors_lists_every_error_when_several_fail():
    problems = check_dump_server({"speculative_algorithm": "EAGLE3", "enable_mixed_chunk": True})
    with pytest.raises(PreflightError) as e:
        raise_on_errors(problems, "dump server")
    assert "--disable-radix-cache" in str(e.value) and "--enable-mixed-chunk" in str(e.value)
