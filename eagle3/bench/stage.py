"""Stage 05's door: `check_only(cfg)`, `check_inputs(cfg)` before the stage folder is opened,
`run(cfg, stage, check)` after.

The backends (`eagle3/bench/hf.py` offline; `eagle3/bench/sglang.py`, `eagle3/bench/vllm.py`
against servers, over the shared measuring code in `eagle3/bench/measure.py`) each expose
`default_draft(workdir)`, `check_draft(cfg, draft_dir) -> DraftCheck`, `check_only(cfg,
draft_dir) -> exit code` and `measure(cfg, draft_dir, sets, stage_dir, renderer, check, stop)
-> results`: adding a backend is one module and one entry in `BACKENDS` (with its name in
`eagle3/bench/config.py`).

Faults (eagle3/bench/faults.py): the draft folder's files are checked before anything starts
(eagle3/bench/draft_files.py); bad prompt-set lines are skipped into `skipped.jsonl` up to
`--max-bad`; requests that fail for good are listed in `failed_requests.jsonl`, counted in
results.json and the summary, and make the exit code 1; a server or preflight failure is one
`BenchmarkError` line; a SIGTERM writes the levels measured so far as a partial results.json
(the stage stays incomplete) and exits 128 + 15.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3.bench import hf, sglang, vllm
from eagle3.bench.config import BenchmarkConfig, DraftCheck
from eagle3.bench.draft_files import check_draft_files
from eagle3.bench.faults import (
    FAILED_FILE,
    BenchmarkError,
    BenchmarkRefused,
    BenchStop,
    PartialRun,
)
from eagle3.bench.plots import write_plots
from eagle3.bench.prompts import EVAL_SET, load_prompt_set
from eagle3.bench.report import report_markdown, summary_rows
from eagle3.core.chat import ChatRenderer
from eagle3.core.faults import BadRecords
from eagle3.core.launcher import LaunchError
from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.core.progress import human_seconds
from eagle3.core.server import ServerError
from eagle3.core.stage import (
    STAGE_DIRS,
    Stage,
    StageResult,
    atomic_write_bytes,
    atomic_write_json,
    require_upstream,
)
from eagle3.core.target import load_tokenizer

__all__ = ["BACKENDS", "BenchmarkConfig", "STAGE", "check_inputs", "check_only", "run"]

STAGE = STAGE_DIRS["05"]
BACKENDS = {"hf": hf, "sglang": sglang, "vllm": vllm}


def draft_dir(cfg: BenchmarkConfig) -> Path:
    """--draft, else the folder of 04's that the backend serves."""
    return cfg.draft or BACKENDS[cfg.backend].default_draft(cfg.workdir)


def check_only(cfg: BenchmarkConfig) -> int:
    """`--check-only`: the draft's files, then the backend's preflight alone, printed; 0 ok, 1
    refused (a damaged file or a server that cannot be asked: a StageError, one line)."""
    draft = draft_dir(cfg)
    check_draft_files(draft)
    with as_stage_errors():
        return BACKENDS[cfg.backend].check_only(cfg, draft)


@contextlib.contextmanager
def as_stage_errors() -> Iterator[None]:
    """Preflight refusals and server failures as StageErrors: one stderr line, exit 1."""
    try:
        yield
    except BenchmarkError:
        raise
    except PreflightError as e:
        raise BenchmarkRefused(str(e)) from e
    except (ServerError, LaunchError, vllm.VllmError) as e:
        raise BenchmarkError(f"{e}. Check the server (its log: 05_benchmark/server_*.log when "
                             "launched here), then re-run the same command") from e


def check_inputs(cfg: BenchmarkConfig) -> DraftCheck:
    """Upstream folders and the draft, before any folder is made or server started."""
    draft = draft_dir(cfg)
    if EVAL_SET in cfg.prompt_sets:
        require_upstream(cfg.workdir / STAGE_DIRS["merge"], cfg.allow_partial)
    if cfg.draft is None:
        require_upstream(cfg.workdir / STAGE_DIRS["04"], cfg.allow_partial)
    check_draft_files(draft)
    with as_stage_errors():
        check = BACKENDS[cfg.backend].check_draft(cfg, draft)
        raise_on_errors(check.problems, f"draft {draft}")
    return check


def run(cfg: BenchmarkConfig, stage: Stage, check: DraftCheck) -> StageResult:
    """Measure every prompt set; results.json, report.md and plots; the summary rows."""
    t0, draft = time.time(), draft_dir(cfg)
    renderer = (ChatRenderer(load_tokenizer(cfg.target, cfg.trust_remote_code)) if cfg.target
                else None)
    bad = BadRecords(stage.dir, cfg.max_bad)
    try:
        sets = [load_prompt_set(s, cfg.workdir, renderer, cfg.num_prompts, bad)
                for s in cfg.prompt_sets]
    finally:
        bad.close()
    if EVAL_SET in cfg.prompt_sets:
        stage.add_input(cfg.workdir / STAGE_DIRS["merge"] / "eval.jsonl")
    results = {"backend": cfg.backend, "draft": str(draft), "layers": check.layers,
               "preflight": [str(p) for p in check.problems],
               "prompts": {ps.name: len(ps.prompts) for ps in sets}, **bad.summary()}
    with as_stage_errors(), BenchStop() as stop:
        try:
            measured = BACKENDS[cfg.backend].measure(cfg, draft, sets, stage.dir, renderer,
                                                     check, stop)
        except PartialRun as e:
            write_partial(stage.dir, {**results, **e.partial}, e.signum)
            raise
    results["preflight"] += measured.pop("preflight", [])  # the servers' own checks
    results.update(measured)
    results["failed_requests"] = failed_requests(results, stage.dir)
    atomic_write_json(stage.dir / "results.json", results)
    atomic_write_bytes(stage.dir / "report.md", report_markdown(results).encode())
    plots = write_plots(results, stage.dir)
    outputs, rows, ok = summary_rows(results)
    stage.finish(outputs=outputs, extra=bad.summary())
    rows.update(plots=", ".join(p.name for p in plots), layers=check.layers,
                time=human_seconds(time.time() - t0))
    return StageResult(rows, 0 if ok else 1)


def failed_requests(results: dict, stage_dir: Path) -> int:
    """Requests that failed for good over every level and server (server backends), with
    their list."""
    roles = ["baseline", *(s["role"] for s in results.get("settings") or [{"role": "speculative"}])]
    n = sum((row.get(role) or {}).get("failed_requests", 0)
            for levels in results.get("prompt_sets", {}).values() if results["backend"] != "hf"
            for row in levels.values() for role in roles)
    if n:
        results["failed_requests_file"] = str(stage_dir / FAILED_FILE)
    return n


def write_partial(stage_dir: Path, results: dict, signum: int) -> None:
    """results.json and report.md of a stopped run, marked partial; no plots, no manifest."""
    results.update(partial=True, stopped_by=signal.Signals(signum).name)
    atomic_write_json(stage_dir / "results.json", results)
    atomic_write_bytes(stage_dir / "report.md", report_markdown(results).encode())
