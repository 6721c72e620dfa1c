"""The production scripts run in-process for the reference benchmark, timed and recorded.

Each stage is the numbered script's own `main(argv)` (imported from its file, `sys.argv` set
to the command line so the manifest records it), so the benchmark runs exactly the code a user
runs, without paying interpreter and import start-up per stage on the GPU machine. Around each
call the runner records wall time and the peak GPU memory torch allocated; the stage's manifest
gives its own time, disk and outputs. A stage whose manifest is already complete is not called
again (the stage itself would be a no-op), so a re-run phase resumes where it stopped.

Also: work folders that share upstream stages through symlinks (one 05 run per folder), a
subset of the merged data for the data-size study, and exporting a 04 checkpoint as a draft.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.records import read_jsonl
from eagle3.core.stage import (
    MANIFEST,
    STAGE_DIRS,
    atomic_write_bytes,
    atomic_write_json,
    read_manifest,
)
from eagle3.extract.writer import INDEX_FILE

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"01": "01_prepare_datasets.py", "01b": "01b_generate_synthetic.py",
           "merge": "datasets/merge_and_shuffle.py", "02b": "02b_extract_hidden_states_sglang.py",
           "03": "03_build_vocab_mapping.py", "04": "04_train.py", "05": "05_benchmark.py"}
_MODULES: dict[str, object] = {}


class StageFailed(RuntimeError):
    """A production stage exited with an error; the message names it and its command line."""


def script_module(stage: str):
    """The script of `stage` imported from its file (scripts are not a package)."""
    if stage not in _MODULES:
        path = ROOT / SCRIPTS[stage]
        spec = importlib.util.spec_from_file_location(f"_pipeline_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
        _MODULES[stage] = module
    return _MODULES[stage]


@dataclass
class StageRecord:
    label: str
    stage: str
    workdir: str
    command: str
    rc: int = 0
    wall_s: float = 0.0
    peak_gpu_bytes: int | None = 0  # None: ran in a subprocess, not measured
    manifest: dict = field(default_factory=dict)
    side_by_side: bool = False  # a subprocess beside the phase-3 evaluations


def _manifest_summary(m: dict | None) -> dict:
    if not m:
        return {}
    keys = ("seconds", "disk_bytes", "outputs", "args", "started", "finished", "complete",
            "capture_layers", "hidden_size")
    return {k: m.get(k) for k in keys}


class StageRunner:
    """Runs stages and keeps their records in `<results>/stages.json` (by label)."""

    def __init__(self, results_dir: Path):
        self.path = Path(results_dir) / "stages.json"
        self.records: dict[str, dict] = (json.loads(self.path.read_text())
                                         if self.path.exists() else {})

    def run(self, label: str, stage: str, workdir: Path, args: list,
            ok_codes: tuple[int, ...] = (0,)) -> dict:
        """Run `stage` on `workdir` with `args` (unless already complete); returns its record."""
        stage_dir = Path(workdir) / STAGE_DIRS[stage]
        manifest = read_manifest(stage_dir)
        if manifest and manifest.get("complete") and label in self.records:
            log.info("%s: %s already complete, skipped", label, stage_dir)
            return self.records[label]
        argv = ["--workdir", str(workdir), *map(str, args)]
        command = " ".join(["python", SCRIPTS[stage], *argv])
        log.info("%s: %s", label, command)
        rc, wall, peak = self._timed(lambda: self._main(stage, argv))
        return self._record(StageRecord(label, stage, str(workdir), command, rc, wall, peak,
                                        _manifest_summary(read_manifest(stage_dir))), ok_codes)

    def record_external(self, label: str, stage: str, workdir: Path, args: list[str], rc: int,
                        wall_s: float) -> dict:
        """Record a stage that ran as a subprocess (phase 3) with `args` (after the script):
        its peak GPU memory is unknown here."""
        stage_dir = Path(workdir) / STAGE_DIRS[stage]
        command = " ".join(["python", SCRIPTS[stage], *args])
        self.records[label] = asdict(StageRecord(
            label, stage, str(workdir), command, rc, wall_s, None,
            _manifest_summary(read_manifest(stage_dir)), side_by_side=True))
        atomic_write_json(self.path, self.records)
        return self.records[label]

    def run_callable(self, label: str, fn, command: str, workdir: Path) -> dict:
        """Run a step of the benchmark's own (corpus, target) with the same bookkeeping."""
        if self.records.get(label, {}).get("rc") == 0:
            return self.records[label]
        log.info("%s: %s", label, command)
        rc, wall, peak = self._timed(fn)
        return self._record(StageRecord(label, "reference", str(workdir), command, rc, wall,
                                        peak), (0,))

    def _record(self, record: StageRecord, ok_codes: tuple[int, ...]) -> dict:
        self.records[record.label] = asdict(record)
        atomic_write_json(self.path, self.records)
        if record.rc not in ok_codes:
            raise StageFailed(f"{record.label}: `{record.command}` exited with {record.rc}")
        return self.records[record.label]

    @staticmethod
    def _main(stage: str, argv: list[str]) -> int:
        saved, sys.argv = sys.argv, [SCRIPTS[stage], *argv]
        try:
            return script_module(stage).main(argv) or 0
        finally:
            sys.argv = saved

    @staticmethod
    def _timed(fn) -> tuple[int, float, int]:
        """(exit code, wall seconds, peak GPU bytes allocated) of `fn()`."""
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            rc = fn() or 0
        except SystemExit as e:  # argparse errors and scripts that exit
            rc = e.code if isinstance(e.code, int) else 1
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return rc, wall, peak


# ---------------------------------------------------------------- work folders


def linked_workdir(workdir: Path, links: dict[str, Path]) -> Path:
    """A work folder whose upstream stage folders are symlinks to existing ones."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        link = workdir / name
        if link.is_symlink() or link.exists():
            if link.resolve() == Path(target).resolve():
                continue
            raise FileExistsError(f"{link} exists and is not a link to {target}")
        link.symlink_to(Path(target).resolve(), target_is_directory=True)
    return workdir


def subset_workdir(source: Path, workdir: Path, num_train: int) -> Path:
    """A work folder whose merged data is the first `num_train` records of `source`'s train split
    (already a seeded shuffle) and the same eval split: the input of the data-size study.

    Its `01c_merged/manifest.json` says where the records come from; every later stage runs on
    it as on any merged folder.
    """
    src, dst = Path(source) / STAGE_DIRS["merge"], Path(workdir) / STAGE_DIRS["merge"]
    if (read_manifest(dst) or {}).get("complete"):
        return Path(workdir)
    dst.mkdir(parents=True, exist_ok=True)
    with (src / "train.jsonl").open("rb") as f, (dst / "train.jsonl").open("wb") as out:
        for n, line in enumerate(f):
            if n >= num_train:
                break
            out.write(line)
    shutil.copyfile(src / "eval.jsonl", dst / "eval.jsonl")
    upstream = read_manifest(src) or {}
    atomic_write_json(dst / MANIFEST, {
        "stage": STAGE_DIRS["merge"], "complete": True, "seconds": 0.0,
        "derived_from": str(src), "outputs": {"train": num_train,
                                              "eval": upstream.get("outputs", {}).get("eval")},
        "note": f"first {num_train} records of {src / 'train.jsonl'} (a seeded shuffle) and its "
                "eval split unchanged: the data-size study of the reference benchmark"})
    return Path(workdir)


def link_states(source_02b: Path, dest_02b: Path, num_train: int) -> int:
    """Seed a data-size folder's 02b output with hard links to the files `source_02b` holds
    for the same records: the first `num_train` of the train split (a `subset_workdir`'s train
    split is the source's first lines) and the whole eval split, with their index lines. 02b
    then resumes over them (each file's record id is checked against the split) and extracts
    only what the source lacks: the same states, no second prefill, no disk. Returns the files
    linked; nothing when `dest_02b` is complete."""
    if (read_manifest(dest_02b) or {}).get("complete"):
        return 0
    linked = 0
    for split, limit in (("train", num_train), ("eval", None)):
        index = Path(source_02b) / split / INDEX_FILE
        if not index.exists():
            continue
        entries = [e for e in read_jsonl(index) if limit is None or e["idx"] < limit]
        for e in entries:
            src, dst = hs.file_path(index.parent, e["idx"]), hs.file_path(
                Path(dest_02b) / split, e["idx"])
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                os.link(src, dst)
                linked += 1
        atomic_write_bytes(Path(dest_02b) / split / INDEX_FILE,
                           "".join(json.dumps(e, ensure_ascii=False) + "\n"
                                   for e in entries).encode())
    log.info("%s: %d hidden-state files linked from %s", dest_02b, linked, source_02b)
    return linked


def export_checkpoint(step_dir: Path, draft_config: dict, out_dir: Path) -> Path:
    """Export a 04 step checkpoint (`state.pt`) as an SGLang draft folder."""
    from eagle3.draft.export import export_sglang
    from eagle3.draft.mla import build_draft_model
    from eagle3.draft.model import DraftConfig

    if (Path(out_dir) / "model.safetensors").exists():
        return Path(out_dir)
    from eagle3.train.checkpoint import load_state

    state = load_state(Path(step_dir) / "state.pt")  # weights_only=True, as 04 resumes
    fields = DraftConfig.__dataclass_fields__
    draft = build_draft_model(DraftConfig(**{k: v for k, v in draft_config.items()
                                             if k in fields}))
    draft.load_state_dict(state["model"])
    return export_sglang(draft, out_dir)
