"""Phase 3 of the reference benchmark: every draft of the run on the same held-out prompts.

The profile's `phase3` names the work, in the order it is started (PHASE3_WORK; `h200`: the
controls, 05 at temperature 1, the per-epoch checkpoints, the storage layouts, the MLA draft and
the data-size study; `h200-compare` only the drafts of the comparison). First, alone on the GPU,
the 02b runs that work needs (fp8, fp8-all, fp8-topk states; data-size subsets). Then the
evaluations run as subprocesses side by side (reference/parallel.py: batch-1 decoding of this
target leaves the GPU mostly idle): the final draft (bf16 states, chains of 3 and 7) first, then
each work item's. Meanwhile this process trains, one 04 at a time, the storage-layout drafts
(fp8, fp8-all, top-k renormalised, top-k with the tail bucket), the drafts on main's own states
(the MLA draft, 04 --draft-arch mla; the FP8-GEMM Llama draft) and the data-size drafts, and
submits each one's evaluation when it is trained. What no longer fits the time budget is not
started and is listed in the summary; running the phase again does it (finished work is kept)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from eagle3.core.hidden_states import read_capture_layers
from eagle3.core.stage import STAGE_DIRS, atomic_write_json, read_manifest
from reference.parallel import JobPool
from reference.runs import LAYOUT_RUNS, SAME_STATE_RUNS
from reference.stages import ROOT, SCRIPTS, export_checkpoint

log = logging.getLogger(__name__)

# A control has collapsed when its gain over plain decoding (acceptance - 1) is below this share
# of the correct draft's gain on the same prompts.
COLLAPSE_SHARE = 0.25
CONTROL_SPECS = ("control_reference", "control_final_state", "control_shifted_layers")


class Phase3:
    """Submits the evaluations of one run to a JobPool and records how each one ended."""

    def __init__(self, phases, pool: JobPool):
        from reference.evaluate_drafts import EvalSpec

        self.phases, self.pool, self.EvalSpec = phases, pool, EvalSpec
        profile = phases.profile
        self.evals = phases.results / "evals"
        self.limit = max(profile.sweep_prompts, profile.control_prompts)
        self.sweep = {"num_prompts": profile.sweep_prompts, "max_new_tokens": profile.sweep_max_new}
        self.seconds_per_token = phases.seconds_per_token()
        self.accept = expected_acceptance(
            phases.root / "bench_t0" / STAGE_DIRS["05"] / "results.json")
        self.tasks: dict[str, list[str]] = {}  # task -> the jobs it is made of
        self.submitted: list[str] = []  # jobs queued by this run

    def estimate(self, spec, acceptance: float | None = None) -> float:
        from reference.evaluate_drafts import estimate_seconds

        return estimate_seconds(spec, self.seconds_per_token, acceptance or self.accept) + 15

    def evaluate(self, task: str, spec, acceptance: float | None = None) -> None:
        """Queue one draft evaluation (as the job `spec.name`) under `task`."""
        self.tasks.setdefault(task, []).append(spec.name)
        if task in self.phases.state["done"] or (self.evals / f"eval_{spec.name}.json").exists():
            return
        self.submitted.append(spec.name)
        profile = self.phases.profile
        raw = {**asdict(spec), "draft": str(spec.draft)}
        self.pool.submit(spec.name, self.pool.python(ROOT / "reference" / "eval_worker.py", [
            "--target", self.phases.target, "--prompts", self.phases.heldout_prompts,
            "--prompts-workdir", self.phases.heldout, "--limit", self.limit, "--cache", self.evals,
            "--spec", json.dumps(raw), "--device", profile.device,
            "--dtype", self.phases.eval_dtype]),
            self.estimate(spec, acceptance))

    def evaluate_trained(self, name: str, workdir: Path) -> None:
        """Evaluate the draft 04 trained in `workdir` at 3 and 7 steps (when it was trained)."""
        draft = workdir / STAGE_DIRS["04"] / "final"
        if draft.is_dir():
            self.evaluate(f"eval {name}", self.EvalSpec(name, draft, [3, 7], **self.sweep))

    def bench(self, tag: str, temperature: float, prompts: int, factor: float) -> None:
        """05 (`tag` t0: temperature 0, t1: 1), the production script in a subprocess beside
        the other evaluations; `factor` scales its time estimate."""
        phases, task = self.phases, f"05 {tag}"
        self.tasks[task] = [task]
        bench_dir = phases.bench_workdir(tag)
        manifest = read_manifest(bench_dir / STAGE_DIRS["05"]) or {}
        if task in phases.state["done"] or manifest.get("complete"):
            return
        spec = self.EvalSpec(task, bench_dir, [3, 7], num_prompts=prompts,
                             max_new_tokens=phases.profile.bench_max_new)
        args = ["--workdir", bench_dir, *phases.bench_args(temperature, prompts)]
        self.submitted.append(task)
        sets = 1 + len(phases.profile.bench_extra_sets)  # each set is decoded on its own
        self.pool.submit(task, self.pool.python(ROOT / SCRIPTS["05"], args),
                         factor * sets * self.estimate(spec))

    def bench_t0(self) -> None:
        """05 at temperature 0 in phase 3 (profiles whose phase 2 leaves it out): its
        acceptance and lossless check as in phase 2, its tok/s slowed by the evaluations
        beside it."""
        self.bench("t0", 0.0, self.phases.profile.bench_prompts, 1.3)

    def bench_t1(self) -> None:
        """05 at temperature 1 (speculative sampling); sampling accepts less than greedy
        decoding, and the plain baseline is decoded too."""
        self.bench("t1", 1.0, self.phases.profile.bench_t1_prompts, 1.6)

    def record(self, jobs) -> None:
        """Mark each task done, skipped or failed from how its jobs ended."""
        phases, by_name = self.phases, {j.name: j for j in jobs}
        for task, names in self.tasks.items():
            if task in phases.state["done"]:
                continue
            mine = [by_name[n] for n in names if n in by_name]
            bench = task in ("05 t0", "05 t1")
            if bench and task in by_name:
                job = by_name[task]
                if not job.skipped:
                    phases.runner.record_external(task, "05", phases.bench_workdir(task[-2:]),
                                                  job.argv[2:],  # after python and the script
                                                  job.rc, job.wall_s)
            ok = (0, 1) if bench else (0,)  # 05's 1: lossless mismatches, reported
            skipped = [j for j in mine if j.skipped]
            failed = [j for j in mine if not j.skipped and j.rc not in ok]
            if skipped:
                phases.state["skipped"][task] = skipped[0].skipped
            elif failed:
                phases.state.setdefault("failed", {})[task] = "; ".join(
                    f"{j.name} exited with {j.rc} (log: {self.pool.log_path(j)})" for j in failed)
            elif task != "controls" or self._controls_done():
                phases.state["done"][task] = {"wall_s": round(max((j.wall_s for j in mine),
                                                             default=0.0), 1),
                                         "jobs": {j.name: round(j.wall_s, 1) for j in mine},
                                         "side_by_side": True}
                phases.state["skipped"].pop(task, None)
                phases.state.get("failed", {}).pop(task, None)
        phases.save()

    def _controls_done(self) -> bool:
        if not all((self.evals / f"eval_{n}.json").exists() for n in CONTROL_SPECS):
            return False
        run_controls(self.phases, [json.loads((self.evals / f"eval_{n}.json").read_text())
                              for n in CONTROL_SPECS])
        return True


def expected_acceptance(bench_results: Path, default: float = 1.6) -> float:
    """Acceptance at 3 steps measured by 05 at temperature 0 (for time estimates)."""
    if not bench_results.exists():
        return default
    sets = json.loads(bench_results.read_text()).get("prompt_sets") or {}
    values = [r["steps"]["3"]["acceptance_length"] for r in sets.values() if "3" in r["steps"]]
    return values[0] if values else default


def run_phase3(phases) -> None:
    """`phases`: the run's reference.steps.PhaseSteps; the work is its profile's `phase3`."""
    from reference.evaluate_drafts import EvalSpec

    profile, final = phases.profile, phases.main / STAGE_DIRS["04"] / "final"
    t0 = time.time()
    # 02b first, before any evaluation process starts: its batched forward passes slowed from
    # 49K to 4.6K tok/s beside six of them on the H200, while 04 kept its speed.
    for name in extracted_layouts(profile.phase3):
        phases.task(f"extract {name}", lambda n=name: phases.extract_layout(n),
                    phases.extract_estimate(phases.n_train()))
    if "sizes" in profile.phase3:
        for n in phases.size_counts():
            phases.task(f"extract size {n}", lambda n=n: phases.extract_size(n),
                        20.0 if profile.size_link_states else phases.extract_estimate(n))
    with JobPool(profile.eval_workers, phases.deadline, phases.results / "logs",
                 env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}) as pool:
        ph = Phase3(phases, pool)
        ph.evaluate("eval main", EvalSpec("main", final, [3, 7], **ph.sweep))
        for work in profile.phase3:
            PHASE3_WORK[work](ph)
        ph.record(pool.wait())
    runs = phases.state.setdefault("parallel", {}).setdefault("phase3_runs", [])
    runs.append({"wall_s": round(time.time() - t0, 1), "eval_workers": profile.eval_workers,
                 "jobs": len(ph.submitted)})
    phases.save()


def extracted_layouts(work: tuple[str, ...]) -> list[str]:
    """Work folders whose 02b phase 3 runs for `work` (topk_tail trains from topk's files)."""
    out = []
    for name in work:
        if name in LAYOUT_RUNS:
            source = LAYOUT_RUNS[name][2] or name
            if source not in out:
                out.append(source)
    return out


def _controls(ph: Phase3) -> None:
    """The EAGLE mistake and the shifted layers beside the correct draft, on the same prompts."""
    from reference.evaluate_drafts import EvalSpec

    profile, final = ph.phases.profile, ph.phases.main / STAGE_DIRS["04"] / "final"
    control = {"num_prompts": profile.control_prompts, "max_new_tokens": profile.control_max_new}
    ph.evaluate("controls", EvalSpec(CONTROL_SPECS[0], final, [3], **control))
    for name in ("final_state", "shifted_layers"):
        ph.evaluate("controls", EvalSpec(f"control_{name}", final, [3], control=name,
                                         **control), acceptance=1.0)


def _checkpoints(ph: Phase3) -> None:
    """Main's per-epoch checkpoints exported as drafts, each evaluated at 3 steps."""
    from reference.evaluate_drafts import EvalSpec

    phases = ph.phases
    root = phases.main / STAGE_DIRS["04"] / "checkpoints"
    for step in intermediate_steps(root):
        draft = phases.root / "epochs" / f"step_{step:06d}"
        export_checkpoint(root / f"step_{step:06d}",
                          json.loads((root / f"step_{step:06d}" / "config.json").read_text()),
                          draft)
        ph.evaluate(f"eval checkpoint {step}", EvalSpec(f"ckpt_{step}", draft, [3], **ph.sweep))


def _trained(name: str, train: str, estimate: str):
    """A draft trained here by the PhaseSteps method `train(name)` (budgeted by its method
    `estimate()`), then evaluated: the storage layouts of issue 17 (runs.LAYOUT_RUNS) and the
    drafts on main's own states (runs.SAME_STATE_RUNS)."""
    def run(ph: Phase3) -> None:
        phases = ph.phases
        phases.task(f"train {name}", lambda: getattr(phases, train)(name),
                    getattr(phases, estimate)())
        ph.evaluate_trained(name, phases.root / name)
    return run


def _sizes(ph: Phase3) -> None:
    """The data-size study: 02b + 03 + 04 on shares of the merged train split."""
    from reference.evaluate_drafts import EvalSpec

    phases = ph.phases
    for n in phases.size_counts():
        phases.task(f"train size {n}", lambda n=n: phases.train_size(n), phases.size_estimate(n))
        draft = phases.root / f"size_{n}" / STAGE_DIRS["04"] / "final"
        if draft.is_dir():
            ph.evaluate(f"eval size {n}", EvalSpec(f"size_{n}", draft, [3], **ph.sweep))


# Phase-3 work by name (Profile.phase3 lists which, in order). Beside main's evaluation, each
# one submits evaluations to the pool; the trained ones train here first (one 04 at a time, so
# that each one's tokens/s is its own).
PHASE3_WORK = {
    "controls": _controls, "bench_t0": lambda ph: ph.bench_t0(),
    "bench_t1": lambda ph: ph.bench_t1(), "checkpoints": _checkpoints,
    **{n: _trained(n, "train_layout", "fp8_estimate") for n in LAYOUT_RUNS},
    **{n: _trained(n, "train_same_states", "same_states_estimate") for n in SAME_STATE_RUNS},
    "sizes": _sizes}


def intermediate_steps(root: Path) -> list[int]:
    """Steps of 04's complete checkpoints before the last (the final draft), leaving out those
    within 5% of it (a checkpoint a few steps before the end says nothing the final one does
    not)."""
    from eagle3.train.checkpoint import complete_steps

    steps = complete_steps(root)
    return [s for s in steps[:-1] if s < 0.95 * steps[-1]]


def run_controls(phases, results: list[dict]) -> None:
    """From the evaluations of the correct draft and the two controls on the same prompts
    (in CONTROL_SPECS order): did each collapse, and does the project's check catch it."""
    from eagle3.core.target import read_target_info
    from reference.controls import detect_eagle_mistake, detect_shifted_layers

    ref, *controls = results
    ref_gain = ref["steps"]["3"]["acceptance_length"] - 1
    final = phases.main / STAGE_DIRS["04"] / "final"
    info = read_target_info(phases.target)
    captures = read_capture_layers(phases.main)
    detection = {"final_state": detect_eagle_mistake(final),
                 "shifted_layers": detect_shifted_layers(final, captures, info.hidden_size,
                                                         info.vocab_size, phases.root / "controls")}
    out = {}
    for result in controls:
        name = result["control"]
        accept = result["steps"]["3"]["acceptance_length"]
        out[name] = {**detection[name], "acceptance_length": accept,
                     "reference_acceptance_length": ref_gain + 1,
                     "capture_layers_served": result["capture_layers"],
                     "collapsed": accept - 1 < COLLAPSE_SHARE * ref_gain}
        log.info("control %s: acceptance %.3f (correct draft %.3f), collapsed %s, detected %s",
                 name, accept, ref_gain + 1, out[name]["collapsed"], out[name]["detected"])
    atomic_write_json(phases.results / "controls.json", out)
