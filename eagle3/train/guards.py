"""Checks of the training step that stop a run rather than let it train on silently: a
non-finite gradient norm (its update skipped on the device, the run stopped at the next host
sync) and a backward graph cut somewhere (some parameters without a gradient)."""

from __future__ import annotations

import torch
from torch import nn


def guard_nonfinite(optimizer, grad_norm, step: int, flag: torch.Tensor) -> None:
    """Keep a non-finite update from being applied: fused AdamW skips it on the device (no sync)
    and `flag` records the first such step; other optimizers check at once."""
    bad = ~torch.isfinite(grad_norm)
    if not optimizer.defaults.get("fused"):
        if bool(bad):
            raise FloatingPointError(f"step {step}: gradient norm {float(grad_norm)} is not "
                                     "finite; stopping before the update")
        return
    optimizer.found_inf = bad.float()
    flag.copy_(torch.where(bad & (flag < 0), torch.full_like(flag, step), flag))


def raise_if_nonfinite(flag: torch.Tensor) -> None:
    step = int(flag)  # host sync: only at log / eval / save points
    if step >= 0:
        raise FloatingPointError(f"step {step}: gradient norm was not finite; its update was "
                                 "skipped and the run stops here (resume from the last "
                                 "checkpoint with a lower --lr or --max-grad-norm)")


class TrainError(RuntimeError):
    """The training itself went wrong (not its input): the message says what and what to do."""


def raise_if_gradient_missing(draft: nn.Module, fp8: bool) -> None:
    """After the first step of a process: when some parameters got a gradient and others none
    (or all zeros), the backward graph is cut somewhere; training on would update only the
    layers after the cut while every log looks fine. One host sync per run."""
    params = list(draft.named_parameters())
    with_grad = [(n, p.grad) for n, p in params if p.grad is not None]
    amax = torch.stack([g.abs().amax().float() for _, g in with_grad]).tolist() if with_grad \
        else []
    missing = [n for n, p in params if p.grad is None]
    missing += [n for (n, _), m in zip(with_grad, amax) if m == 0.0]
    if missing and len(missing) < len(params):
        hint = (" (this run trains with FP8 GEMMs: rerun with --fp8-gemm off)" if fp8
                else "")
        raise TrainError(f"the first training step gave no gradient to {', '.join(missing)} "
                         f"while the other parameters got one: the backward graph is cut"
                         f"{hint}")
