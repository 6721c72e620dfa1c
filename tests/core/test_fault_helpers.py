"""The fault helpers themselves: a disk filled while a stage writes to it is full, not an error
in the test (the CI failure this guards: the stage took the space between the helper's look at
the free space and its write, and the helper's own write raised ENOSPC)."""

from __future__ import annotations

import os

import pytest
from fault_helpers import fill_disk, small_disk


def test_fill_disk_leaves_the_asked_room_and_stops_at_enospc_when_the_space_is_taken_first(
        tmp_path, monkeypatch):
    with small_disk(tmp_path / "disk", kib=512) as disk:
        if disk is None:
            pytest.skip("cannot mount a small tmpfs here (not root)")
        fill_disk(disk, leave=64 * 1024)
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        assert 48 * 1024 <= free <= 80 * 1024
        (disk / "ballast").unlink()

        real = os.statvfs

        def seen_before_another_writer(path):  # the free space as seen before a writer took it
            stat = real(path)
            (disk / "stage").write_bytes(b"\0" * (200 * 1024))
            return stat

        monkeypatch.setattr(os, "statvfs", seen_before_another_writer)
        ballast = fill_disk(disk, leave=8_000)
        monkeypatch.setattr(os, "statvfs", real)
        assert os.statvfs(disk).f_bavail == 0 and ballast.stat().st_size > 0
