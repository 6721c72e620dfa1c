#!/usr/bin/env python3
"""Start the whole reference run detached, follow it across several commands, collect results.

The full H200 run (phases 1-3) takes longer than one device command may last, and a machine
idle between commands is given back. Run detached, the pipeline never waits on the commands
that follow it: the first call starts it (`--start`), every call waits up to --wait-s for it to
end, prints where it is, rebuilds the summary from the files so far and copies it to --out.

    python3 reference/follow.py --workdir /tmp/ref --start --deadline-s 1450 --wait-s 560 \
        --out $OUT
    python3 reference/follow.py --workdir /tmp/ref --wait-s 560 --out $OUT   # again, if needed
    python3 reference/follow.py --workdir /tmp/refc --profile h200-compare --start \
        --deadline-s 1400 --wait-s 560    # the comparison of issues 16/17 alone

Exit status: the run's own when it has ended, 3 while it is still running.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import arg, parse_config, setup_logging
from reference.run_reference import PROFILES

STILL_RUNNING = 3


@dataclass
class FollowConfig:
    workdir: Path = arg(help="work folder of the reference run")
    start: bool = arg(False, "start the run (phases 1-3, detached) unless it runs or has ended")
    profile: str = arg("h200", "profile of the run to start (reference/run_reference.py)",
                       choices=sorted(PROFILES))
    deadline_s: float = arg(1450.0, "the started run's time budget for optional work, seconds")
    wait_s: float = arg(560.0, "wait at most this long for the run to end")
    out: Path | None = arg(None, "copy the summary, raw JSON and console log here (default $OUT)")
    gguf: Path | None = arg(None, "smollm2 profiles: the SmolLM2 GGUF file the started run reads")
    log_level: str = arg("INFO", "logging level")


def paths(workdir: Path) -> dict[str, Path]:
    base = Path(workdir)
    return {"log": base.parent / f"{base.name}.console.log", "rc": base.parent / f"{base.name}.rc",
            "pid": base.parent / f"{base.name}.pid"}


def running(pid_file: Path) -> bool:
    if not pid_file.exists():
        return False
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (ProcessLookupError, ValueError):
        return False
    return True


def start(cfg: FollowConfig, p: dict[str, Path]) -> None:
    script = Path(__file__).resolve().parent / "run_reference.py"
    command = (f"{sys.executable} {script} --phase 1 2 3 --profile {cfg.profile} "
               f"--workdir {cfg.workdir} --deadline-s {cfg.deadline_s}"
               + (f" --gguf {cfg.gguf.resolve()}" if cfg.gguf else ""))
    cfg.workdir.parent.mkdir(parents=True, exist_ok=True)
    p["rc"].unlink(missing_ok=True)
    with open(p["log"], "ab") as log:
        proc = subprocess.Popen(["bash", "-c", f'{command}; echo $? > {p["rc"]}'],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ,
                                                             "PYTHONUNBUFFERED": "1"})
    p["pid"].write_text(str(proc.pid))
    print(f"started (pid {proc.pid}): {command}", flush=True)


def last_line(path: Path) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 4096))
        lines = [x for x in f.read().decode(errors="replace").replace("\r", "\n").split("\n")
                 if x.strip()]
    return lines[-1][:200] if lines else ""


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(FollowConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    cfg.workdir = cfg.workdir.resolve()
    p = paths(cfg.workdir)
    if cfg.start and not running(p["pid"]) and not p["rc"].exists():
        start(cfg, p)
    t0, shown = time.time(), 0.0
    while not p["rc"].exists() and time.time() - t0 < cfg.wait_s:
        if not running(p["pid"]) and not p["rc"].exists():
            print("the run is not running and left no exit status (never started here, or "
                  "killed): start it with --start", flush=True)
            break
        if time.time() - shown >= 30:
            print(f"[{time.time() - t0:5.0f} s] {last_line(p['log'])}", flush=True)
            shown = time.time()
        time.sleep(2)
    rc = int(p["rc"].read_text()) if p["rc"].exists() else STILL_RUNNING
    if p["log"].exists():
        tail = p["log"].read_text(errors="replace").replace("\r", "\n").splitlines()
        print("\n".join(line for line in tail[-60:] if line.strip()), flush=True)
    out = cfg.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out and (cfg.workdir / "results").is_dir():
        from reference.report import write_report
        from reference.run_reference import copy_out

        state_file = cfg.workdir / "results" / "state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        write_report(cfg.workdir, state.get("profile", cfg.profile))
        copied = copy_out(cfg.workdir, out)
        if p["log"].exists():
            shutil.copyfile(p["log"], Path(out) / "reference" / "console.log")
            copied.append("console.log")
        print(f"copied to {out}/reference: {', '.join(copied)}", flush=True)
    print("run " + ("still running" if rc == STILL_RUNNING else f"ended with exit status {rc}"),
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
