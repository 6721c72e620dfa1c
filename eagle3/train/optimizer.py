"""The optimizer of 04 and the gradient clipping in front of it.

AdamW over the fp32 parameters (the master weights), fused on CUDA. Clipping to `--max-grad-norm`
scales every gradient by `min(1, max_norm / (norm + 1e-6))` (torch's `clip_grad_norm_`). On the
fused AdamW that factor is not applied by a pass over the gradients of its own: the optimizer's
`grad_scale` (the hook torch's GradScaler uses to unscale) divides each gradient by
`max(1, (norm + 1e-6) / max_norm)` inside the update kernel as it reads it, with no host sync.
Measured at Kimi-K2.5 draft size on an H200 (BENCHMARKS.md, "Training step"): clipping fell from
4.0 to 1.4 ms per step and the fused AdamW rose from 9.9 to 11.7 ms, a net ~0.8 ms. The
non-finite check (eagle3/train/guards.py) sets the same optimizer's `found_inf`.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.train.guards import guard_nonfinite

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def build_optimizer(draft: nn.Module, lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW over the fp32 parameters (the master weights); fused on CUDA."""
    return torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=weight_decay, fused=device.type == "cuda")


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float, step: int,
                   flag: torch.Tensor) -> torch.Tensor:
    """The total L2 norm of the gradients of `optimizer`'s parameters (before clipping, as
    logged), their clipping to `max_norm` for the coming `optimizer.step()` (module doc) and the
    non-finite guard (`flag` records the first bad step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    guard_nonfinite(optimizer, norm, step, flag)
    if optimizer.defaults.get("fused"):
        # the fused kernel divides every gradient by it while updating (1 = unclipped)
        optimizer.grad_scale = torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
