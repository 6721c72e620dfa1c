"""The criterion an FP8 recipe's gradients must meet before FP8 GEMMs may train by default.

For every trained parameter `p`, with `err(g) = 1 - cos(g_p, ref_p)` (float64 cosine):

    err(fp8) <= max_ratio * err(floor)

- `ref`: the reference step's gradients: float64 on CPU (benchmarks/bench_train_gpu.py --mid),
  the plain bf16 step on a GPU.
- `floor`: the plain step (same precision as `ref`'s comparison row) on the aux states perturbed
  by 1% (`aux * (1 + 0.01 n)`, n standard normal, seed 7): how far a change that is obviously
  harmless moves this gradient.
- `max_ratio` 1 by default: the FP8 step may move no gradient further than that perturbation.

A parameter whose reference gradient is zero is not judged; one the FP8 step leaves without a
gradient (or all zeros) fails (its error is infinite). `ratio` is `err(fp8) / err(floor)`: 25
says the FP8 step moves that gradient 25 times as far (in 1 - cos) as the 1% perturbation.
`1 - cos` grows as the square of the relative error, so a ratio of 25 is a 5x larger relative
gradient error.

Figures (BENCHMARKS.md, "FP8 GEMMs in training"): the plain bf16 step passes (largest ratio 0.46 on CPU at
the `--mid` size); every FP8 recipe tried fails (per-row 47.9, 1x128 tiles with 128x128 weight
blocks 44.4, e5m2 gradients 60.1, the weight-gradient GEMMs alone 7.0): e4m3's 3 mantissa bits
round each operand by ~2.6%, more than the 1% perturbation by themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def grad_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """`1 - cos(got, ref)` over all elements, in float64."""
    a, b = got.detach().double().flatten(), ref.detach().double().flatten()
    return float(1 - (a @ b) / (a.norm() * b.norm()))


@dataclass
class GradientVerdict:
    """The criterion's outcome, parameter by parameter (the module doc)."""

    passed: bool
    error: dict[str, float]  # 1 - cos(candidate, ref); inf: no gradient
    floor: dict[str, float]  # 1 - cos(floor, ref)
    ratio: dict[str, float]  # error / floor
    failing: list[str] = field(default_factory=list)  # over max_ratio, or no gradient
    max_ratio: float = 1.0

    def worst(self) -> tuple[str, float]:
        """(parameter, ratio) of the largest ratio."""
        name = max(self.ratio, key=self.ratio.get)
        return name, self.ratio[name]

    def as_dict(self) -> dict:
        return {"passed": self.passed, "max_ratio": self.max_ratio, "failing": self.failing,
                "error": self.error, "floor": self.floor, "ratio": self.ratio}


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """`{name: 1 - cos(grads[name], ref[name])}` over the parameters whose reference gradient is
    not zero; infinite where `grads` has none (or all zeros). A step's errors can be taken as
    soon as its gradients exist and the gradients dropped (a Kimi-size draft's are 4.8 GB)."""
    out = {}
    for name, r in ref.items():
        if r is None or not bool(r.ne(0).any()):
            continue
        got = grads.get(name)
        missing = got is None or not bool(got.ne(0).any())
        out[name] = float("inf") if missing else grad_error(got, r)
    return out


def judge(error: dict, floor: dict, max_ratio: float = 1.0) -> GradientVerdict:
    """The criterion on the errors of the candidate step and of the floor (grad_errors)."""
    ratio, failing = {}, []
    for name, e in error.items():
        # a floor of 0 (a gradient the perturbation leaves as it was) passes only an error of 0
        ratio[name] = e / floor[name] if floor[name] > 0 else (0.0 if e <= 0 else float("inf"))
        if ratio[name] > max_ratio:
            failing.append(name)
    return GradientVerdict(not failing, error, dict(floor), ratio, failing, max_ratio)


def judge_gradients(candidate: dict, floor: dict, ref: dict,
                    max_ratio: float = 1.0) -> GradientVerdict:
    """The criterion on three `{parameter name: gradient or None}` maps: `candidate` (the FP8
    step), `floor` (the plain step on perturbed inputs) and `ref` (the reference step)."""
    return judge(grad_errors(candidate, ref), grad_errors(floor, ref), max_ratio)
