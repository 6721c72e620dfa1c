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
gradient (or all zeros) fails. `ratio` is `err(fp8) / err(floor)`: 25 says the FP8 step moves that
gradient 25 times as far (in 1 - cos) as the 1% perturbation. `1 - cos` grows as the square of
the relative error, so a ratio of 25 is a 5x larger relative gradient error.

Figures (BENCHMARKS.md, FP8 GEMMs): the plain bf16 step is itself ~4x inside the floor on CPU;
every e4m3 recipe tried (per-row, 1x128/128x128, e5m2 gradients, any one GEMM alone) fails.
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
    error: dict[str, float]  # 1 - cos(candidate, ref)
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


def judge_gradients(candidate: dict, floor: dict, ref: dict,
                    max_ratio: float = 1.0) -> GradientVerdict:
    """The criterion on three `{parameter name: gradient or None}` maps: `candidate` (the FP8
    step), `floor` (the plain step on perturbed inputs) and `ref` (the reference step)."""
    error, floors, ratio, failing = {}, {}, {}, []
    for name, r in ref.items():
        if r is None or not bool(r.ne(0).any()):
            continue
        got = candidate.get(name)
        floors[name] = grad_error(floor[name], r)
        if got is None or not bool(got.ne(0).any()):
            error[name], ratio[name] = 1.0, float("inf")
            failing.append(name)
            continue
        error[name] = grad_error(got, r)
        # a floor of exactly 0 (a gradient the perturbation leaves as it was) passes only 0
        ratio[name] = error[name] / floors[name] if floors[name] > 0 else (
            0.0 if error[name] <= 0 else float("inf"))
        if ratio[name] > max_ratio:
            failing.append(name)
    return GradientVerdict(not failing, error, floors, ratio, failing, max_ratio)
