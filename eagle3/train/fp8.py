"""FP8 GEMMs for training the draft: the draft's linear layers in float8 (per-row or tile scales).

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

That is the `rowwise` recipe. Other recipes (eagle3/train/fp8_scaling.py: 1 x 128 tiles for
activations and gradients with 128 x 128 weight blocks, e5m2 gradients, FP8 in only some of the
three GEMMs) go through the same operator; `use_fp8_gemms(draft, recipe)` picks one.

The fp8 path equals a float64 simulation of the same quantisation (tests/train/test_fp8.py); how
far it moves the gradient is judged by eagle3/train/fp8_check.py; what it costs in loss and
acceptance is measured in BENCHMARKS.md (training step, FP8 GEMMs).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.train.fp8_scaling import (
    E4M3,
    Fp8Recipe,
    block_kernel_error,
    parse_recipe,
    quantize,
    quantize_blocks,
    scaled_gemm,
)

log = logging.getLogger(__name__)

E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm: every dimension a multiple of 16
MODES = ("auto", "on", "off")
SKIPPED = ("lm_head",)  # module names kept out of FP8 (see the module doc)
ROWWISE = "rowwise"  # the recipe `--fp8-gemm on` trains with


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
    """Whether 04 trains with FP8 GEMMs. `auto` = what 04 recommends: off on every device, since
    the recipe `on` trains with fails the gradient criterion (eagle3/train/fp8_check.py) by ~25x
    on the H200 and the one recipe that passes it is no faster than bf16 (BENCHMARKS.md, "FP8
    GEMMs in training"); `on` forces it (experimental), and on a device without FP8 GEMMs is an error naming
    the flag."""
    if mode not in MODES:
        raise ValueError(f"--fp8-gemm {mode!r}: expected one of {MODES}")
    if mode != "on":
        return False
    why = fp8_supported(device)
    if why:
        raise ValueError(f"--fp8-gemm on: {why}; use --fp8-gemm off")
    return True


def quantize_rows(t_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]` row-major, fp32 scale `[M, 1]`) with `t ~= q * scale` row by row."""
    return quantize(t_MK, 0, E4M3)


def _scaled_mm(qa_MK: torch.Tensor, sa: torch.Tensor, qb_NK: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype, tile: int = 0, emulate: bool = False) -> torch.Tensor:
    """`a @ b^T` from fp8 operands quantised along K (rows of a and b) and their scales (per
    row, or per tile/block for `tile` > 0: fp8_scaling.scaled_gemm). The GEMM writes bf16 (the
    one output dtype of rowwise-scaled CUDA kernels), cast to `out_dtype`."""
    return scaled_gemm(qa_MK.contiguous(), sa, qb_NK.contiguous(), sb, tile, emulate).to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int = ALIGN) -> torch.Tensor:
    """Zero rows up to a multiple of `multiple` (the weight gradient contracts over rows)."""
    extra = -t.shape[0] % multiple
    return t if not extra else F.pad(t, (0, 0, 0, extra))


@torch.library.custom_op("eagle3::fp8_linear", mutates_args=())
def fp8_linear(x_MK: torch.Tensor, qx_MK: torch.Tensor, sx: torch.Tensor, w_NK: torch.Tensor,
               qw_NK: torch.Tensor, sw: torch.Tensor, qwt_KN: torch.Tensor,
               swt: torch.Tensor, recipe: str, emulate: bool) -> torch.Tensor:
    """`x @ w^T` in FP8 as one operator: `qx`/`sx` is x quantised along K, `qw`/`sw` w along K
    (the forward GEMM), `qwt`/`swt` w^T along N (the input gradient's GEMM), all as `recipe`
    says (fp8_scaling.parse_recipe; a GEMM it keeps out of FP8 runs plain in x's dtype, its
    quantised operands unused). `x` and `w` are here for the backward (the weight gradient
    quantises x along M) and to route gradients. `emulate`: tile/block scales without the kernel.

    An operator rather than an `autograd.Function`: torch.compile treats it as opaque and takes
    its gradient from `register_autograd` below. A compiled H200 step with the
    `autograd.Function` form got no gradient through these layers at all. The quantisations
    happen outside it, in traced code, where torch.compile fuses them into the neighbouring
    kernels.
    """
    r = parse_recipe(recipe)
    if not r.fp8("f"):
        return x_MK @ w_NK.to(x_MK.dtype).t()
    return _scaled_mm(qx_MK, sx, qw_NK, sw, x_MK.dtype, r.tile, emulate)


@fp8_linear.register_fake
def _fp8_linear_shape(x_MK, qx_MK, sx, w_NK, qw_NK, sw, qwt_KN, swt, recipe, emulate):
    return x_MK.new_empty((x_MK.shape[0], w_NK.shape[0]))


def _fp8_linear_save(ctx, inputs, output) -> None:
    x_MK, _, _, w_NK, _, _, qwt_KN, swt, recipe, emulate = inputs
    # the bf16 input (as the bf16 path saves), the weight and its cached fp8 copy: no new memory
    ctx.save_for_backward(x_MK, w_NK, qwt_KN, swt)
    ctx.w_dtype, ctx.recipe, ctx.emulate = w_NK.dtype, recipe, emulate


def _fp8_linear_backward(ctx, g_MN):
    """Both gradients as the recipe says: `g @ w` (g quantised along N, w^T cached) and
    `g^T @ x` (both quantised along M, zero rows added to a multiple of 16 or of the tile: they
    add nothing); g in the recipe's gradient type."""
    x_MK, w_NK, qwt_KN, swt = ctx.saved_tensors
    r = parse_recipe(ctx.recipe)
    if r.fp8("i"):
        qg, sg = quantize(g_MN, r.tile, r.grad_dtype)
        grad_x = _scaled_mm(qg, sg, qwt_KN, swt, x_MK.dtype, r.tile, ctx.emulate)
    else:
        grad_x = (g_MN @ w_NK.to(g_MN.dtype)).to(x_MK.dtype)
    if r.fp8("w"):
        rows = max(ALIGN, r.tile)
        qgt, sgt = quantize(_pad_rows(g_MN, rows).t(), r.tile, r.grad_dtype)
        qxt, sxt = quantize(_pad_rows(x_MK, rows).t(), r.tile)
        grad_w = _scaled_mm(qgt, sgt, qxt, sxt, ctx.w_dtype, r.tile, ctx.emulate)
    else:
        grad_w = (g_MN.t() @ x_MK.to(g_MN.dtype)).to(ctx.w_dtype)
    return grad_x, None, None, grad_w, None, None, None, None, None, None


fp8_linear.register_autograd(_fp8_linear_backward, setup_context=_fp8_linear_save)


def weight_copies(w_NK: torch.Tensor, tile: int) -> tuple:
    """(qw, sw, qwt, swt): the weight along K for the forward and along N for the input
    gradient; per row (tile 0), or one set of tile x tile blocks read both ways."""
    if tile:
        q, s = quantize_blocks(w_NK, tile)
        return q, s, q.t().contiguous(), s.t().contiguous()
    return (*quantize(w_NK), *quantize(w_NK.t()))


_weight_copies_compiled = None


def _quantize_weight(w: torch.Tensor, tile: int = 0) -> tuple:
    """weight_copies; compiled on CUDA (fused kernels, eager caller)."""
    global _weight_copies_compiled
    fn = weight_copies
    if w.device.type == "cuda":
        if _weight_copies_compiled is None:
            _weight_copies_compiled = torch.compile(weight_copies, dynamic=True)
        fn = _weight_copies_compiled
    return fn(w, tile)


def _fp8_columns(x_MK: torch.Tensor, w_NK: torch.Tensor, copies: tuple, start: int,
                 recipe: Fp8Recipe, emulate: bool) -> torch.Tensor:
    """`x @ w[:, start:start + K]^T` (K = x's width) from the whole weight's fp8 `copies`
    (qw, sw, qwt, swt). Rowwise: qw's rows cut to the block keep their whole-row scales (never
    below the block's amax, so nothing saturates); the rows of qwt are the block's columns, each
    with its own scale, exactly what the input gradient needs. Tile/block recipes: the block
    starts on a tile boundary and keeps its weight blocks' scales."""
    qw, sw, qwt, swt = copies
    tile = recipe.tile
    K = x_MK.shape[-1]
    if K != w_NK.shape[1]:
        w_NK = w_NK[:, start:start + K]
        qw, qwt = qw[:, start:start + K], qwt[start:start + K]
        if tile:
            if start % tile:
                raise ValueError(f"FP8 recipe {recipe.name}: input columns from {start} do not "
                                 f"start on a {tile}-wide tile; use --fp8-gemm on (rowwise)")
            sw, swt = sw[:, start // tile:-(-(start + K) // tile)], \
                swt[start // tile:-(-(start + K) // tile)]
        else:
            swt = swt[start:start + K]
    if recipe.fp8("f"):  # traced when compiling: fused with its producer
        qx, sx = quantize(x_MK.detach(), tile)
    else:
        qx = sx = x_MK.new_empty(0)
    return fp8_linear(x_MK, qx, sx, w_NK, qw, sw, qwt, swt, recipe.name, emulate)


def fp8_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, start: int = 0,
               recipe: str | Fp8Recipe = ROWWISE, emulate: bool | None = None) -> torch.Tensor:
    """`x @ w[:, start:start + K]^T` in FP8 with both operands quantised here: Fp8Linear's eager
    forward (a compiled one reads the weight's cached copies instead; the same values).
    `emulate` None: tile/block scales are emulated off CUDA."""
    emulate = x_MK.device.type != "cuda" if emulate is None else emulate
    r = parse_recipe(recipe) if isinstance(recipe, str) else recipe
    with torch.no_grad():
        copies = _quantize_weight(w_NK.detach(), r.tile)
    return _fp8_columns(x_MK, w_NK, copies, start, r, emulate)


class Fp8Linear(nn.Linear):
    """`nn.Linear` whose training-mode forward runs fp8_linear (same parameters and state_dict
    keys; eval mode is the plain GEMM), with the recipe set by `attach`.

    A compiled forward reads the weight's two fp8 copies (along K for the forward, along N for
    the input gradient) from non-persistent buffers, quantised once per optimizer step rather
    than once per TTT step and GEMM. It cannot tell when the weight changed, so whoever updates
    the weight calls `refresh_fp8_weights(model)` before the next compiled forward
    (04's loop does, at each step's first micro-step; so does the GPU benchmark). The version
    counter is no signal for this: the fused AdamW that 04 runs on CUDA updates the weights in
    place without bumping it (tests/train/test_fp8.py). An eager forward quantises the weight
    afresh at every call and cannot go stale.
    """

    fp8_recipe: Fp8Recipe = parse_recipe(ROWWISE)
    fp8_emulate: bool = False  # tile/block scales through the fp32 emulation (no kernel)

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
            y = _fp8_columns(x_MK, self.weight, copies, start, self.fp8_recipe, self.fp8_emulate)
        else:
            y = fp8_matmul(x_MK, self.weight, start, self.fp8_recipe, self.fp8_emulate)
        return y.view(*x.shape[:-1], y.shape[-1])

    def attach(self, recipe: str = ROWWISE, emulate: bool = False) -> None:
        self.fp8_recipe, self.fp8_emulate = parse_recipe(recipe), emulate
        copies = _quantize_weight(self.weight.detach(), self.fp8_recipe.tile)
        for name, t in zip(("fp8_w", "fp8_w_scale", "fp8_wt", "fp8_wt_scale"), copies):
            self.register_buffer(name, torch.empty_like(t), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantise the weight into the buffers the compiled forward reads."""
        copies = _quantize_weight(self.weight.detach(), self.fp8_recipe.tile)
        for buf, new in zip((self.fp8_w, self.fp8_w_scale, self.fp8_wt, self.fp8_wt_scale),
                            copies):
            buf.copy_(new)  # in place: a compiled graph keeps reading the same buffers


def refresh_fp8_weights(model: nn.Module) -> int:
    """Quantise the weights of `model`'s Fp8Linear layers again (after every optimizer step or
    load, before the next compiled training forward); returns how many layers there are."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.refresh()
    return len(layers)


def _needs_emulation(recipe: str, device: torch.device) -> bool:
    """Whether `recipe`'s GEMMs run emulated on `device` (tile/block scales without a kernel);
    on a GPU that is a fallback, logged (numerically the same GEMM, slower than bf16)."""
    if not parse_recipe(recipe).tile:
        return False
    why = block_kernel_error(device)
    if why and device.type == "cuda":
        log.warning("FP8 recipe %s: %s; its GEMMs run emulated (dequantised, fp32 GEMM): the "
                    "same numbers, slower than bf16", recipe, why)
    return why is not None


def use_fp8_gemms(draft: nn.Module, skip: tuple[str, ...] = SKIPPED,
                  recipe: str = ROWWISE) -> list[str]:
    """Convert the draft's linear layers (but `skip`) to Fp8Linear in place with `recipe`
    (eagle3/train/fp8_scaling.py); returns their names.

    A layer whose sizes are not multiples of 16 (of the tile, for a tile/block recipe on its
    kernel) is an error naming it (no silent bf16 path).
    """
    tile = parse_recipe(recipe).tile
    weights = [p for p in draft.parameters()]
    emulate = bool(weights) and _needs_emulation(recipe, weights[0].device)
    align = ALIGN if emulate or not tile else max(ALIGN, tile)
    converted = []
    for name, module in draft.named_modules():
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        bad = [d for d in (module.in_features, module.out_features) if d % align]
        if bad:
            raise ValueError(f"--fp8-gemm: layer {name} is {module.in_features} -> "
                             f"{module.out_features}; FP8 GEMMs ({recipe}) need multiples of "
                             f"{align}: use --fp8-gemm off")
        module.__class__ = Fp8Linear
        module.attach(recipe, emulate)
        converted.append(name)
    return converted
