"""Comparing whole stage folders: what a killed and resumed stage must equal."""

from __future__ import annotations

import json
from pathlib import Path

VOLATILE = ("started", "finished", "seconds", "argv")  # manifest fields that tell the run time


def stage_snapshot(stage_dir: Path, workdir: Path, run_counts: tuple = ()) -> dict[str, bytes]:
    """Every file of a stage folder by relative name with its bytes; manifest.json without its
    timestamps and without the `run_counts` it has under each output (what this run did, such
    as 02b's `written` / `skipped_existing`), and the workdir's path written `<workdir>` (two
    runs live in two folders)."""
    out = {}
    for p in sorted(Path(stage_dir).rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "manifest.json" and p.parent == Path(stage_dir):
            manifest = {k: v for k, v in json.loads(data).items() if k not in VOLATILE}
            for entry in manifest.get("outputs", {}).values():
                if isinstance(entry, dict):
                    for key in run_counts:
                        entry.pop(key, None)
            data = json.dumps(manifest, sort_keys=True).encode()
        out[str(p.relative_to(stage_dir))] = data.replace(str(workdir).encode(), b"<workdir>")
    return out


def assert_same_folder(got_dir: Path, got_workdir: Path, want_dir: Path,
                       want_workdir: Path, run_counts: tuple = ()) -> None:
    got = stage_snapshot(got_dir, got_workdir, run_counts)
    want = stage_snapshot(want_dir, want_workdir, run_counts)
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    assert [n for n in want if got[n] != want[n]] == []
