"""The phases of the reference benchmark: which stage runs when, on which folder, with which flags.

Work folder layout (`W` = --workdir):

    W/corpus/      reference/build_corpus.py output (samples, 01 recipes, split)
    W/target/      the reference target (reference/train_target.py)
    W/main/        the pipeline run: 01 -> 01b -> merge -> 02b (bf16 unless the profile's
                   main_dtype says) -> 03 -> 04
    W/heldout/     01 of the held-out prompts (never generated from; 05's prompt set)
    W/bench_t0/    05 at temperature 0; W/bench_t1/ at temperature 1 (upstreams linked to main)
    W/fp8/         02b with fp8 storage + 04 (merged data and vocab linked to main)
    W/fp8_all/, W/topk/, W/topk_tail/  the same for the compact layouts (LAYOUT_RUNS);
                   topk_tail trains from topk's files with the tail-bucket loss
    W/mla/, W/fp8gemm/, W/perstep/  04 on main's merged data, states and vocab
                   (SAME_STATE_RUNS): the MLA draft, the Llama draft with the profile's FP8 GEMM
                   flags, the Llama draft trained with the per-step TTT unroll
    W/size_<n>/    02b + 03 + 04 on the first n merged train samples
    W/epochs/      per-epoch checkpoints of main exported as draft folders
    W/results/     stages.json (every stage's record), evals/ (sweep results), controls.json,
                   state.json (done / skipped work), summary.{json,md}, run.log

A task is skipped, not started, when its estimated time exceeds what is left of the command's
budget; running the phase again does it (finished work is never redone).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eagle3.core.records import count_jsonl
from eagle3.core.stage import STAGE_DIRS, atomic_write_json, read_manifest
from eagle3.smollm2 import target as smollm2_target
from reference import build_corpus, train_target
from reference.phase3 import run_phase3
from reference.runs import LAYOUT_RUNS, SAME_STATE_RUNS
from reference.stages import StageRunner, link_states, linked_workdir, subset_workdir

log = logging.getLogger(__name__)
BENCH_STEPS = (3, 7)  # chains 05 measures: SGLang's 3-1-4 setting (ceiling 4) and 7 (ceiling 8)
SELF_WRITTEN_DATASET = "chat_self_written"  # 01's dataset of the self_written profiles
DATASETS_DIR = Path(__file__).resolve().parents[1] / "datasets"  # the shipped recipes


def shipped_recipe(name: str) -> dict:
    """A recipe file of datasets/, as JSON (a profile names its steer and extra sources so)."""
    return json.loads((DATASETS_DIR / name).read_text())


class PhaseMissing(RuntimeError):
    """A phase started before the one it builds on; the message says which to run."""


def fp32_moe_error(device: str) -> str | None:
    """Why a DeepSeek-V3 MoE layer cannot run in float32 on `device` (None when it can).

    transformers routes experts through `grouped_mm`, whose CUDA kernels target bf16; if this
    torch has no float32 path the evaluation runs in bf16 instead (and says so).
    """
    import torch

    if not device.startswith("cuda"):
        return None
    from reference.train_target import PRESETS, build_model

    try:
        model = build_model(PRESETS["smoke"], 64, 64, 0).to(device, torch.float32).eval()
        with torch.no_grad():
            model(input_ids=torch.arange(8, device=device)[None])
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:  # no fp32 kernel
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class PhaseSteps:
    """Runs phases 1-3 of one reference run; `state` records done and skipped work."""

    def __init__(self, workdir: Path, profile_name: str, profile, runner: StageRunner,
                 deadline: float, gguf: Path | None = None):
        self.root, self.profile, self.gguf = Path(workdir), profile, gguf
        self.runner, self.deadline = runner, deadline
        self.corpus, self.target = self.root / "corpus", self.root / "target"
        self.main = self.root / "main"
        self.heldout, self.results = self.root / "heldout", self.root / "results"
        path = self.results / "state.json"
        self.state = json.loads(path.read_text()) if path.exists() else {
            "profile": profile_name, "done": {}, "skipped": {}, "phases": {}}

    # ------------------------------------------------------------ bookkeeping

    def remaining(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        atomic_write_json(self.results / "state.json", self.state)

    def task(self, name: str, fn, estimate_s: float | None = None) -> None:
        """Run `fn` once (across commands).

        A task with an estimate is optional: skipped while it would overrun the budget, and an
        error in it is recorded (summary "Failed") instead of ending the command, so that one
        broken sweep does not cost the GPU time of the others. A task without one is required.
        """
        if name in self.state["done"]:
            return
        if estimate_s is not None and estimate_s > self.remaining():
            self.state["skipped"][name] = (f"needs ~{estimate_s:.0f} s, {self.remaining():.0f} s "
                                           "left in this command: run the phase again")
            log.warning("skipping %s: %s", name, self.state["skipped"][name])
            self.save()
            return
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- optional work: recorded, reported, not hidden
            if estimate_s is None:
                raise
            log.exception("optional task %s failed; going on with the others", name)
            self.state.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"[:500]
            self.save()
            return
        self.state["done"][name] = {"wall_s": round(time.time() - t0, 1),
                                    "estimate_s": estimate_s}
        self.state["skipped"].pop(name, None)
        self.state.get("failed", {}).pop(name, None)
        self.save()

    def run_phase(self, phase: int) -> None:
        t0 = time.time()
        {1: self.phase1, 2: self.phase2, 3: self.phase3}[phase]()
        self.state["phases"][str(phase)] = round(time.time() - t0, 1)
        self.save()

    def _wall(self, label: str) -> float:
        return self.runner.records.get(label, {}).get("wall_s", 0.0)

    def _require(self, stage_dir: Path, phase: int) -> None:
        if not (read_manifest(stage_dir) or {}).get("complete"):
            raise PhaseMissing(f"{stage_dir} is not complete: run phase {phase} first (the work "
                               "folder lives on the GPU machine; if the machine was given back "
                               "between commands, start again from phase 1)")

    # ------------------------------------------------------------ phase 1

    def phase1(self) -> None:
        profile, t = self.profile, self.target
        if profile.corpus_source == "stdlib":
            self.runner.run_callable(
                "corpus", lambda: build_corpus.main(["--out", str(self.corpus), *profile.corpus]),
                f"python reference/build_corpus.py --out {self.corpus} {' '.join(profile.corpus)}",
                self.root)
        self.task("eval dtype", self.choose_eval_dtype)
        if profile.target_source == "smollm2":
            argv = ["--out", str(t), *(["--gguf", str(self.gguf)] if self.gguf else [])]
            self.runner.run_callable(
                "target", lambda: smollm2_target.main(argv),
                f"python -m eagle3.smollm2.target {' '.join(argv)}", self.root)
        else:
            self.runner.run_callable(
                "target", lambda: train_target.main(["--corpus", str(self.corpus), "--out",
                                                     str(t), "--device", profile.device,
                                                     *profile.target]),
                f"python reference/train_target.py --corpus {self.corpus} --out {t} --device "
                f"{profile.device} {' '.join(profile.target)}", self.root)
        r = self.runner
        if profile.corpus_source == "self_written":
            self.write_self_written_recipe()
        r.run("01 main", "01", self.main, self.prepare_args(self.train_recipe))
        r.run("01b main", "01b", self.main, self.generate_args())
        r.run("merge main", "merge", self.main, list(profile.merge))
        if profile.corpus_source == "stdlib":
            r.run("01 held-out", "01", self.heldout, self.prepare_args("recipe_heldout.json"))
        else:  # the held-out prompts are 01's own split of the self-written ones
            self.heldout.mkdir(parents=True, exist_ok=True)

    @property
    def train_recipe(self) -> str:
        return ("recipe_train.json" if self.profile.corpus_source == "stdlib"
                else "recipe_self_written.json")

    def write_self_written_recipe(self) -> Path:
        """W/corpus/recipe_self_written.json: one dataset the target writes itself (01's
        self-written source), prompts only (01b writes the last reply)."""
        path = self.corpus / "recipe_self_written.json"
        block = dict(self.profile.self_written)  # the entry's count and seed, the rest its block
        if isinstance(block.get("steer"), str):  # a shipped recipe's steer: its axes' one home
            block["steer"] = shipped_recipe(block["steer"])["datasets"][0]["self_written"][
                "steer"]
        extra = []
        for name in self.profile.extra_recipes:  # beside it, their paths made absolute
            for entry in shipped_recipe(name)["datasets"]:
                if entry.get("path"):
                    entry = {**entry, "path": str((DATASETS_DIR / entry["path"]).resolve())}
                extra.append(entry)
        recipe = {"name": "reference_chat", "description": "user turns written by the target "
                  "itself (01's self-written source); replies by 01b",
                  "datasets": [{"name": SELF_WRITTEN_DATASET, "count": block.pop("count"),
                                "seed": block.pop("seed", 0), "self_written": block,
                                "max_seq_len": self.profile.self_written_max_seq_len,
                                "regenerate": True}, *extra]}
        self.corpus.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, recipe)
        return path

    # The command line of each stage (tests parse them with the scripts' own parsers).

    def prepare_args(self, recipe: str) -> list:
        return ["--recipe", self.corpus / recipe, "--target", self.target, *self.profile.prepare]

    def generate_args(self) -> list:
        return ["--target", self.target, "--backend", "hf", "--device", self.profile.device,
                *self.profile.generate]

    def vocab_args(self) -> list:
        return ["--target", self.target, "--draft-vocab", self.profile.draft_vocab]

    def bench_args(self, temperature: float, prompts: int) -> list:
        args = ["--target", self.target, "--draft", self.main / STAGE_DIRS["04"] / "final",
                "--backend", "hf", "--prompt-sets", self.heldout_prompts, "--num-prompts",
                prompts, "--max-new-tokens", self.profile.bench_max_new,
                "--temperature", temperature, "--seed", 0, "--steps", *BENCH_STEPS,
                "--device", self.profile.device, "--dtype", self.eval_dtype]
        if self.profile.bench_extra_sets:  # --prompt-sets takes them after the held-out set
            args[args.index(self.heldout_prompts) + 1:args.index(self.heldout_prompts) + 1] = \
                list(self.profile.bench_extra_sets)
        if self.profile.context_bucket_tokens:
            args += ["--context-bucket-tokens", self.profile.context_bucket_tokens]
        return args

    def choose_eval_dtype(self) -> None:
        error = (fp32_moe_error(self.profile.device) if self.profile.eval_dtype == "float32"
                 else None)
        self.state["eval_dtype"] = "bfloat16" if error else self.profile.eval_dtype
        if error:
            self.state["eval_dtype_note"] = f"float32 MoE failed ({error}): evaluating in bf16"
            log.warning(self.state["eval_dtype_note"])

    # ------------------------------------------------------------ phase 2

    def steps_per_epoch(self, workdir: Path) -> int:
        """About the optimizer steps of one 04 epoch: train tokens over the packed row width.

        04 packs many short samples per row nearly full, so this is at most the true count; the
        checkpoint taken at k times it is labelled with its real step (and epoch share) later.
        """
        from eagle3.core.records import read_jsonl

        tokens = sum(min(r["seq_len"], self.profile.train_max_seq_len)
                     for r in read_jsonl(Path(workdir) / STAGE_DIRS["merge"] / "train.jsonl"))
        return max(1, tokens // self.profile.pack_tokens)

    def train_args(self, workdir: Path, precision: tuple[str, ...] | None = None) -> list:
        """04 flags: checkpoint and evaluate about every epoch (see `steps_per_epoch`), keep
        every checkpoint (the report labels each with its step and epoch share); `precision`:
        the GEMM flags (default the profile's train_precision, that of every draft but
        fp8gemm)."""
        per_epoch = self.steps_per_epoch(workdir)
        self.state.setdefault("steps_per_epoch", {})[Path(workdir).name] = per_epoch
        profile = self.profile
        precision = profile.train_precision if precision is None else precision
        return ["--target", self.target, "--device", profile.device, "--epochs", profile.epochs,
                "--max-seq-len", profile.train_max_seq_len, "--pack-tokens", profile.pack_tokens,
                "--save-every", per_epoch, "--eval-every", per_epoch,
                "--keep-latest", profile.epochs + 2, *profile.train, *precision]

    def extract_args(self, dtype: str) -> list:
        """02b flags: the in-process transformers target, files stored in layout `dtype`."""
        topk = ["--teacher-topk", self.profile.teacher_topk] if dtype == "fp8-topk" else []
        return ["--target", self.target, "--backend", "hf", "--device", self.profile.device,
                "--dtype", dtype, *topk, *self.profile.extract]

    def phase2(self) -> None:
        self._require(self.main / STAGE_DIRS["merge"], 1)
        r = self.runner
        r.run(self.main_extract, "02b", self.main, self.extract_args(self.profile.main_dtype))
        r.run("03 main", "03", self.main, self.vocab_args())
        r.run("04 main", "04", self.main, self.train_args(self.main))
        # 05 at temperature 0 runs alone: its tok/s and speedup are the run's speed figures
        # (unless the profile runs it in phase 3, beside the evaluations, to save time). The
        # fp8-state and data-size drafts are trained in phase 3, beside its evaluations.
        if "bench_t0" not in self.profile.phase3:
            self.task("05 t0", lambda: self.bench("t0", 0.0))

    @property
    def main_extract(self) -> str:
        """The main run's 02b in stages.json (its storage layout named)."""
        return f"02b main ({self.profile.main_dtype})"

    def _per_sample_s(self) -> float:
        """02b + 04 seconds per train sample of the main run (for the time budget)."""
        return (self._wall(self.main_extract) + self._wall("04 main")) / max(1, self.n_train())

    def fp8_estimate(self) -> float:
        return 1.1 * self._per_sample_s() * self.n_train() + 20

    def size_estimate(self, n: int) -> float:
        if self.profile.size_link_states:  # 02b's files are links to main's: 04 alone
            return self._wall("04 main") / max(1, self.n_train()) * n + 60
        return self._per_sample_s() * n + 30

    def n_train(self) -> int:
        return count_jsonl(self.main / STAGE_DIRS["merge"] / "train.jsonl")

    def size_counts(self) -> list[int]:
        n = self.n_train()
        counts = {max(4, int(f * n)) for f in self.profile.size_fractions}
        return sorted(counts | {c for c in self.profile.size_counts if c < n})

    def layout_workdir(self, name: str) -> Path:
        """W/<name>: main's merged data and vocab (and the shared run's 02b files) linked."""
        links = {STAGE_DIRS["merge"]: self.main / STAGE_DIRS["merge"],
                 STAGE_DIRS["03"]: self.main / STAGE_DIRS["03"]}
        shared = LAYOUT_RUNS[name][2]
        if shared:
            links[STAGE_DIRS["02b"]] = self.layout_workdir(shared) / STAGE_DIRS["02b"]
        return linked_workdir(self.root / name, links)

    def extract_layout(self, name: str) -> None:
        dtype, _, shared = LAYOUT_RUNS[name]
        if shared:
            return self.extract_layout(shared)
        self.runner.run(f"02b {name}", "02b", self.layout_workdir(name), self.extract_args(dtype))

    def train_layout(self, name: str) -> None:
        self.extract_layout(name)  # a no-op when phase 3 extracted it first
        w, mode = self.layout_workdir(name), LAYOUT_RUNS[name][1]
        extra = ["--topk-teacher", mode] if mode else []
        self.runner.run(f"04 {name}", "04", w, [*self.train_args(w), *extra])

    def size_workdir(self, n: int) -> Path:
        return subset_workdir(self.main, self.root / f"size_{n}", n)

    def extract_size(self, n: int) -> None:
        w = self.size_workdir(n)
        if self.profile.size_link_states:
            link_states(self.main / STAGE_DIRS["02b"], w / STAGE_DIRS["02b"], n)
        self.runner.run(f"02b size {n}", "02b", w, self.extract_args(self.profile.main_dtype))

    def extract_estimate(self, samples: int) -> float:
        """02b seconds for `samples` train samples, from the main run's rate."""
        return 1.2 * self._wall(self.main_extract) * samples / max(1, self.n_train()) + 10

    def same_states_workdir(self, name: str) -> Path:
        """W/<name> (SAME_STATE_RUNS): the main run's merged data, hidden states and vocabulary."""
        if name not in SAME_STATE_RUNS:
            raise KeyError(f"{name!r} is not one of SAME_STATE_RUNS {sorted(SAME_STATE_RUNS)}")
        return linked_workdir(self.root / name, {
            STAGE_DIRS[k]: self.main / STAGE_DIRS[k] for k in ("merge", "02b", "03")})

    def same_states_args(self, name: str) -> list:
        """04 flags of a SAME_STATE_RUNS draft: main's, with its own additions."""
        w, extra = self.same_states_workdir(name), SAME_STATE_RUNS[name]
        if extra == "profile":
            return self.train_args(w, precision=self.profile.fp8gemm_train)
        return [*self.train_args(w), *extra]

    def train_same_states(self, name: str) -> None:
        """04 of a SAME_STATE_RUNS draft on the main run's states (those the main draft read)."""
        self.runner.run(f"04 {name}", "04", self.same_states_workdir(name),
                        self.same_states_args(name))

    def same_states_estimate(self) -> float:
        """A new draft graph compiles first (04 main's wall time holds its compilation)."""
        return 1.3 * self._wall("04 main") + 30

    def train_size(self, n: int) -> None:
        self.extract_size(n)
        w = self.size_workdir(n)
        self.runner.run(f"03 size {n}", "03", w, self.vocab_args())
        self.runner.run(f"04 size {n}", "04", w, self.train_args(w))

    # ------------------------------------------------------------ 05

    @property
    def heldout_prompts(self) -> Path:
        if self.profile.corpus_source == "self_written":  # 01's held-out split, never trained on
            return self.main / STAGE_DIRS["01"] / SELF_WRITTEN_DATASET / "heldout.jsonl"
        return (self.heldout / STAGE_DIRS["01"] / build_corpus.DATASET_HELDOUT
                / "conversations.jsonl")

    @property
    def eval_dtype(self) -> str:
        return self.state.get("eval_dtype", self.profile.eval_dtype)

    def seconds_per_token(self) -> float:
        """Plain decoding cost of one token at batch 1 (measured once, then cached)."""
        if "seconds_per_token" not in self.state:
            from reference.evaluate_drafts import probe_seconds_per_token

            self.state["seconds_per_token"] = probe_seconds_per_token(
                self.target, self.heldout_prompts, self.heldout, self.profile.device,
                self.eval_dtype)
            self.save()
        return self.state["seconds_per_token"]

    def bench(self, tag: str, temperature: float) -> None:
        """05 on the held-out prompts (prompt count cut to fit the command's budget)."""
        cost = self.profile.bench_max_new * self.seconds_per_token() * (
            1 + sum((1 + 0.1 * s) / 2.0 for s in BENCH_STEPS))  # acceptance ~2 assumed
        fit = int((self.remaining() - 15) / cost)
        prompts = max(min(self.profile.bench_prompts, 4), min(self.profile.bench_prompts, fit))
        if prompts < self.profile.bench_prompts:
            self.state.setdefault("notes", []).append(
                f"05 {tag}: {prompts} prompts instead of {self.profile.bench_prompts} "
                "(time budget)")
        self.runner.run(f"05 {tag}", "05", self.bench_workdir(tag),
                        self.bench_args(temperature, prompts),
                        ok_codes=(0, 1))  # 1: lossless mismatches, reported in the summary

    def bench_workdir(self, tag: str) -> Path:
        """The work folder of one 05 run, its upstream stages linked to the main run's."""
        return linked_workdir(self.root / f"bench_{tag}", {
            STAGE_DIRS["merge"]: self.main / STAGE_DIRS["merge"],
            STAGE_DIRS["02b"]: self.main / STAGE_DIRS["02b"]})

    # ------------------------------------------------------------ phase 3

    def phase3(self) -> None:
        self._require(self.main / STAGE_DIRS["04"], 2)
        run_phase3(self)
