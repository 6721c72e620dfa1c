"""The whole pipeline on a real target through the patched SGLang, then its draft served beside
plain: `benchmarks/bench_sglang_gpu.py --phases pipeline` (on the lent GPU:
`benchmarks/gpu_sglang.sh`), at the sizes of a profile below.

Steps, in order; each is the production script in a subprocess, its output in
`<work>/logs/<step>.log`, its record (command, wall time, exit status, the stage manifest's
outputs) in `<out>/pipeline.json` as soon as it ends:

  data server  the target served by the patched SGLang with the dump on (EAGLE3_DUMP_DIR in
               memory, `--disable-radix-cache`, no prefill CUDA graph: patches/README.md); it
               answers 01, 01b and 02b, and stops before 04
  01           the recipe: the target writes its own prompts (`--gen-backend sglang`), beside
               the human-written training prompts
  01b          the replies, greedy, the server's own ids (`--backend sglang`)
  merge, 02b   the merged splits; their states through the server's dump (`--backend sglang`)
  03, 04       the draft vocabulary; the draft (the target's preset), given what is left
               before the deadline but the serving's share (stopping after 04: the draft's
               return share): cut there (two SIGINTs), its last checkpoint is exported
  serve        plain and each speculative setting of the profile, started together (each with
               a fixed KV pool, so no server sizes itself from what another left free), then 05
               `--backend sglang` on the held-out prompts at every concurrency: natural lengths
               first, then fixed ones (`--ignore-eos`)
  offline      05 `--backend hf` (the offline evaluator) on the same prompts

A step whose estimate exceeds what is left before the deadline is skipped and recorded so, the
later ones too (they build on it or come after it in priority). A step that fails stops the
phase (its log tail is in the record), but 05's exit on outputs beyond plain's own noise does not.
Measured on one H100 with `h100-qwen-coder` (2026-12-07, BENCHMARKS.md): data server 58-90 s,
01 242 s, 01b 136 s, 02b 146 s, 03 10 s. Re-running the phase resumes: complete stages are
no-ops, a half-done one resumes.

    python benchmarks/bench_sglang_gpu.py --phases pipeline --out $OUT --sglang-site /tmp/sglsite \\
        --pipeline-target /tmp/gs/target --pipeline-profile h100-qwen-coder --deadline-at EPOCH

In two sessions. One device session (30 minutes, ~77 s of them to start the machine and ~180 s
for the other 18 parts of the target, 125 s to convert it) holds the data steps and a real 04
(data server 60-90 s, 01 242 s, 01b 136 s, 02b 146 s, 03 10 s) or the serving (servers ~150 s,
05 natural ~240 s, fixed ~240 s, offline ~300 s), not both. Session A, `run_pipeline(...,
stop_after="04")` (phase `pipeline-train`), gives 04 what is left before the deadline but the
draft's return share (`draft_return`) and records the serving and offline steps as skipped;
`gpu_sglang.sh follow` and `fetch` bring its draft back in parts. Session B, `serve_draft(...)` (phase
`pipeline-serve`), serves that draft and runs the offline 05 with no data server, data step, 03
or 04, into the same pipeline.json (`route`: all, train or serve). Its prompt sets must be files
in the repository: `heldout:<dataset>` names 01's own, which session B lacks (an error saying so
before any server starts). The calls (benchmarks/gpu_sglang.sh's header has each), session A:

    bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz GGUF qwen2.5-coder-1.5b      # here
    bash benchmarks/gpu_sglang.sh part 1 && bash benchmarks/gpu_sglang.sh site kimi       # call 1
    bash benchmarks/gpu_sglang.sh part N                                                  # 2..K-1
    bash benchmarks/gpu_sglang.sh part K && bash benchmarks/gpu_sglang.sh start pipeline-train
    bash benchmarks/gpu_sglang.sh follow 560     # until the driver has ended
    bash benchmarks/gpu_sglang.sh fetch 0        # until every part draft.sha256 names is back
    bash benchmarks/gpu_sglang.sh join-draft /tmp/draft.tar FILES_AT_1 FILES_AT_2 ...     # here

session B:

    bash benchmarks/gpu_sglang.sh split /tmp/gpusite.tar.xz GGUF qwen2.5-coder-1.5b /tmp/draft.tar
    bash benchmarks/gpu_sglang.sh part 1 && bash benchmarks/gpu_sglang.sh site kimi       # call 1
    bash benchmarks/gpu_sglang.sh part N                                                  # 2..K-1
    bash benchmarks/gpu_sglang.sh part K && bash benchmarks/gpu_sglang.sh start pipeline-serve
    bash benchmarks/gpu_sglang.sh follow 560     # until the driver has ended

which run, on the machine,

    python benchmarks/bench_sglang_gpu.py --phases pipeline-train --out $OUT \\
        --sglang-site /tmp/sglsite --pipeline-target /tmp/gs/target --deadline-at EPOCH
    python benchmarks/bench_sglang_gpu.py --phases pipeline-serve --out $OUT \\
        --sglang-site /tmp/sglsite --pipeline-target /tmp/gs/target --deadline-at EPOCH \\
        --pipeline-draft /tmp/gs/draft_in/final

and on CPU (the offline 05 only: the CPU build serves no EAGLE):

    python benchmarks/gpu_pipeline.py --target T --work W --stop-after 04 \\
        --sglang-python .venv-sglang/bin/python
    python benchmarks/gpu_pipeline.py --target T --work W2 --draft W/run/04_train/final \\
        --sglang-python .venv-sglang/bin/python
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"01": "01_prepare_datasets.py", "01b": "01b_generate_synthetic.py",
           "merge": "datasets/merge_and_shuffle.py", "02b": "02b_extract_hidden_states_sglang.py",
           "03": "03_build_vocab_mapping.py", "04": "04_train.py", "05": "05_benchmark.py"}
# The dump server's flags beyond the common ones (patches/README.md, "Server flags"):
# every prompt recomputed, no prefill CUDA graph (its replays carry no rids).
DUMP_SERVER = ["--disable-radix-cache", "--cuda-graph-backend-prefill", "disabled"]


@dataclass(frozen=True)
class Setting:
    """One speculative server: its label and SGLang flags (EAGLE3 and the draft are added)."""

    name: str
    flags: tuple[str, ...]


def chain(steps: int) -> Setting:
    """A chain of `steps` draft tokens: topk 1, `steps + 1` tokens verified a round."""
    return Setting(f"chain{steps}", ("--speculative-num-steps", str(steps),
                                     "--speculative-eagle-topk", "1",
                                     "--speculative-num-draft-tokens", str(steps + 1)))


@dataclass(frozen=True)
class PipelineProfile:
    """Every size of one run (flags are passed to the scripts as written)."""

    device: str  # torch device of 04 and the offline 05
    recipe: str  # under datasets/
    count_scale: float  # the recipe's counts (and held-out shares) times this
    preset: str  # 04 --preset (the target's named draft)
    server: tuple[str, ...]  # data server flags beside the common ones and DUMP_SERVER
    prepare: tuple[str, ...]  # 01, beside --gen-backend sglang --server-url
    generate: tuple[str, ...]  # 01b, beside --backend sglang --server-url
    merge: tuple[str, ...]
    extract: tuple[str, ...]  # 02b, beside --backend sglang --server-url --dump-dir
    draft_vocab: int  # 03
    train: tuple[str, ...]  # 04
    serve_server: tuple[str, ...]  # flags of every 05 server (plain and speculative)
    settings: tuple[Setting, ...]  # the speculative servers, most wanted first
    prompt_sets: tuple[str, ...]  # 05 --prompt-sets (held-out; "heldout:<dataset>" = 01's own)
    num_prompts: int
    max_new_tokens: int
    concurrency: tuple[int, ...]
    offline: tuple[str, ...]  # 05 --backend hf flags beside the prompts
    dump_dir: str = "/dev/shm/eagle3-dump"
    # estimates (s) of each step on this profile's machine, for the deadline
    estimates: dict = field(default_factory=dict)


PROFILES = {
    # Qwen2.5-Coder-1.5B-Instruct on one H100 (hidden 1536, 28 layers, vocab 151,936):
    # ~9,300 conversations, code-heavy (datasets/qwen_coder_self_written.json at 0.8 of its
    # counts), replies up to 512 tokens; states in fp8 (7.7 KB a token against bf16's 12.3); the
    # draft 3 epochs or until the serving's share of the deadline (its last checkpoint then).
    "h100-qwen-coder": PipelineProfile(
        device="cuda", recipe="qwen_coder_self_written.json", count_scale=0.8,
        preset="qwen2.5-coder-1.5b",
        server=("--mem-fraction-static", "0.85", "--context-length", "8192",
                "--chunked-prefill-size", "16384", "--max-running-requests", "1024",
                "--cuda-graph-max-bs", "256"),
        prepare=("--gen-batch-size", "1024", "--num-workers", "8"),
        generate=("--max-new-tokens", "512", "--concurrency", "1024",
                  "--long-concurrency", "128"),
        merge=("--eval-fraction", "0.02", "--max-seq-len", "4096"),
        extract=("--dtype", "fp8", "--concurrency", "96", "--workers", "8"),
        draft_vocab=32000,
        train=("--epochs", "3", "--lr", "1e-3", "--max-seq-len", "4096", "--pack-tokens",
               "16384", "--num-workers", "12", "--max-eval-samples", "128", "--log-every", "20",
               "--save-every", "100", "--device", "cuda"),
        serve_server=("--mem-fraction-static", "0.9", "--max-total-tokens", "98304",
                      "--context-length", "4096", "--cuda-graph-max-bs", "64",
                      "--max-running-requests", "64", "--cuda-graph-backend-prefill",
                      "disabled"),
        settings=(chain(7), chain(3), chain(5),
                  Setting("tree6x4", ("--speculative-num-steps", "6",
                                      "--speculative-eagle-topk", "4",
                                      "--speculative-num-draft-tokens", "16"))),
        prompt_sets=("prompts/human_code.jsonl", "prompts/human_chat.jsonl"),
        num_prompts=32, max_new_tokens=256, concurrency=(1, 4, 16, 64),
        offline=("--steps", "3", "7", "--device", "cuda", "--dtype", "bfloat16",
                 "--num-prompts", "16", "--max-new-tokens", "128"),
        # estimates: the measured step times (2026-12-07) where they ran, with a margin;
        # draft_return (session A, stopping after 04): the cut's checkpoint in flight and the
        # export (~30 s), then the draft's ~212 MB (106M bf16 parameters) back in 15 MB parts,
        # 4 a device call (64 MiB) at ~30 s a call
        estimates={"server": 100, "01": 260, "01b": 150, "merge": 15, "02b": 170, "03": 20,
                   "04": 240, "04_min": 180, "serve_start": 150, "serve_natural": 240,
                   "serve_fixed": 240, "offline": 300, "draft_return": 180}),
    # The same route on CPU at toy sizes: the tiny qwen2 target served by the SGLang CPU build
    # (which cannot serve EAGLE, so no speculative settings: plain only, and the offline 05).
    "cpu-qwen2-smoke": PipelineProfile(
        device="cpu", recipe="qwen_coder_self_written.json", count_scale=0.002,
        preset="",
        server=("--device", "cpu", "--attention-backend", "torch_native", "--dtype",
                "float32", "--max-total-tokens", "8192", "--chunked-prefill-size", "256"),
        prepare=("--gen-batch-size", "8", "--num-workers", "1"),
        generate=("--max-new-tokens", "16", "--concurrency", "8"),
        merge=("--eval-fraction", "0.2", "--max-seq-len", "1024"),
        extract=("--dtype", "fp8", "--concurrency", "4", "--workers", "1"),
        draft_vocab=256,
        train=("--epochs", "1", "--lr", "1e-3", "--max-seq-len", "512", "--pack-tokens", "512",
               "--num-workers", "0", "--max-eval-samples", "2", "--log-every", "5",
               "--ttt-steps", "3", "--device", "cpu"),
        serve_server=(), settings=(), prompt_sets=("prompts/human_code.jsonl",),
        num_prompts=2, max_new_tokens=8, concurrency=(1,),
        offline=("--steps", "3", "--device", "cpu", "--dtype", "float32",
                 "--num-prompts", "2", "--max-new-tokens", "8")),
}


def scaled_recipe(profile: PipelineProfile, out: Path) -> Path:
    """The profile's recipe with its self-written counts (and held-out prompts) scaled, paths
    made absolute: `out` (the shipped file itself when the scale is 1)."""
    src = ROOT / "datasets" / profile.recipe
    if profile.count_scale == 1.0:
        return src
    recipe = json.loads(src.read_text())
    for entry in recipe["datasets"]:
        if entry.get("path"):
            entry["path"] = str((src.parent / entry["path"]).resolve())
        if "self_written" in entry:
            entry["count"] = max(4, round(entry["count"] * profile.count_scale))
            block = entry["self_written"]
            block["heldout"] = max(2, round(block["heldout"] * profile.count_scale))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recipe, indent=1) + "\n")
    return out


def resolve_prompt_sets(profile: PipelineProfile, workdir: Path) -> list[str]:
    """05's prompt sets: repository paths made absolute, `heldout:<dataset>` the held-out
    prompts 01 kept apart for that self-written dataset."""
    sets = []
    for name in profile.prompt_sets:
        if name.startswith("heldout:"):
            sets.append(str(workdir / "01_prepared" / name.split(":", 1)[1] / "heldout.jsonl"))
        else:
            sets.append(str(ROOT / name))
    return sets


def stage_command(stage: str, workdir: Path, target: Path, *flags: str) -> list[str]:
    return [sys.executable, str(ROOT / SCRIPTS[stage]), "--workdir", str(workdir), "--target",
            str(target), *flags]


def data_commands(profile: PipelineProfile, workdir: Path, target: Path, url: str,
                  recipe: Path) -> list[tuple[str, list[str]]]:
    """(step, argv) of 01, 01b, merge and 02b against the data server at `url`."""
    return [
        ("01", stage_command("01", workdir, target, "--recipe", str(recipe), "--gen-backend",
                             "sglang", "--server-url", url, *profile.prepare)),
        ("01b", stage_command("01b", workdir, target, "--backend", "sglang", "--server-url", url,
                              *profile.generate)),
        ("merge", [sys.executable, str(ROOT / SCRIPTS["merge"]), "--workdir", str(workdir),
                   *profile.merge]),
        ("02b", stage_command("02b", workdir, target, "--backend", "sglang", "--server-url", url,
                              "--dump-dir", profile.dump_dir, *profile.extract)),
    ]


def train_commands(profile: PipelineProfile, workdir: Path,
                   target: Path) -> list[tuple[str, list[str]]]:
    preset = ("--preset", profile.preset) if profile.preset else ()
    return [("03", stage_command("03", workdir, target, "--draft-vocab",
                                 str(profile.draft_vocab))),
            ("04", stage_command("04", workdir, target, *preset, *profile.train))]


def trained_draft(workdir: Path) -> Path:
    """The draft 04 writes (or its last checkpoint's export, when 04 was cut)."""
    return Path(workdir) / "04_train" / "final"


def missing_prompt_sets(profile: PipelineProfile, workdir: Path) -> list[str]:
    """Why each of 05's prompt sets that is not on disk is missing (none: all there)."""
    missing = []
    for name, path in zip(profile.prompt_sets, resolve_prompt_sets(profile, workdir)):
        if Path(path).is_file():
            continue
        if name.startswith("heldout:"):
            missing.append(f"{name} is 01's held-out prompts of that dataset, {path}, which only "
                           "the data steps write: name repository prompt sets (prompts/*.jsonl) "
                           "in the profile's prompt_sets, or put that file there (session A's "
                           "results.tgz holds it)")
        else:
            missing.append(f"{name}: no file {path}")
    return missing


def bench_command(profile: PipelineProfile, workdir: Path, target: Path, out_dir: Path,
                  baseline_url: str, spec_urls: list[str], fixed: bool, *,
                  draft: Path) -> list[str]:
    """05 --backend sglang: the baseline and every speculative server, every prompt set and
    concurrency; `fixed`: every answer exactly --max-new-tokens long."""
    return [sys.executable, str(ROOT / SCRIPTS["05"]), "--workdir", str(out_dir), "--target",
            str(target), "--draft", str(draft), "--backend", "sglang",
            "--baseline-url", baseline_url, "--spec-url", *spec_urls,
            "--prompt-sets", *resolve_prompt_sets(profile, workdir),
            "--num-prompts", str(profile.num_prompts), "--max-new-tokens",
            str(profile.max_new_tokens), "--temperature", "0",
            "--concurrency", *[str(c) for c in profile.concurrency],
            *(["--ignore-eos"] if fixed else [])]


def offline_command(profile: PipelineProfile, workdir: Path, target: Path, out_dir: Path, *,
                    draft: Path) -> list[str]:
    return [sys.executable, str(ROOT / SCRIPTS["05"]), "--workdir", str(out_dir), "--target",
            str(target), "--draft", str(draft), "--backend", "hf",
            "--prompt-sets", *resolve_prompt_sets(profile, workdir), "--temperature", "0",
            *profile.offline]


class StepLog:
    """The run's record, `<out>/pipeline.json`, rewritten after every step."""

    def __init__(self, out: Path, deadline: float, meta: dict):
        self.path, self.deadline = Path(out) / "pipeline.json", deadline
        self.data = {"deadline_at": deadline, **meta, "steps": {}, "skipped": {}}
        if self.path.exists():  # a re-run keeps what earlier steps recorded
            old = json.loads(self.path.read_text())
            self.data["steps"] = old.get("steps", {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def fits(self, step: str, estimate_s: float) -> bool:
        """Whether `step` may start: its estimate fits before the deadline (else recorded)."""
        left = self.deadline - time.time()
        if estimate_s <= left:
            return True
        self.skip(step, f"needs ~{estimate_s:.0f} s, {left:.0f} s left")
        return False

    def skip(self, step: str, reason: str) -> None:
        self.data["skipped"][step] = reason
        self.save()

    def record(self, step: str, **fields) -> None:
        self.data["steps"][step] = {**self.data["steps"].get(step, {}), **fields}
        self.save()


def run_step(log: StepLog, step: str, argv: list[str], log_dir: Path,
             manifest: Path | None = None, check: bool = True,
             limit_s: float | None = None) -> bool:
    """Run one script, record it; RuntimeError (with its log's tail) when it fails and `check`
    (05 exits 1 on outputs that differ from plain beyond plain's own noise: its results are
    kept and the next measurement still runs). Past `limit_s` the script is interrupted (two
    SIGINTs: a stage keeps what is complete, 04 its last checkpoint) and False is returned."""
    log_path = Path(log_dir) / f"{step}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0, cut = time.time(), False
    with open(log_path, "ab") as out:
        # the repository on the path: datasets/merge_and_shuffle.py sits below it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            cut = True
            for _ in range(2):  # the first asks the stage to stop, the second interrupts it
                os.killpg(proc.pid, signal.SIGINT)
                time.sleep(2)
            try:
                rc = proc.wait(timeout=120)  # the checkpoint in flight is finished first
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    tail = log_path.read_text(errors="replace").splitlines()[-25:]
    fields = {"command": " ".join(argv), "rc": rc, "wall_s": round(time.time() - t0, 1)}
    if cut:
        fields["cut_at_s"] = limit_s
    if manifest is not None and manifest.exists():
        m = json.loads(manifest.read_text())
        fields["outputs"] = m.get("outputs")
        fields["stage_seconds"] = m.get("seconds") or m.get("wall_s")
    if rc != 0:
        fields["log_tail"] = tail
    log.record(step, **fields)
    if rc != 0 and check and not cut:
        raise RuntimeError(f"step {step} exited {rc}:\n" + "\n".join(tail))
    return not cut


def export_latest_checkpoint(workdir: Path) -> Path:
    """04_train/final from 04's latest complete checkpoint (04 cut before its last step)."""
    from eagle3.train.checkpoint import complete_steps
    from reference.stages import export_checkpoint

    root = Path(workdir) / "04_train" / "checkpoints"
    steps = complete_steps(root)
    if not steps:
        raise RuntimeError(f"04 was cut before its first checkpoint: nothing in {root}")
    step_dir = root / f"step_{steps[-1]:06d}"
    return export_checkpoint(step_dir, json.loads((step_dir / "config.json").read_text()),
                             Path(workdir) / "04_train" / "final")


def _manifest(workdir: Path, stage: str) -> Path:
    from eagle3.core.stage import STAGE_DIRS

    return Path(workdir) / STAGE_DIRS[stage] / "manifest.json"


# What the two-session route's session A leaves for session B (the module docstring)
SERVE_STEPS = ("serve_start", "serve_natural", "serve_fixed", "offline")


def _meta(profile: PipelineProfile, target: Path, **extra) -> dict:
    """The record's head: the target, the profile, its settings' flags, the route's own keys."""
    return {"target": str(target),
            "profile": {k: v for k, v in profile.__dict__.items() if k != "settings"},
            "settings": {s.name: list(s.flags) for s in profile.settings}, **extra}


def run_pipeline(profile: PipelineProfile, target: Path, work: Path, out: Path,
                 deadline: float, launch, stop_after: str | None = None) -> dict:
    """Every step of the module docstring; returns the record (also in <out>/pipeline.json).

    `launch(name, port, flags, dump_dir=None)` returns an unstarted LaunchedServer of the target
    (eagle3/core/launcher.py) with `flags` beside the caller's common ones. `stop_after="04"`:
    session A of two, 04 gets what is left but the draft's return share (estimate
    `draft_return`) and the serving and offline steps are recorded as skipped."""
    from contextlib import ExitStack

    if stop_after not in (None, "04"):
        raise ValueError(f"stop_after={stop_after!r}: use '04' (train here, serve in the next "
                         "session) or None (the whole route)")
    workdir, logs = Path(work) / "run", Path(work) / "logs"
    log = StepLog(out, deadline, _meta(profile, target, route="train" if stop_after else "all"))
    recipe = scaled_recipe(profile, Path(work) / "recipe.json")
    est = profile.estimates

    def stage_steps(commands) -> bool:
        for step, argv in commands:
            if not log.fits(step, est.get(step, 0)):
                return False
            run_step(log, step, argv, logs, _manifest(workdir, step))
        return True

    with ExitStack() as stack:
        data = launch("data", 30050, [*DUMP_SERVER, *profile.server], profile.dump_dir)
        if not log.fits("server", est.get("server", 0)):
            return log.data
        t0 = time.time()
        stack.enter_context(data)
        log.record("server", wall_s=round(time.time() - t0, 1), url=data.url)
        if not stage_steps(data_commands(profile, workdir, target, data.url, recipe)):
            return log.data
    (vocab, vocab_argv), (_, train_argv) = train_commands(profile, workdir, target)
    if not stage_steps([(vocab, vocab_argv)]) or not log.fits("04", est.get("04", 0)):
        return log.data
    # 04 gets what is left before the deadline but what follows it in this session: the
    # serving's share, or (stopping after 04) the draft's way back; cut there, its last
    # checkpoint is the draft
    if stop_after == "04":
        share_s = est.get("draft_return", 0)
    else:
        share_s = est.get("serve_start", 0) + est.get("serve_natural", 0) + 60
    limit = max(deadline - time.time() - share_s, est.get("04_min", 120))
    if not run_step(log, "04", train_argv, logs, _manifest(workdir, "04"), limit_s=limit):
        log.record("04", exported=str(export_latest_checkpoint(workdir)))
    if stop_after == "04":
        for step in SERVE_STEPS:
            log.skip(step, "serve in the next session: stopped after 04, the draft goes back "
                     "(benchmarks/gpu_sglang.sh: join-draft, split with it, start pipeline-serve)")
        return log.data
    measure(profile, workdir, target, Path(work), log, launch, draft=trained_draft(workdir))
    return log.data


def serve_draft(profile: PipelineProfile, target: Path, draft: Path, work: Path, out: Path,
                deadline: float, launch) -> dict:
    """Session B of two: `draft` (session A's 04_train/final, brought back) served beside plain,
    then the offline 05, recorded as run_pipeline records them; no data server, no data step,
    03 or 04. FileNotFoundError, before any server starts, when the draft or a prompt set is
    missing."""
    workdir, draft = Path(work) / "run", Path(draft)
    lacks = [f for f in ("config.json", "model.safetensors") if not (draft / f).is_file()]
    if lacks:
        raise FileNotFoundError(f"the draft folder {draft} has no {' or '.join(lacks)}: give "
                                "session A's 04_train/final (gpu_sglang.sh start unpacks it)")
    missing = missing_prompt_sets(profile, workdir)
    if missing:
        raise FileNotFoundError("05's prompt sets are missing in the serve-only route: "
                                + "; ".join(missing))
    log = StepLog(out, deadline, _meta(profile, target, route="serve", draft=str(draft)))
    measure(profile, workdir, target, Path(work), log, launch, draft=draft)
    return log.data


def measure(profile: PipelineProfile, workdir: Path, target: Path, work: Path, log: StepLog,
            launch, *, draft: Path) -> None:
    """`draft` served beside plain (serve), then the offline 05 on the same prompts."""
    serve(profile, workdir, target, work, log, launch, draft=draft)
    if log.fits("offline", profile.estimates.get("offline", 0)):
        run_step(log, "offline", offline_command(profile, workdir, target, work / "offline",
                                                 draft=draft), work / "logs", check=False)


def serve(profile: PipelineProfile, workdir: Path, target: Path, work: Path, log: StepLog,
          launch, *, draft: Path) -> None:
    """Plain and every speculative setting, started together, then 05 natural and fixed."""
    from contextlib import ExitStack

    est = profile.estimates
    if not profile.settings or not log.fits("serve_start", est.get("serve_start", 0)):
        return
    servers = [launch("plain", 30060, list(profile.serve_server))]
    for i, s in enumerate(profile.settings):
        servers.append(launch(s.name, 30061 + i, [
            *profile.serve_server, "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(draft), *s.flags]))
    with ExitStack() as stack:
        t0 = time.time()
        for s in servers:  # started together: each has a fixed KV pool (--max-total-tokens)
            s.start()
            stack.callback(s.stop)
        for s in servers:
            s.wait()
        log.record("serve_start", wall_s=round(time.time() - t0, 1),
                   servers={name: s.url for name, s in
                            zip(["plain", *[x.name for x in profile.settings]], servers)})
        plain, specs = servers[0].url, [s.url for s in servers[1:]]
        for step, fixed in (("serve_natural", False), ("serve_fixed", True)):
            if not log.fits(step, est.get(step, 0)):
                continue
            bench_dir = work / step
            run_step(log, step, bench_command(profile, workdir, target, bench_dir, plain, specs,
                                              fixed, draft=draft), work / "logs",
                     _manifest(bench_dir, "05"), check=False)


def main(argv: list[str] | None = None) -> int:
    """The route on CPU against the SGLang CPU build (`--profile cpu-qwen2-smoke`): the data
    server, 01, 01b, merge, 02b, 03, 04 and the offline 05, as on the GPU (or its two sessions:
    `--stop-after 04`, then `--draft`)."""
    import argparse
    import logging

    from eagle3.core.launcher import LaunchedServer, sglang_command

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--profile", default="cpu-qwen2-smoke", choices=sorted(PROFILES))
    p.add_argument("--target", type=Path, required=True, help="the target model folder")
    p.add_argument("--work", type=Path, required=True, help="work folder (resumable)")
    p.add_argument("--out", type=Path, help="where pipeline.json goes (default: --work)")
    p.add_argument("--sglang-python", required=True, help="python of the SGLang CPU venv")
    p.add_argument("--server-pythonpath", default=str(ROOT / "tests" / "sglang_support"),
                   help="PYTHONPATH of the server (the CPU build's import-only stand-ins)")
    p.add_argument("--deadline-s", type=float, default=3600.0)
    p.add_argument("--stop-after", choices=["04"],
                   help="session A of two: stop after 04 (default: the whole route)")
    p.add_argument("--draft", type=Path,
                   help="session B of two: serve this draft folder (an earlier run's "
                        "04_train/final) and run the offline 05 only (default: train one)")
    args = p.parse_args(argv)
    if args.draft is not None and args.stop_after is not None:
        p.error("--draft serves an earlier run's draft and --stop-after trains one: give one")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = args.out or args.work
    out.mkdir(parents=True, exist_ok=True)

    def launch(name, port, flags, dump_dir=None):
        env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": args.server_pythonpath}
        if dump_dir is not None:
            env["EAGLE3_DUMP_DIR"] = str(dump_dir)
        cmd = sglang_command(args.sglang_python, f"--model-path {args.target} "
                             "--host 127.0.0.1 --skip-server-warmup", port, list(flags))
        return LaunchedServer(cmd, args.work / "logs" / f"server_{name}.log",
                              f"http://127.0.0.1:{port}", ready_timeout_s=600, env=env)

    profile, target = PROFILES[args.profile], args.target.resolve()
    deadline = time.time() + args.deadline_s
    if args.draft is not None:
        record = serve_draft(profile, target, args.draft.resolve(), args.work.resolve(), out,
                             deadline, launch)
    else:
        record = run_pipeline(profile, target, args.work.resolve(), out, deadline, launch,
                              stop_after=args.stop_after)
    print(json.dumps({k: v.get("wall_s") for k, v in record["steps"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
