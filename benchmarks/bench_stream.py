#!/usr/bin/env python3
"""Stream mode against offline: `02b --stream` and `04 --stream` at the same time, through a
spool of at most --spool-gb, against 02b then 04 (the train split's files all on disk), on the
same merged data with the same flags; then both drafts' acceptance with the offline evaluator.

Input: --workdir W, a folder holding a complete merged split (`W/01c_merged/`) and the target
(`W/target`, or `W/../target` as the reference pipeline lays its run out), or the reference run's
own folder (`/tmp/refs`: its pipeline run is `/tmp/refs/main`, the target `/tmp/refs/target`,
the held-out prompts `/tmp/refs/heldout/...`). Below, W is the folder holding `01c_merged`.
Every step is the production script as a subprocess (`sys.executable`, cwd the repo root):

  03       into W unless complete there (reference phase 1 stops at the merge)
  offline  W/offline (target, 01c_merged and 03_vocab linked): 02b, then 04, each timed
  stream   W/stream (the same links): 02b --stream --spool-gb G and 04 --stream started
           together, timed until both have ended (spool: W/stream/02b_spool unless --spool)
  eval     05 --backend hf on W/offline/04_train/final and W/stream/04_train/final: the
           held-out prompts of reference phase 1 (else the merged eval split), temperature 0,
           the chains of --eval-steps; both at once on a GPU (--no-eval-parallel: one by one)

While offline and stream run, a thread samples about every second (--sample-s): the bytes of the
02b_hidden_states and spool folders (apparent sizes, a hard-linked file once) and, on a GPU,
`nvidia-smi --query-compute-apps=pid,used_memory`, `nvidia-smi pmon -c 1 -s um` (SM % per
process, mapped to the 02b and 04 process trees) and the whole GPU's utilization; on CPU, or
without nvidia-smi, the GPU figures are null with the reason. Each phase gets its own fresh
TorchInductor / Triton cache (W/<phase>/.compile_cache), so that both 04s compile cold, as the
reference run's 04 did (--shared-compile-cache: the user's caches).

Flags (default): on cuda the profile's own (reference/run_reference.py PROFILES, `h200-smollm2`:
02b `--backend hf --dtype bf16 --model-dtype bfloat16 --max-batch-tokens 65536` plus
`--max-batch-size 64`, 02b's default written out since stream mode chunks by it; 03
`--draft-vocab 4096`; 04 with epochs, packing and checkpoint cadence as the reference computes
them), so the offline figures are those of BENCHMARKS.md's SmolLM2 H200 run; on cpu tiny ones.
--extract-args / --train-args / --vocab-args replace them (one string each; --workdir, --target
and --device are added here). The spool budget defaults to 25% (--spool-share) of the train
split's estimated bf16 bytes, raised to just above 02b's working window (the rows 04 may hold
loaded ahead plus one chunk, computed with 02b's own functions) when that is larger.

Results, written after every phase (atomically): `$OUT/bench_stream.json` (walls, disk peaks and
the budget, 02b's manifest `stream` dict, 04's tok/s and data wait, SM % per side per phase,
acceptance per draft, every command, the device), `$OUT/bench_stream.md` (a short table), and
`$OUT/bench_stream_logs.tar.gz` (every stage's log, the 02b / 04 / 05 manifests, 05's
results.json, the raw samples): three files, within what a device call brings back.
W/offline and W/stream are this script's own: made again at each run (a folder without its
marker file `.bench_stream` is never removed).

H200, after reference phase 1 on the same machine (`python3 reference/run_reference.py --profile
h200-smollm2 --phase 1 --workdir /tmp/refs --gguf ...`, BENCHMARKS.md's GGUF route; it stops at
the merge and the held-out prompts). Estimated ~9 minutes from the recorded stage times plus
the start-up a subprocess pays (03 ~15 s, offline ~3.5 min: 02b ~40 s, 04 ~170 s with its cold
compile; stream ~3.5-4.5 min: 04 compiles while 02b fills the spool, then 02b's ~3.9 passes of
prefill pace 04; eval ~1.5 min: 8 prompts x 192 tokens at 3 steps, both drafts at once), so start
it detached (a device command lasts 10 minutes at most) and follow the JSON:
    setsid nohup python3 benchmarks/bench_stream.py --workdir /tmp/refs --out /tmp/bstream \
        > /tmp/bstream.log 2>&1 < /dev/null &
`--eval-prompts 12 --eval-steps 3 7` gives BENCHMARKS.md's 05 sizes (~+2 minutes).
CPU smoke (the demo's work folder, tiny flags, about a minute on 2 cores):
    python3 benchmarks/bench_stream.py --workdir runs/demo --device cpu --eval-prompts 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core.stage import STAGE_DIRS, atomic_write_json, read_manifest  # noqa: E402

SCRIPTS = {"02b": "02b_extract_hidden_states_sglang.py", "03": "03_build_vocab_mapping.py",
           "04": "04_train.py", "05": "05_benchmark.py"}
MARKER = ".bench_stream"
DEFAULT_PROFILE = "h200-smollm2"
# CPU: the demo's flags, at sizes a 2-core machine runs in seconds (2 epochs: the later epoch
# reads kept records or extracts them again, the point of the spool)
CPU_EXTRACT = ("--backend", "hf", "--dtype", "bf16", "--max-batch-tokens", "4096",
               "--max-batch-size", "8")
CPU_VOCAB = ("--draft-vocab", "256")
CPU_TRAIN = ("--epochs", "2", "--lr", "1e-3", "--max-seq-len", "512", "--num-workers", "1",
             "--eval-every", "100", "--max-eval-samples", "4", "--log-every", "50",
             "--ttt-steps", "3", "--keep-latest", "1", "--save-every", "1000")
PHASES = ("offline", "stream", "eval")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True,
                   help="folder holding 01c_merged/ (or the reference run's root, whose main/ "
                        "holds it)")
    p.add_argument("--target", type=Path, default=None,
                   help="target folder (default: W/target, else W/../target)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: $OUT, else ./bench_out/stream)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--profile", default=None,
                   help=f"reference profile whose 02b / 03 / 04 flags to use (default: "
                        f"{DEFAULT_PROFILE} on cuda; tiny built-in flags on cpu)")
    p.add_argument("--extract-args", default=None, help="02b flags instead of the default")
    p.add_argument("--train-args", default=None, help="04 flags instead of the default")
    p.add_argument("--vocab-args", default=None, help="03 flags instead of the default")
    p.add_argument("--spool-gb", type=float, default=None,
                   help="stream: the spool's budget, GB (default: --spool-share of the train "
                        "split's estimated bf16 bytes, at least 02b's working window)")
    p.add_argument("--spool-share", type=float, default=0.25)
    p.add_argument("--spool", type=Path, default=None,
                   help="stream: the spool folder (default W/stream/02b_spool); must be empty")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                   help="what to run (a phase left out keeps its figures from an earlier "
                        "bench_stream.json in --out)")
    p.add_argument("--skip-eval", action="store_true", help="no 05 (same as leaving out eval)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="05 --num-prompts (default 8 on cuda, 1 on cpu)")
    p.add_argument("--eval-steps", type=int, nargs="+", default=[3],
                   help="05 --steps (3 7 adds ~45 s a draft at the H200 sizes)")
    p.add_argument("--eval-max-new", type=int, default=None,
                   help="05 --max-new-tokens (default: the profile's, 192; 8 on cpu)")
    p.add_argument("--eval-prompt-sets", nargs="+", default=None,
                   help="05 --prompt-sets (default: reference phase 1's held-out prompts when "
                        "present, else eval)")
    p.add_argument("--eval-dtype", default=None,
                   help="05 --dtype (default: reference phase 1's choice, else float32)")
    p.add_argument("--eval-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="both 05s at once (default: on cuda)")
    p.add_argument("--sample-s", type=float, default=1.0, help="sampling period, seconds")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="a phase still running after this is killed")
    p.add_argument("--shared-compile-cache", action="store_true",
                   help="leave TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR as they are")
    args = p.parse_args(argv)
    if args.skip_eval and "eval" in args.phases:
        args.phases.remove("eval")
    return args


# ---------------------------------------------------------------- inputs and flags


def complete(folder: Path) -> bool:
    return bool((read_manifest(folder) or {}).get("complete"))


def locate(workdir: Path, target: Path | None) -> tuple[Path, Path, Path | None]:
    """(W: the folder holding 01c_merged, the target, the reference run's root or None)."""
    w = workdir.resolve()
    if not complete(w / STAGE_DIRS["merge"]) and complete(w / "main" / STAGE_DIRS["merge"]):
        w = w / "main"  # the reference run's root: its pipeline run is main/
    if not complete(w / STAGE_DIRS["merge"]):
        raise SystemExit(f"{w / STAGE_DIRS['merge']} is not a complete merged split (run the "
                         "merge, or reference phase 1, first)")
    if target is None:
        target = next((t for t in (w / "target", w.parent / "target")
                       if (t / "config.json").is_file()), None)
        if target is None:
            raise SystemExit(f"no target folder at {w / 'target'} or {w.parent / 'target'}: "
                             "pass --target")
    ref = w.parent if (w.parent / "heldout").is_dir() or (w.parent / "results").is_dir() else None
    return w, target.resolve(), ref


def drop_flags(args: list, flags: set[str]) -> list[str]:
    """`args` without each flag of `flags` and its one value."""
    out, skip = [], False
    for a in map(str, args):
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    return args if flag in args else [*args, flag, value]


def stage_flags(args, w: Path, ref: Path | None) -> dict:
    """The 02b / 03 / 04 flags (without --workdir, --target, --device) and the 05 defaults."""
    profile_name = args.profile or (DEFAULT_PROFILE if args.device == "cuda" else None)
    state = {}
    if ref is not None and (ref / "results" / "state.json").is_file():
        state = json.loads((ref / "results" / "state.json").read_text())
    flags = {"profile": profile_name, "eval_max_new": 8, "eval_dtype": "float32"}
    if profile_name:
        from reference.run_reference import PROFILES
        from reference.stages import StageRunner
        from reference.steps import PhaseSteps

        profile = PROFILES[profile_name]
        steps = PhaseSteps(ref or w.parent, profile_name, profile,
                           StageRunner(w / ".bench_stream_unused"), time.time() + 1e9)
        strip = {"--target", "--device"}
        flags["extract"] = with_flag(drop_flags(steps.extract_args("bf16"), strip),
                                     "--max-batch-size", "64")
        flags["vocab"] = drop_flags(steps.vocab_args(), strip)
        flags["train"] = drop_flags(steps.train_args(w), strip)
        flags["eval_max_new"] = profile.bench_max_new
        flags["eval_dtype"] = state.get("eval_dtype", profile.eval_dtype)
    else:
        flags.update(extract=list(CPU_EXTRACT), vocab=list(CPU_VOCAB), train=list(CPU_TRAIN))
    for key, given in (("extract", args.extract_args), ("train", args.train_args),
                       ("vocab", args.vocab_args)):
        if given is not None:
            flags[key] = shlex.split(given)
    return flags


def heldout_prompts(ref: Path | None) -> Path | None:
    if ref is None:
        return None
    from reference.build_corpus import DATASET_HELDOUT

    path = ref / "heldout" / STAGE_DIRS["01"] / DATASET_HELDOUT / "conversations.jsonl"
    return path if path.is_file() else None


def read_jsonl_lengths(path: Path) -> list[int]:
    out = []
    with path.open() as f:
        for line in f:
            if line.strip():
                try:
                    out.append(len(json.loads(line)["input_ids"]))
                except (ValueError, KeyError, TypeError):
                    pass  # a bad line: 02b lists it, nothing to count here
    return out


def data_sizes(w: Path, target: Path) -> dict:
    from eagle3.core import hidden_states as hs
    from eagle3.core.target import read_target_info

    info = read_target_info(target)
    merged = w / STAGE_DIRS["merge"]
    train, evals = read_jsonl_lengths(merged / "train.jsonl"), read_jsonl_lengths(
        merged / "eval.jsonl")
    return {"hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
            "train_records": len(train), "train_tokens": sum(train),
            "eval_records": len(evals), "eval_tokens": sum(evals),
            "train_bf16_bytes_est": sum(hs.estimate_bytes(n, 1, info.hidden_size, "bf16")
                                        for n in train)}


def working_window(w: Path, target: Path, device: str, flags: dict, info: dict) -> dict:
    """02b's working window for this plan (Producer.setup's reserve): the bytes of the rows 04
    may hold loaded ahead plus the largest chunk; below it 02b refuses the budget."""
    from eagle3.core.cli import parse_config
    from eagle3.extract.config import ExtractConfig
    from eagle3.extract.stream import make_chunks, record_bytes, window_bytes
    from eagle3.train.config import TrainConfig
    from eagle3.train.stream import merged_train, stream_plan

    common = ["--workdir", str(w), "--target", str(target), "--device", device]
    tcfg = parse_config(TrainConfig, [*common, *flags["train"]])
    ecfg = parse_config(ExtractConfig, [*common, *flags["extract"]])
    good, _, lengths = merged_train(w, info["vocab_size"])
    evals = read_jsonl_lengths(w / STAGE_DIRS["merge"] / "eval.jsonl")
    _, plan = stream_plan(tcfg, lengths, evals, good, world=1)
    by_idx = dict(zip(good, lengths))
    nbytes = {i: record_bytes(n, info["hidden_size"], ecfg.dtype, ecfg.topk)
              for i, n in by_idx.items()}
    chunks = make_chunks(plan, by_idx, set(), ecfg.max_batch_tokens, ecfg.max_batch_size)
    chunk_max = max(sum(nbytes[i] for _, i in c.extract) for c in chunks)
    return {"window_bytes": window_bytes(plan, nbytes) + chunk_max,
            "rows_ahead": plan.lookahead_rows, "epochs": len(plan.epochs),
            "record_bytes_max": max(nbytes.values()),
            "train_bytes_est": sum(nbytes[i] for i in good)}


# ---------------------------------------------------------------- sampling


def tree_pids(root_pid: int) -> set[int]:
    """`root_pid` and its descendants (psutil when there, else /proc)."""
    try:
        import psutil

        try:
            proc = psutil.Process(root_pid)
            return {root_pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.Error:
            return set()
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    if not Path(f"/proc/{root_pid}").exists():
        return set()
    out, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def folder_bytes(folders: list[Path]) -> dict[str, int]:
    """Apparent bytes under each folder, every inode counted once (the spool hard-links kept
    records); files that vanish while walked are skipped."""
    seen, out = set(), {}
    for folder in folders:
        total = 0
        for dirpath, _, files in os.walk(folder):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
        out[folder.name] = total
    return out


def run_quiet(cmd: list[str], timeout: float = 15.0) -> tuple[str | None, str | None]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:300]}"
    return proc.stdout, None


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "-": no sample in the interval, or not supported


def parse_apps(text: str) -> list[dict]:
    """`--query-compute-apps=pid,used_memory --format=csv,noheader,nounits` rows."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            rows.append({"pid": int(parts[0]), "mem_mib": number(parts[1])})
    return rows


def parse_pmon(text: str) -> list[dict]:
    """`nvidia-smi pmon -c 1 -s um` rows: pid, sm %, mem %, fb MiB, command (by its header)."""
    names, rows = None, []
    for line in text.splitlines():
        if line.startswith("#"):
            if names is None:
                names = line.lstrip("#").split()
            continue
        parts = line.split()
        if names is None or len(parts) < 2 or not parts[1].isdigit():
            continue  # "-" pid: no process on that GPU
        row = dict(zip(names, parts))
        rows.append({"gpu": row.get("gpu"), "pid": int(row["pid"]),
                     "sm": number(row.get("sm", "-")), "mem": number(row.get("mem", "-")),
                     "fb_mib": number(row.get("fb", "-")), "command": row.get("command")})
    return rows


def parse_gpu(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2:
            rows.append({"util": number(parts[0]), "mem_mib": number(parts[1])})
    return rows


class Sampler(threading.Thread):
    """About every `period` s: folder bytes and, with `gpu`, nvidia-smi's view per side."""

    def __init__(self, folders: list[Path], period: float, gpu_reason: str | None):
        super().__init__(daemon=True)
        self.folders, self.period = folders, period
        self.gpu_reason = gpu_reason  # None: sample the GPU
        self.sides: dict[str, int] = {}  # side -> root pid of its process tree
        self.samples: list[dict] = []
        self.errors: dict[str, str] = {}
        self.raw: dict[str, str] = {}
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def watch(self, side: str, pid: int) -> None:
        self.sides[side] = pid

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    def _smi(self, key: str, cmd: list[str], parse) -> list[dict] | None:
        if key in self.errors:
            return None
        text, err = run_quiet(cmd)
        if err:
            self.errors[key] = err
            return None
        rows = parse(text)
        if rows and key not in self.raw:  # one raw answer with rows in it: to check the parse
            self.raw[key] = text[-2000:]
        return rows

    def sample(self) -> dict:
        s = {"t": round(time.monotonic() - self.t0, 2), "disk": folder_bytes(self.folders)}
        trees = {side: tree_pids(pid) for side, pid in list(self.sides.items())}
        s["alive"] = [side for side, pids in trees.items() if pids]
        if self.gpu_reason is None:
            apps = self._smi("apps", ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], parse_apps)
            pmon = self._smi("pmon", ["nvidia-smi", "pmon", "-c", "1", "-s", "um"], parse_pmon)
            gpu = self._smi("gpu", ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                    "--format=csv,noheader,nounits"], parse_gpu)
            owner = {pid: side for side, pids in trees.items() for pid in pids}
            s["gpu"] = gpu
            s["apps"] = [{**a, "side": owner.get(a["pid"], "other")} for a in apps or []]
            s["pmon"] = [{**r, "side": owner.get(r["pid"], "other")} for r in pmon or []]
        return s

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.monotonic()
            try:
                self.samples.append(self.sample())
            except Exception as e:  # noqa: BLE001 -- a sampler error must not end the bench
                self.errors.setdefault("sampler", f"{type(e).__name__}: {e}")
            self._halt.wait(max(0.0, self.period - (time.monotonic() - t)))

    # ------------------------------------------------------------ summaries

    def peak_disk(self) -> dict:
        if not self.samples:
            return {"peak_bytes": None, "samples": 0}
        totals = [sum(s["disk"].values()) for s in self.samples]
        k = max(range(len(totals)), key=totals.__getitem__)
        return {"peak_bytes": totals[k], "peak_by_folder": self.samples[k]["disk"],
                "peak_at_s": self.samples[k]["t"], "samples": len(self.samples)}

    def gpu_summary(self) -> dict:
        if self.gpu_reason is not None:
            return {"sampled": False, "reason": self.gpu_reason}
        out = {"sampled": True, "samples": len(self.samples), "errors": dict(self.errors),
               "raw_example": dict(self.raw)}
        util = [s["gpu"][0]["util"] for s in self.samples
                if s.get("gpu") and s["gpu"][0]["util"] is not None]
        out["gpu_util_pct"] = stats(util)
        mapped = 0
        for side in self.sides:
            sm, mem, seen = [], [], 0
            for s in self.samples:
                if side not in s["alive"]:
                    continue
                rows = [r for r in s.get("pmon", []) if r["side"] == side]
                seen += bool(rows) or any(a["side"] == side for a in s.get("apps", []))
                if "pmon" not in self.errors:
                    # a live side absent from pmon has no kernel on the GPU then: 0 %
                    sm.append(sum(r["sm"] or 0.0 for r in rows))
                mem.append(sum(a["mem_mib"] or 0.0 for a in s.get("apps", [])
                               if a["side"] == side))
            mapped += seen
            out[side] = {"sm_pct": stats(sm), "gpu_mem_mib_max": max(mem, default=None),
                         "samples_alive": len(sm) or len(mem), "samples_on_gpu": seen}
        others = sum(1 for s in self.samples for r in s.get("pmon", []) + s.get("apps", [])
                     if r["side"] == "other")
        if not mapped and others:
            out["note"] = ("nvidia-smi listed processes, none of them in the 02b / 04 process "
                           "trees (a sandbox that shows other pids?): per-side figures are "
                           "empty; gpu_util_pct is the whole GPU's")
        return out


def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": round(statistics.fmean(values), 2), "p50": round(statistics.median(values), 2),
            "max": round(max(values), 2), "n": len(values)}


# ---------------------------------------------------------------- processes


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU")
        self.w, self.target, self.ref = locate(args.workdir, args.target)
        self.out = (args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT")
                                 else ROOT / "bench_out" / "stream")).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.w / "bench_stream_logs"
        self.logs.mkdir(exist_ok=True)
        path = self.out / "bench_stream.json"
        self.r = json.loads(path.read_text()) if path.is_file() else {}
        self.r.setdefault("commands", {})
        for key in ("finished", "bench_wall_s", "error"):  # an earlier run's
            self.r.pop(key, None)
        self.flags = stage_flags(args, self.w, self.ref)
        self.r.update({
            "bench": "benchmarks/bench_stream.py: 02b --stream + 04 --stream against 02b then 04",
            "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "device": self.device_info(torch),
            "inputs": {"workdir": str(self.w), "target": str(self.target),
                       "reference_root": str(self.ref) if self.ref else None,
                       **data_sizes(self.w, self.target)},
            "flags": {k: self.flags[k] for k in ("profile", "extract", "vocab", "train")}})

    def device_info(self, torch) -> dict:
        info = {"device": self.args.device, "torch": torch.__version__,
                "nvidia_smi": shutil.which("nvidia-smi")}
        if self.args.device == "cuda":
            info["name"] = torch.cuda.get_device_name(0)
            info["count"] = torch.cuda.device_count()
        else:
            info["name"] = "cpu"
            info["cpu_count"] = os.cpu_count()
        return info

    # ------------------------------------------------------------ bookkeeping

    def save(self) -> None:
        self.r["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        atomic_write_json(self.out / "bench_stream.json", self.r)
        md = self.out / "bench_stream.md"
        tmp = md.with_name(md.name + ".tmp")
        tmp.write_text(report_md(self.r))
        os.replace(tmp, md)
        self.pack_logs()

    def pack_logs(self) -> None:
        """Every log, the manifests and 05's results in one archive (a device call brings back
        at most 8 files)."""
        files = sorted(self.logs.glob("*"))
        for side in ("offline", "stream"):
            for stage in ("02b", "04", "05"):
                m = self.w / side / STAGE_DIRS[stage] / "manifest.json"
                if m.is_file():
                    files.append(m)
            res = self.w / side / STAGE_DIRS["05"] / "results.json"
            if res.is_file():
                files.append(res)
        tmp = self.out / "bench_stream_logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in files:
                name = f.name if f.parent == self.logs else f"{f.parents[1].name}_{f.parent.name}_{f.name}"
                tar.add(f, arcname=f"bench_stream_logs/{name}")
        os.replace(tmp, self.out / "bench_stream_logs.tar.gz")

    def cmd(self, stage: str, workdir: Path, extra: list[str]) -> list[str]:
        return [sys.executable, str(ROOT / SCRIPTS[stage]), "--workdir", str(workdir),
                "--target", str(self.target), *extra]

    def env(self, phase: str | None) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if phase and not self.args.shared_compile_cache:
            cache = self.w / phase / ".compile_cache"
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
            env["TRITON_CACHE_DIR"] = str(cache / "triton")
        return env

    def spawn(self, label: str, cmd: list[str], phase: str | None) -> subprocess.Popen:
        self.r["commands"][label] = shlex.join(cmd)
        log = (self.logs / f"{label.replace(' ', '_')}.log").open("wb")
        print(f"[bench_stream] {label}: {shlex.join(cmd)}", flush=True)
        return subprocess.Popen(cmd, cwd=ROOT, env=self.env(phase), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_all(self, procs: dict[str, subprocess.Popen], t0: float,
                 ok_codes: tuple[int, ...] = (0,)) -> dict:
        """Wait for every process; when one fails (an exit code not in `ok_codes`: its partner
        in stream mode would wait for it for ever) or the phase times out, stop the others
        (their own process groups); on SIGTERM / Ctrl-C of this script, all of them.
        Returns {label: {rc, wall_s}}."""
        done: dict[str, dict] = {}
        deadline = t0 + self.args.timeout_s
        try:
            while len(done) < len(procs):
                for label, p in procs.items():
                    if label not in done and p.poll() is not None:
                        done[label] = {"rc": p.returncode,
                                       "wall_s": round(time.monotonic() - t0, 2)}
                failed = any(d["rc"] not in ok_codes for d in done.values())
                if (failed or time.monotonic() > deadline) and len(done) < len(procs):
                    reason = ("a side failed" if failed
                              else f"--timeout-s {self.args.timeout_s:g}")
                    for label, p in procs.items():
                        if label not in done:
                            print(f"[bench_stream] stopping {label} ({reason})", flush=True)
                            stop_group(p)
                            done[label] = {"rc": p.returncode, "wall_s": round(
                                time.monotonic() - t0, 2), "stopped": reason}
                time.sleep(0.2)
        except BaseException:
            for label, p in procs.items():
                if label not in done and p.poll() is None:
                    stop_group(p)
            raise
        return done

    def fresh(self, phase: str) -> Path:
        """W/<phase>, made again (only a folder this script made is removed)."""
        from reference.stages import linked_workdir

        d = self.w / phase
        if d.exists():
            if not (d / MARKER).exists():
                raise SystemExit(f"{d} exists and is not this script's (no {MARKER}): move it")
            shutil.rmtree(d)
        d.mkdir()
        (d / MARKER).write_text("made by benchmarks/bench_stream.py; removed at its next run\n")
        return linked_workdir(d, {"target": self.target,
                                  STAGE_DIRS["merge"]: self.w / STAGE_DIRS["merge"],
                                  STAGE_DIRS["03"]: self.w / STAGE_DIRS["03"]})

    def gpu_reason(self) -> str | None:
        if self.args.device != "cuda":
            return f"--device {self.args.device}: no GPU to sample"
        if not shutil.which("nvidia-smi"):
            return "nvidia-smi not found on PATH"
        return None

    # ------------------------------------------------------------ steps

    def vocab(self) -> None:
        if complete(self.w / STAGE_DIRS["03"]):
            self.r["03"] = {"skipped": f"{self.w / STAGE_DIRS['03']} already complete"}
            return
        t0 = time.monotonic()
        p = self.spawn("03", self.cmd("03", self.w, self.flags["vocab"]), None)
        res = self.wait_all({"03": p}, t0)["03"]
        self.r["03"] = res
        self.save()
        if res["rc"] != 0:
            raise SystemExit(f"03 failed (rc {res['rc']}): {self.logs / '03.log'}")

    def spool_budget(self) -> None:
        info = self.r["inputs"]
        window = working_window(self.w, self.target, self.args.device, self.flags, info)
        share = self.args.spool_share * info["train_bf16_bytes_est"]
        budget, note = (self.args.spool_gb * 1e9 if self.args.spool_gb else share), None
        floor = window["window_bytes"] + window["record_bytes_max"]
        if self.args.spool_gb is None and budget < floor:
            note = (f"{self.args.spool_share:.0%} of the train split ({share / 1e9:.4g} GB) is "
                    f"below 02b's working window ({window['window_bytes'] / 1e9:.4g} GB): "
                    "raised to the window plus the largest record")
            budget = floor
        self.spool_gb = math.ceil(budget / 1e3) / 1e6  # whole kB, rounded up
        self.r["spool"] = {"budget_gb": self.spool_gb, "budget_bytes": int(self.spool_gb * 1e9),
                           "share_of_train_bf16": round(self.spool_gb * 1e9
                                                        / max(info["train_bf16_bytes_est"], 1), 4),
                           "given": self.args.spool_gb, "note": note, **window}

    def forget(self, phase: str) -> None:
        """An earlier run's figures of `phase` go before it runs again (a run stopped half way
        must not leave them beside its own)."""
        for key in (phase, "eval_config" if phase == "eval" else "comparison"):
            self.r.pop(key, None)

    def offline(self) -> None:
        self.forget("offline")
        d = self.fresh("offline")
        sampler = Sampler([d / STAGE_DIRS["02b"]], self.args.sample_s, self.gpu_reason())
        sampler.start()
        res = {}
        try:
            for stage, flags in (("02b", self.flags["extract"]), ("04", self.flags["train"])):
                t0 = time.monotonic()
                label = f"offline {stage}"
                p = self.spawn(label, self.cmd(stage, d, [*flags, "--device",
                                                          self.args.device]), "offline")
                sampler.watch(stage, p.pid)
                res[stage] = self.wait_all({label: p}, t0)[label]
                if res[stage]["rc"] != 0:
                    break
        finally:
            sampler.stop()
        self.r["offline"] = {
            "02b": res.get("02b"), "04": res.get("04"),
            "wall_s": round(sum(x["wall_s"] for x in res.values()), 2),
            "ok": all(x["rc"] == 0 for x in res.values()) and len(res) == 2,
            "disk": {**sampler.peak_disk(), "final_bytes": folder_bytes(
                [d / STAGE_DIRS["02b"]])[STAGE_DIRS["02b"]]},
            "gpu": sampler.gpu_summary(),
            "extract": extract_summary(d), "train": train_summary(d)}
        self.dump_samples("offline", sampler)
        self.save()

    def stream(self) -> None:
        self.forget("stream")
        d = self.fresh("stream")
        spool = (self.args.spool or d / "02b_spool").resolve()
        if self.args.spool is not None and spool.exists() and any(spool.iterdir()):
            raise SystemExit(f"--spool {spool} is not empty: a spool holds one run's plan and "
                             "progress; give an empty or new folder")
        spool_flag = ["--spool", str(spool)] if self.args.spool else []
        sampler = Sampler([d / STAGE_DIRS["02b"], spool], self.args.sample_s, self.gpu_reason())
        sampler.start()
        t0 = time.monotonic()
        try:
            procs = {
                "stream 02b": self.spawn("stream 02b", self.cmd("02b", d, [
                    *self.flags["extract"], "--device", self.args.device, "--stream",
                    "--spool-gb", str(self.spool_gb), *spool_flag]), "stream"),
                "stream 04": self.spawn("stream 04", self.cmd("04", d, [
                    *self.flags["train"], "--device", self.args.device, "--stream",
                    *spool_flag]), "stream")}
            sampler.watch("02b", procs["stream 02b"].pid)
            sampler.watch("04", procs["stream 04"].pid)
            res = self.wait_all(procs, t0)
        finally:
            sampler.stop()
        manifest = read_manifest(d / STAGE_DIRS["02b"]) or {}
        eval_bytes = folder_bytes([d / STAGE_DIRS["02b"]])[STAGE_DIRS["02b"]]
        left = folder_bytes([spool])[spool.name] if spool.exists() else 0
        self.r["stream"] = {
            "02b": res["stream 02b"], "04": res["stream 04"],
            "wall_s": round(max(x["wall_s"] for x in res.values()), 2),
            "ok": all(x["rc"] == 0 for x in res.values()),
            "spool": str(spool),
            "disk": {**sampler.peak_disk(), "budget_bytes": int(self.spool_gb * 1e9),
                     "eval_split_bytes": eval_bytes, "spool_left_bytes": left},
            "manifest_stream": manifest.get("stream"),
            "gpu": sampler.gpu_summary(),
            "extract": extract_summary(d), "train": train_summary(d)}
        self.dump_samples("stream", sampler)
        self.save()

    def dump_samples(self, phase: str, sampler: Sampler) -> None:
        with (self.logs / f"samples_{phase}.jsonl").open("w") as f:
            for s in sampler.samples:
                f.write(json.dumps(s, separators=(",", ":")) + "\n")

    def evaluate(self) -> None:
        self.forget("eval")
        a = self.args
        prompts = a.eval_prompt_sets or [str(p) for p in [heldout_prompts(self.ref)] if p] or [
            "eval"]
        n = a.eval_prompts or (8 if a.device == "cuda" else 1)
        max_new = a.eval_max_new or self.flags["eval_max_new"]
        dtype = a.eval_dtype or self.flags["eval_dtype"]
        parallel = a.eval_parallel if a.eval_parallel is not None else a.device == "cuda"
        self.r["eval_config"] = {"prompt_sets": prompts, "num_prompts": n, "max_new_tokens": max_new,
                                 "steps": a.eval_steps, "temperature": 0.0, "dtype": dtype,
                                 "parallel": parallel}
        procs, t0, out = {}, time.monotonic(), {}
        for side in ("offline", "stream"):
            d = self.w / side
            draft = d / STAGE_DIRS["04"] / "final"
            if not (draft / "model.safetensors").is_file():
                out[side] = {"skipped": f"no draft at {draft} (its phase failed or did not run)"}
                continue
            shutil.rmtree(d / STAGE_DIRS["05"], ignore_errors=True)
            cmd = self.cmd("05", d, ["--draft", str(draft), "--backend", "hf",
                                     "--prompt-sets", *prompts, "--num-prompts", str(n),
                                     "--max-new-tokens", str(max_new), "--temperature", "0.0",
                                     "--seed", "0", "--steps", *map(str, a.eval_steps),
                                     "--device", a.device, "--dtype", dtype])
            label = f"{side} 05"
            procs[label] = self.spawn(label, cmd, side)
            if not parallel:
                out[side] = self.wait_all({label: procs.pop(label)}, time.monotonic(),
                                          ok_codes=(0, 1))[label]
        if procs:
            for label, res in self.wait_all(procs, t0, ok_codes=(0, 1)).items():
                out[label.split()[0]] = res
        for side, res in out.items():
            if "rc" in res:
                # rc 1: lossless mismatches, reported in results.json (the reference accepts it)
                res.update(acceptance(self.w / side / STAGE_DIRS["05"] / "results.json"))
        out["wall_s"] = round(time.monotonic() - t0, 2)
        self.r["eval"] = out
        self.save()

    def run(self) -> int:
        try:
            return self._run()
        except BaseException as e:
            self.r["error"] = f"{type(e).__name__}: {e}"[:1000]
            self.save()
            raise

    def _run(self) -> int:
        t0 = time.monotonic()
        self.save()
        self.vocab()
        if "stream" in self.args.phases or "offline" in self.args.phases:
            self.spool_budget()
            self.save()
        for phase in ("offline", "stream"):
            if phase in self.args.phases:
                getattr(self, phase)()
        self.r["comparison"] = compare(self.w, self.r)
        self.save()
        if "eval" in self.args.phases:
            self.evaluate()
        self.r["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.r["bench_wall_s"] = round(time.monotonic() - t0, 1)
        self.save()
        print(report_md(self.r), flush=True)
        print(f"[bench_stream] results: {self.out / 'bench_stream.json'}, "
              f"{self.out / 'bench_stream.md'}, {self.out / 'bench_stream_logs.tar.gz'}")
        ok = all((self.r.get(p) or {}).get("ok", True) for p in ("offline", "stream"))
        return 0 if ok else 1


def stop_group(p: subprocess.Popen) -> None:
    """SIGTERM the process group this script started (each stage resumes after it), then
    SIGKILL it if it is still there after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- figures


def extract_summary(d: Path) -> dict | None:
    m = read_manifest(d / STAGE_DIRS["02b"])
    if not m:
        return None
    return {"seconds": m.get("seconds"), "disk_bytes": m.get("disk_bytes"),
            "complete": m.get("complete"), "outputs": m.get("outputs")}


def train_summary(d: Path) -> dict | None:
    m = read_manifest(d / STAGE_DIRS["04"])
    if not m:
        return None
    o = m.get("outputs") or {}
    keys = ("num_steps", "tokens", "tok_s", "data_wait", "padding", "eval_sim_accept",
            "eval_sim_accept_loop_free", "eval_loop_share", "skipped")
    return {"seconds": m.get("seconds"), "complete": m.get("complete"),
            **{k: o.get(k) for k in keys if k in o},
            "eval_loss": o.get("eval_loss"), "eval_acc": o.get("eval_acc")}


def acceptance(path: Path) -> dict:
    """05's figures per prompt set and chain, as results.json gives them."""
    if not path.is_file():
        return {"results": None}
    r = json.loads(path.read_text())
    sets = {}
    for name, ps in (r.get("prompt_sets") or {}).items():
        steps = {}
        for s, m in (ps.get("steps") or {}).items():
            steps[s] = {k: m.get(k) for k in (
                "acceptance_length", "loop_share", "loop_free_acceptance", "verify_passes",
                "loop_free_verify_passes", "per_position_acceptance", "lossless_mismatches",
                "tok_s", "speedup")}
        sets[name] = {"prompts": ps.get("prompts"), "baseline_tok_s": ps.get("baseline_tok_s"),
                      "baseline_loop_share": ps.get("baseline_loop_share"), "steps": steps}
    return {"results": str(path), "sets": sets}


def file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compare(w: Path, r: dict) -> dict:
    off, st = r.get("offline") or {}, r.get("stream") or {}
    out = {}
    if off.get("wall_s") and st.get("wall_s"):
        out["stream_wall_over_offline"] = round(st["wall_s"] / off["wall_s"], 3)
    po, ps = (off.get("disk") or {}).get("peak_bytes"), (st.get("disk") or {}).get("peak_bytes")
    if po and ps:
        out["stream_peak_disk_over_offline"] = round(ps / po, 4)
    shas = {s: file_sha256(w / s / STAGE_DIRS["04"] / "final" / "model.safetensors")
            for s in ("offline", "stream")}
    out["draft_sha256"] = shas
    out["drafts_identical"] = (shas["offline"] == shas["stream"]) if all(shas.values()) else None
    return out


def _f(x, fmt="{:.1f}", none="–") -> str:
    return none if x is None else fmt.format(x)


def _gb(x) -> str:
    return _f(None if x is None else x / 1e9, "{:.3f} GB")


def _sm(phase: dict, side: str) -> str:
    g = (phase or {}).get("gpu") or {}
    if not g.get("sampled"):
        return "–"
    s = (g.get(side) or {}).get("sm_pct")
    return f"{s['mean']:.0f} / {s['p50']:.0f}" if s else "–"


def report_md(r: dict) -> str:
    off, st, ev = r.get("offline") or {}, r.get("stream") or {}, r.get("eval") or {}
    dev = (r.get("device") or {}).get("name")
    ms = st.get("manifest_stream") or {}
    lines = [f"# bench_stream ({dev}, {r.get('started', '')})", "",
             f"data: {r['inputs']['train_records']:,} train records, "
             f"{r['inputs']['train_tokens']:,} tokens (bf16 ~{_gb(r['inputs']['train_bf16_bytes_est'])}); "
             f"profile {r['flags'].get('profile') or 'cpu tiny'}", "",
             "| | offline (02b then 04) | stream (02b --stream + 04 --stream) |",
             "|---|---|---|"]
    o2, o4 = off.get("02b") or {}, off.get("04") or {}
    s2, s4 = st.get("02b") or {}, st.get("04") or {}
    lines.append(f"| wall s: 02b / 04 / total | {_f(o2.get('wall_s'))} / {_f(o4.get('wall_s'))}"
                 f" / **{_f(off.get('wall_s'))}** | {_f(s2.get('wall_s'))} / "
                 f"{_f(s4.get('wall_s'))} / **{_f(st.get('wall_s'))}** (both at once) |")
    sp = r.get("spool") or {}
    lines.append(f"| peak disk (02b_hidden_states + spool, sampled) | "
                 f"{_gb((off.get('disk') or {}).get('peak_bytes'))} | "
                 f"{_gb((st.get('disk') or {}).get('peak_bytes'))} (budget "
                 f"{_gb(sp.get('budget_bytes'))}; 02b's own peak {_gb(ms.get('peak_bytes'))}) |")
    lines.append(f"| target prefill passes / kept records / 02b waited for 04 | 1 / – / – | "
                 f"{_f(ms.get('prefill_passes'), '{:.2f}')} / {_f(ms.get('kept_records'), '{:,}')}"
                 f" / {_f(ms.get('backpressure_s'))} s |")
    to, ts = off.get("train") or {}, st.get("train") or {}
    lines.append(f"| 04 loop tok/s / data wait | {_f(to.get('tok_s'), '{:,.0f}')} / "
                 f"{_f(to.get('data_wait'), '{:.1%}')} | {_f(ts.get('tok_s'), '{:,.0f}')} / "
                 f"{_f(ts.get('data_wait'), '{:.1%}')} |")
    lines.append(f"| SM % mean / p50: 02b | {_sm(off, '02b')} | {_sm(st, '02b')} |")
    lines.append(f"| SM % mean / p50: 04 | {_sm(off, '04')} | {_sm(st, '04')} |")
    for side_key in ("gpu_util_pct",):
        go = ((off.get("gpu") or {}).get(side_key)) or {}
        gs = ((st.get("gpu") or {}).get(side_key)) or {}
        lines.append(f"| whole-GPU util % mean / p50 | {_f(go.get('mean'), '{:.0f}')} / "
                     f"{_f(go.get('p50'), '{:.0f}')} | {_f(gs.get('mean'), '{:.0f}')} / "
                     f"{_f(gs.get('p50'), '{:.0f}')} |")
    steps = (r.get("eval_config") or {}).get("steps") or []
    for s in map(str, steps):
        cells = []
        for side in ("offline", "stream"):
            m = None
            for ps in ((ev.get(side) or {}).get("sets") or {}).values():
                m = ps["steps"].get(s)
            cells.append("–" if not m else (
                f"**{m['acceptance_length']:.3f}** (loop share {m['loop_share']:.1%}, loop-free "
                f"{_f(m.get('loop_free_acceptance'), '{:.3f}')}; mismatches "
                f"{m.get('lossless_mismatches')})"))
        lines.append(f"| acceptance @{s} (05 hf, T=0) | {cells[0]} | {cells[1]} |")
    cmp_ = r.get("comparison") or {}
    if cmp_:
        lines += ["", f"stream / offline wall: {_f(cmp_.get('stream_wall_over_offline'), '{:.2f}')}"
                      f"; peak disk: {_f(cmp_.get('stream_peak_disk_over_offline'), '{:.3f}')}"
                      f"; drafts byte-identical: {cmp_.get('drafts_identical')}"]
    ec = r.get("eval_config")
    if ec:
        lines.append(f"eval: {ec['num_prompts']} prompts x {ec['max_new_tokens']} tokens of "
                     f"{', '.join(Path(p).name for p in ec['prompt_sets'])}, steps "
                     f"{ec['steps']}, {ec['dtype']}, {'side by side' if ec['parallel'] else 'one by one'}"
                     f" ({_f(ev.get('wall_s'))} s)")
    if sp.get("note"):
        lines.append(f"spool: {sp['note']}")
    return "\n".join(lines) + "\n"


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through wait_all, which stops the stages


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    return Bench(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
