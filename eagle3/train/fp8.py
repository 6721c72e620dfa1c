"""FP8 GEMMs for training the draft: the draft's linear layers in float8 e4m3 with per-row scales.

Each training-mode `nn.Linear` of the draft that `use_fp8_gemms` converts computes its three
GEMMs (the forward `y = x W^T`, the input gradient `g W` and the weight gradient `g^T x`) with
`torch._scaled_mm` on float8 e4m3 operands. Every operand is scaled along the GEMM's contraction
dimension, one scale per row of the result it feeds ("rowwise"): row m of `x` and row n of `W`
for the forward; row m of `g` and column k of `W` for the input gradient; column n of `g` and
column k of `x` for the weight gradient. A scale is `amax / 448` (e4m3's largest value), so no
value saturates. Products accumulate in fp32 inside the GEMM; the result is written in the
activation dtype (bf16 under autocast) and the weight gradient in the parameter's dtype.

What stays in higher precision: the master weights and the optimizer (fp32), what the backward
saves (the bf16 input, not its fp8 copy: no more memory than the bf16 path), attention, norms,
the loss and the draft's `lm_head` (its logits feed the soft cross-entropy directly). Eval mode
(04's evaluation, the acceptance estimate) and the exported draft use the plain bf16/fp32
GEMMs: what an engine serves is the same checkpoint in bf16.

The fp8 path equals a float64 simulation of the same quantisation (tests/train/test_fp8.py); what
it costs in loss and acceptance is measured in BENCHMARKS.md (training step, FP8 GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm: every dimension a multiple of 16
MODES = ("auto", "on", "off")
SKIPPED = ("lm_head",)  # module names kept out of FP8 (see the module doc)


def fp8_supported(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device` (None when they can)."""
    if device.type == "cpu":
        return None  # torch's CPU _scaled_mm: correct but slow (tests)
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA or CPU device, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); this GPU is " \
               f"{major}.{minor}"
    return None


def resolve_mode(mode: str, device: torch.device) -> bool:
    """Whether 04 trains with FP8 GEMMs: `auto` = on for CUDA GPUs that have them, off on CPU;
    `on` on a device without them is an error naming the flag."""
    if mode not in MODES:
        raise ValueError(f"--fp8-gemm {mode!r}: expected one of {MODES}")
    if mode == "off":
        return False
    why = fp8_supported(device)
    if mode == "on" and why:
        raise ValueError(f"--fp8-gemm on: {why}; use --fp8-gemm off")
    return why is None and (mode == "on" or device.type == "cuda")


def quantize_rows(t_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]` row-major, fp32 scale `[M, 1]`) with `t ~= q * scale` row by row."""
    t = t_MK.float()
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax, min=1e-12) / E4M3_MAX
    q = torch.clamp(t / scale, -E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()
    return q, scale


def _scaled_mm(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b^T` from high-precision operands, each quantised along K (rows of a and b). The
    GEMM writes bf16 (the one output dtype of rowwise-scaled CUDA kernels), cast to `out_dtype`."""
    qa, sa = quantize_rows(a_MK)
    qb, sb = quantize_rows(b_NK)
    out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of ALIGN (the weight gradient contracts over rows)."""
    extra = -t.shape[0] % ALIGN
    return t if not extra else F.pad(t, (0, 0, 0, extra))


@torch.library.custom_op("eagle3::fp8_mm", mutates_args=())
def fp8_mm(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b^T` in FP8, each operand quantised along K (rows of a and b), as one operator.

    An operator rather than an `autograd.Function`: torch.compile treats it as opaque and takes
    its gradient from `register_autograd` below; it never inlines the forward. A compiled H200
    step with the `autograd.Function` form got no gradient through these layers at all (see
    BENCHMARKS.md, "FP8 GEMMs"), as if the custom backward had been dropped and the
    quantisation, which has no derivative, differentiated instead.
    """
    return _scaled_mm(a_MK, b_NK, out_dtype)


@fp8_mm.register_fake
def _fp8_mm_shape(a_MK, b_NK, out_dtype):
    return a_MK.new_empty((a_MK.shape[0], b_NK.shape[0]), dtype=out_dtype)


def _fp8_mm_save(ctx, inputs, output) -> None:
    a_MK, b_NK, _ = inputs
    ctx.save_for_backward(a_MK, b_NK)  # the high-precision operands: no more than bf16 saves


def _fp8_mm_backward(ctx, g_MN):
    """Both gradients in FP8: `g @ b` (contraction over N) and `g^T @ a` (over M, zero rows
    added to a multiple of 16: they add nothing)."""
    a_MK, b_NK = ctx.saved_tensors
    g_MN = g_MN.contiguous()
    grad_a = fp8_mm(g_MN, b_NK.t(), a_MK.dtype)
    grad_b = fp8_mm(_pad_rows(g_MN).t(), _pad_rows(a_MK).t(), b_NK.dtype)
    return grad_a, grad_b, None


fp8_mm.register_autograd(_fp8_mm_backward, setup_context=_fp8_mm_save)


class Fp8Linear(nn.Linear):
    """`nn.Linear` whose training-mode forward runs fp8_mm (same parameters and state_dict
    keys; eval mode is the plain GEMM)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(
            x.device.type) else x.dtype
        y = fp8_mm(x.reshape(-1, x.shape[-1]).to(dtype), self.weight, dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.view(*x.shape[:-1], y.shape[-1])


def use_fp8_gemms(draft: nn.Module, skip: tuple[str, ...] = SKIPPED) -> list[str]:
    """Convert the draft's linear layers (but `skip`) to Fp8Linear in place; returns their names.

    A layer whose sizes are not multiples of 16 is an error naming it (no silent bf16 path).
    """
    converted = []
    for name, module in draft.named_modules():
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        bad = [d for d in (module.in_features, module.out_features) if d % ALIGN]
        if bad:
            raise ValueError(f"--fp8-gemm: layer {name} is {module.in_features} -> "
                             f"{module.out_features}; FP8 GEMMs need multiples of {ALIGN}: "
                             f"use --fp8-gemm off")
        module.__class__ = Fp8Linear
        converted.append(name)
    return converted
