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
saves (the bf16 input, not its fp8 copy), attention, norms,
the loss and the draft's `lm_head` (its logits feed the soft cross-entropy directly). Eval mode
(04's evaluation, the acceptance estimate) and the exported draft use the plain bf16/fp32
GEMMs: what an engine serves is the same checkpoint in bf16.

Memory: each converted weight keeps two e4m3 copies (2 bytes per weight, 1.9 GB at Kimi-K2.5
draft size), quantised once per optimizer step (Fp8Linear); the bf16 weight copies autocast
would make are not made. Measured peak at T = 4096: 31.9 GiB against 34.8 for bf16.

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


def _scaled_mm(qa_MK: torch.Tensor, sa_M1: torch.Tensor, qb_NK: torch.Tensor, sb_N1: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b^T` from e4m3 operands quantised along K (rows of a and b) and their row scales.
    The GEMM writes bf16 (the one output dtype of rowwise-scaled CUDA kernels), cast to
    `out_dtype`."""
    out = torch._scaled_mm(qa_MK.contiguous(), qb_NK.contiguous().t(), scale_a=sa_M1,
                           scale_b=sb_N1.t(), out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of ALIGN (the weight gradient contracts over rows)."""
    extra = -t.shape[0] % ALIGN
    return t if not extra else F.pad(t, (0, 0, 0, extra))


@torch.library.custom_op("eagle3::fp8_linear", mutates_args=())
def fp8_linear(x_MK: torch.Tensor, qx_MK: torch.Tensor, sx_M1: torch.Tensor, w_NK: torch.Tensor,
               qw_NK: torch.Tensor, sw_N1: torch.Tensor, qwt_KN: torch.Tensor,
               swt_K1: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` in FP8 as one operator: `qx`/`sx` is x quantised along K, `qw`/`sw` w along K
    (the forward GEMM), `qwt`/`swt` w^T along N (the input gradient's GEMM). `x` and `w` are
    here for the backward (the weight gradient quantises x along M) and to route gradients.

    An operator rather than an `autograd.Function`: torch.compile treats it as opaque and takes
    its gradient from `register_autograd` below. A compiled H200 step with the
    `autograd.Function` form got no gradient through these layers at all (BENCHMARKS.md, "FP8
    GEMMs"). The quantisations happen outside it, in traced code, where torch.compile fuses them
    into the neighbouring kernels.
    """
    return _scaled_mm(qx_MK, sx_M1, qw_NK, sw_N1, x_MK.dtype)


@fp8_linear.register_fake
def _fp8_linear_shape(x_MK, qx_MK, sx_M1, w_NK, qw_NK, sw_N1, qwt_KN, swt_K1):
    return x_MK.new_empty((x_MK.shape[0], qw_NK.shape[0]))


def _fp8_linear_save(ctx, inputs, output) -> None:
    x_MK, _, _, w_NK, _, _, qwt_KN, swt_K1 = inputs
    # the bf16 input (as the bf16 path saves) and the weight's cached fp8 copy: no new memory
    ctx.save_for_backward(x_MK, qwt_KN, swt_K1)
    ctx.w_dtype = w_NK.dtype


def _fp8_linear_backward(ctx, g_MN):
    """Both gradients in FP8: `g @ w` (g quantised along N, w^T cached) and `g^T @ x` (both
    quantised along M, zero rows added to a multiple of 16: they add nothing)."""
    x_MK, qwt_KN, swt_K1 = ctx.saved_tensors
    qg, sg = quantize_rows(g_MN)
    grad_x = _scaled_mm(qg, sg, qwt_KN, swt_K1, x_MK.dtype)
    qgt, sgt = quantize_rows(_pad_rows(g_MN).t())
    qxt, sxt = quantize_rows(_pad_rows(x_MK).t())
    grad_w = _scaled_mm(qgt, sgt, qxt, sxt, ctx.w_dtype)
    return grad_x, None, None, grad_w, None, None, None, None


fp8_linear.register_autograd(_fp8_linear_backward, setup_context=_fp8_linear_save)


_quantize_weight_compiled = None


def _quantize_weight(w: torch.Tensor) -> tuple:
    """quantize_rows of w and of w^T; compiled on CUDA (one fused kernel each, eager caller)."""
    global _quantize_weight_compiled
    fn = quantize_rows
    if w.device.type == "cuda":
        if _quantize_weight_compiled is None:
            _quantize_weight_compiled = torch.compile(quantize_rows, dynamic=True)
        fn = _quantize_weight_compiled
    return (*fn(w), *fn(w.t()))


def _fp8_columns(x_MK: torch.Tensor, w_NK: torch.Tensor, copies: tuple,
                 start: int) -> torch.Tensor:
    """`x @ w[:, start:start + K]^T` (K = x's width) from the whole weight's e4m3 `copies`
    (qw, sw, qwt, swt): qw's rows cut to the block keep their whole-row scales (never below the
    block's amax, so nothing saturates); the rows of qwt are the block's columns, each with its
    own scale, exactly what the input gradient needs."""
    qw, sw, qwt, swt = copies
    K = x_MK.shape[-1]
    if K != w_NK.shape[1]:
        w_NK = w_NK[:, start:start + K]
        qw, qwt, swt = qw[:, start:start + K], qwt[start:start + K], swt[start:start + K]
    qx, sx = quantize_rows(x_MK.detach())  # traced when compiling: fused with its producer
    return fp8_linear(x_MK, qx, sx, w_NK, qw, sw, qwt, swt)


def fp8_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, start: int = 0) -> torch.Tensor:
    """`x @ w[:, start:start + K]^T` in FP8 with both operands quantised here: Fp8Linear's eager
    forward (a compiled one reads the weight's cached copies instead; the same values)."""
    with torch.no_grad():
        copies = _quantize_weight(w_NK.detach())
    return _fp8_columns(x_MK, w_NK, copies, start)


class Fp8Linear(nn.Linear):
    """`nn.Linear` whose training-mode forward runs fp8_linear (same parameters and state_dict
    keys; eval mode is the plain GEMM).

    A compiled forward reads the weight's two e4m3 copies (along K for the forward, along N for
    the input gradient) from non-persistent buffers, quantised once per optimizer step rather
    than once per TTT step and GEMM. It cannot tell when the weight changed, so whoever updates
    the weight calls `refresh_fp8_weights(model)` before the next compiled forward
    (04's loop does, at each step's first micro-step; so does the GPU benchmark). The version
    counter is no signal for this: the fused AdamW that 04 runs on CUDA updates the weights in
    place without bumping it (tests/train/test_fp8.py). An eager forward quantises the weight
    afresh at every call and cannot go stale.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        y = self.forward_columns(x, 0)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward_columns(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """`x @ W[:, start:start + k]^T` for `x` k wide, in FP8 in training mode (the plain GEMM
        in eval mode): the whole weight for k = in_features, or one block of input columns, as
        the shared TTT unroll computes the halves of the attention's input projections
        (eagle3/draft/model.py `linear_columns`; scales: `_fp8_columns`)."""
        k = x.shape[-1]
        if not self.training:
            return F.linear(x, self.weight[:, start:start + k])
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(
            x.device.type) else x.dtype
        x_MK = x.reshape(-1, k).to(dtype)
        if torch.compiler.is_compiling():
            copies = (self.fp8_w, self.fp8_w_scale, self.fp8_wt, self.fp8_wt_scale)
            y = _fp8_columns(x_MK, self.weight, copies, start)
        else:
            y = fp8_matmul(x_MK, self.weight, start)
        return y.view(*x.shape[:-1], y.shape[-1])

    def attach(self) -> None:
        N, K = self.weight.shape
        dev = self.weight.device
        for name, shape in (("fp8_w", (N, K)), ("fp8_wt", (K, N))):
            self.register_buffer(name, torch.empty(shape, dtype=E4M3, device=dev),
                                 persistent=False)
            self.register_buffer(name + "_scale", torch.empty((shape[0], 1), device=dev),
                                 persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantise the weight into the buffers the compiled forward reads."""
        for buf, new in zip((self.fp8_w, self.fp8_w_scale, self.fp8_wt, self.fp8_wt_scale),
                            _quantize_weight(self.weight.detach())):
            buf.copy_(new)  # in place: a compiled graph keeps reading the same buffers


def refresh_fp8_weights(model: nn.Module) -> int:
    """Quantise the weights of `model`'s Fp8Linear layers again (after every optimizer step or
    load, before the next compiled training forward); returns how many layers there are."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.refresh()
    return len(layers)


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
        module.attach()
        converted.append(name)
    return converted
