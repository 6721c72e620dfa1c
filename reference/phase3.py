"""Phase 3 of the reference benchmark: every draft of the run on the same held-out prompts.

In priority order (later tasks are skipped when the command's budget runs out): the final draft
(bf16 states, chains of 3 and 7), the controls and their detection, 05 at temperature 1, the
per-epoch checkpoints, then the fp8-state and data-size drafts (trained here first if phase 2
had no time left for them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.stage import atomic_write_json, read_manifest
from reference.stages import export_checkpoint

log = logging.getLogger(__name__)

# A control has collapsed when its gain over plain decoding (acceptance - 1) is below this share
# of the correct draft's gain on the same prompts.
COLLAPSE_SHARE = 0.25


def run_phase3(s) -> None:
    """`s`: the run's reference.steps.PhaseSteps."""
    from eagle3.chat import ChatRenderer
    from eagle3.prompts import load_prompt_set
    from eagle3.target import load_tokenizer
    from reference.evaluate_drafts import DraftEvaluator, EvalSpec, estimate_seconds

    p, final = s.p, s.main / "04_train" / "final"
    limit = max(p.sweep_prompts, p.control_prompts)
    prompts = load_prompt_set(str(s.heldout_prompts), s.heldout,
                              ChatRenderer(load_tokenizer(s.target)), limit).prompts
    ev = DraftEvaluator(s.target, prompts, s.results / "evals", p.device, s.eval_dtype)
    sweep = {"num_prompts": p.sweep_prompts, "max_new_tokens": p.sweep_max_new}
    main = EvalSpec("main", final, [3, 7], **sweep)
    s.task("eval main", lambda: ev.run(main))
    base = ev.baseline(p.sweep_prompts, p.sweep_max_new, 0.0)
    s.state["seconds_per_token"] = spt = base["seconds_per_token"]
    accept = ev.run(main)["steps"]["3"]["acceptance_length"]

    def est(spec, acceptance=accept):
        return estimate_seconds(spec, spt, acceptance) + 10

    _controls_and_sampling(s, ev, est, EvalSpec)
    root = s.main / "04_train" / "checkpoints"
    for step in intermediate_steps(root):
        spec = EvalSpec(f"ckpt_{step}", s.w / "epochs" / f"step_{step:06d}", [3], **sweep)
        s.task(f"eval checkpoint {step}",
               lambda spec=spec, d=root / f"step_{step:06d}": _eval_epoch(ev, spec, d),
               est(spec))
    # Runs phase 2 could not fit come next, each followed by its evaluation.
    s.task("train fp8", s.train_fp8, s.fp8_estimate())
    if (s.w / "fp8" / "04_train" / "final").is_dir():
        spec = EvalSpec("fp8", s.w / "fp8" / "04_train" / "final", [3, 7], **sweep)
        s.task("eval fp8", lambda: ev.run(spec), est(spec))
    for n in s.size_counts():
        s.task(f"train size {n}", lambda n=n: s.train_size(n), s.size_estimate(n))
        draft = s.w / f"size_{n}" / "04_train" / "final"
        if draft.is_dir():
            spec = EvalSpec(f"size_{n}", draft, [3], **sweep)
            s.task(f"eval size {n}", lambda spec=spec: ev.run(spec), est(spec))


def _controls_and_sampling(s, ev, est, EvalSpec) -> None:
    """The controls beside the correct draft, then 05 at temperature 1 (speculative sampling)."""
    p, final = s.p, s.main / "04_train" / "final"
    control = {"num_prompts": p.control_prompts, "max_new_tokens": p.control_max_new}
    specs = [EvalSpec("control_reference", final, [3], **control),
             EvalSpec("control_final_state", final, [3], control="final_state", **control),
             EvalSpec("control_shifted_layers", final, [3], control="shifted_layers", **control)]
    s.task("controls", lambda: run_controls(s, ev, specs), sum(est(x, 1.0) for x in specs))
    bench = EvalSpec("bench", final, [3, 7], num_prompts=p.bench_prompts,
                     max_new_tokens=p.bench_max_new)
    s.task("05 t1", lambda: s.bench("t1", 1.0), est(bench) * 1.6)


def intermediate_steps(root: Path) -> list[int]:
    """Steps of 04's complete checkpoints before the last (the final draft), leaving out those
    within 5% of it (a checkpoint a few steps before the end says nothing the final one does
    not)."""
    from eagle3.checkpoint import complete_steps

    steps = complete_steps(root)
    return [s for s in steps[:-1] if s < 0.95 * steps[-1]]


def _eval_epoch(ev, spec, step_dir: Path) -> None:
    """Export one epoch's checkpoint as a draft folder (`spec.draft`), then evaluate it."""
    config = json.loads((step_dir / "config.json").read_text())  # holds the DraftConfig fields
    export_checkpoint(step_dir, config, spec.draft)
    ev.run(spec)


def run_controls(s, ev, specs) -> None:
    """Evaluate the controls next to the correct draft, then run the project's checks."""
    from eagle3.target import read_target_info
    from reference.controls import detect_eagle_mistake, detect_shifted_layers

    ref, *controls = [ev.run(spec) for spec in specs]
    ref_gain = ref["steps"]["3"]["acceptance_length"] - 1
    final = s.main / "04_train" / "final"
    info = read_target_info(s.target)
    captures = read_manifest(s.main / "02b_hidden_states")["capture_layers"]
    detection = {"final_state": detect_eagle_mistake(final),
                 "shifted_layers": detect_shifted_layers(final, captures, info.hidden_size,
                                                         info.vocab_size, s.w / "controls")}
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
    atomic_write_json(s.results / "controls.json", out)
