"""FP8 scaling recipes: how an FP8 GEMM's operands are quantised and multiplied.

Shapes: `M` rows of the result (tokens for the forward), `N` its columns, `K` the contraction.
Every operand is quantised along K, the dimension its GEMM sums over; a scale is the largest
magnitude it covers divided by the fp8 type's largest value, so nothing saturates.

A recipe is named `<scaling>[.e5m2][.<gemms>]` (parse_recipe):
- scaling `rowwise`: one scale per row of each operand along K (the first FP8 mode);
  `block`: 1 x 128 tiles along K for activations and gradients, 128 x 128 blocks for the
  weights (DeepSeek-V3's FP8 training, arXiv 2412.19437 section 3.3); `block<t>`: tiles of t.
- `.e5m2`: the output gradient in e5m2 (more range, 2 mantissa bits) instead of e4m3.
- `.<gemms>`: which GEMMs run in FP8, letters of `fiw` (forward, input gradient, weight
  gradient; default all three); the others run plain in the activation dtype.

The GEMM (`scaled_gemm`): `torch._scaled_mm` for row scales (CUDA and CPU); for tile/block
scales the CUDA kernel where torch has it (Hopper: DeepSeek-style 1x128 / 128x128 scales), else
an emulation that dequantises both operands and multiplies in fp32 (CPU; a GPU without the
kernel, logged by the caller). Both write bf16, as the kernels do.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
GEMMS = "fiw"  # forward, input gradient, weight gradient
BLOCK = 128  # DeepSeek-V3's tile and block size
_NAME = re.compile(r"(rowwise|block)(\d*)(\.e5m2)?(?:\.([fiw]+))?")


@dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 layer quantises the operands of its three GEMMs."""

    name: str
    tile: int  # 0 = one scale per row along K; t = 1 x t tiles (activations, gradients), t x t
    # blocks (weights)
    grad_dtype: torch.dtype  # the output gradient's fp8 type (E4M3 or E5M2)
    gemms: str  # the GEMMs that run in FP8: letters of GEMMS

    def fp8(self, gemm: str) -> bool:
        return gemm in self.gemms


@functools.lru_cache(maxsize=None)
def parse_recipe(name: str) -> Fp8Recipe:
    """The recipe called `name` (module doc); a ValueError names the grammar."""
    m = _NAME.fullmatch(name)
    if not m or (m.group(1) == "rowwise" and m.group(2)) or m.group(2) == "0":
        raise ValueError(f"FP8 recipe {name!r}: expected <rowwise|block[<tile>]>[.e5m2]"
                         f"[.<letters of {GEMMS}>], e.g. block, block.e5m2, rowwise.fw")
    tile = 0 if m.group(1) == "rowwise" else int(m.group(2) or BLOCK)
    gemms = "".join(g for g in GEMMS if g in (m.group(4) or GEMMS))
    return Fp8Recipe(name, tile, E5M2 if m.group(3) else E4M3, gemms)


def quantize(t_MK: torch.Tensor, tile: int = 0,
             dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 `[M, K]` row-major, fp32 scale) with `t ~= q * scale`: scale `[M, 1]` per row
    (tile 0) or `[M, ceil(K / tile)]` per 1 x tile tile."""
    t = t_MK.float()
    M, K = t.shape
    if tile:
        pad = -K % tile
        tiles = torch.nn.functional.pad(t, (0, pad)).view(M, -1, tile)
        amax = tiles.abs().amax(dim=-1)
        scale = torch.clamp(amax, min=1e-12) / FP8_MAX[dtype]
        q = (tiles / scale[..., None]).view(M, -1)[:, :K]
    else:
        amax = t.abs().amax(dim=-1, keepdim=True)
        scale = torch.clamp(amax, min=1e-12) / FP8_MAX[dtype]
        q = t / scale
    q = torch.clamp(q, -FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).contiguous()
    return q, scale


def quantize_blocks(w_NK: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[N, K]`, fp32 scale `[ceil(N / tile), ceil(K / tile)]`): one scale per
    tile x tile block of the weight."""
    w = w_NK.float()
    N, K = w.shape
    padded = torch.nn.functional.pad(w, (0, -K % tile, 0, -N % tile))
    blocks = padded.view(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile)
    scale = torch.clamp(blocks.abs().amax(dim=(1, 3)), min=1e-12) / FP8_MAX[E4M3]
    q = (blocks / scale[:, None, :, None]).view(padded.shape)[:N, :K]
    return torch.clamp(q, -FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3).contiguous(), scale


def dequantize(q_MK: torch.Tensor, scale: torch.Tensor, tile: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` in `dtype` with `scale` per row, per 1 x tile tile or per tile x tile block
    (float64: exact)."""
    M, K = q_MK.shape
    rows = 1 if scale.shape[0] == M else tile
    cols = K if scale.shape[1] == 1 else tile
    full = scale.to(dtype).repeat_interleave(rows, 0)[:M].repeat_interleave(cols, 1)[:, :K]
    return q_MK.to(dtype) * full


def _is_block(scale: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `scale` is per tile x tile block (not per row or per 1 x tile tile)."""
    return scale.shape[0] != q.shape[0]


def _kernel_scales(qa, sa, qb, sb) -> tuple[torch.Tensor, torch.Tensor]:
    """The layouts `torch._scaled_mm` reads DeepSeek-style scales in (aten ScaledBlas.cpp,
    `is_blockwise_1x128_scaling` / `is_blockwise_128x128_scaling`; `b` enters as `qb.t()`):
    1 x 128 tiles outer-dim-major, 128 x 128 blocks row-major."""
    sa_k = sa.contiguous() if _is_block(sa, qa) else sa.t().contiguous().t()
    sb_k = sb.contiguous().t() if _is_block(sb, qb) else sb.t().contiguous()
    return sa_k, sb_k


def scaled_gemm(qa_MK: torch.Tensor, sa: torch.Tensor, qb_NK: torch.Tensor, sb: torch.Tensor,
                tile: int, emulate: bool) -> torch.Tensor:
    """bf16 `a @ b^T` from fp8 operands quantised along K with their scales (per row, tile or
    block; `tile` 0 for row scales): the kernel, or the fp32 emulation when `emulate` (the
    emulation rounds its result to bf16, as the kernel writes it)."""
    if not tile:
        return torch._scaled_mm(qa_MK, qb_NK.t(), scale_a=sa, scale_b=sb.t(),
                                out_dtype=torch.bfloat16)
    if emulate:
        a, b = dequantize(qa_MK, sa, tile), dequantize(qb_NK, sb, tile)
        return (a @ b.t()).to(torch.bfloat16)
    sa_k, sb_k = _kernel_scales(qa_MK, sa, qb_NK, sb)
    return torch._scaled_mm(qa_MK, qb_NK.t(), scale_a=sa_k, scale_b=sb_k,
                            out_dtype=torch.bfloat16)


def block_kernel_error(device: torch.device) -> str | None:
    """Why `torch._scaled_mm` cannot run tile/block scales on `device` (None when it can):
    one 256 x 256 x 256 GEMM of each pairing the layers use, checked against the emulation."""
    if device.type != "cuda":
        return f"no tile/block-scaled FP8 kernel on {device.type} (torch has it on Hopper)"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 256, device=device, generator=g)
    w = torch.randn(256, 256, device=device, generator=g)
    pairs = ((quantize(x, BLOCK), quantize_blocks(w, BLOCK)),  # forward, input gradient
             (quantize(x, BLOCK), quantize(w, BLOCK)))  # weight gradient
    try:
        for (qa, sa), (qb, sb) in pairs:
            got = scaled_gemm(qa, sa, qb, sb, BLOCK, emulate=False).float()
            want = scaled_gemm(qa, sa, qb, sb, BLOCK, emulate=True).float()
            err = float((got - want).norm() / want.norm())
            if err > 1e-2:
                return f"torch._scaled_mm with 1x128/128x128 scales is off by {err:.1e}"
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"torch._scaled_mm refuses 1x128/128x128 scales: {str(e).splitlines()[0]}"
    return None


def simulate_gemm(a_MK: torch.Tensor, b_NK: torch.Tensor, recipe: Fp8Recipe, b_is_weight: bool,
                  a_is_grad: bool) -> torch.Tensor:
    """float64 `a @ b^T` from both operands rounded as `recipe` rounds them (tests and the
    benchmark's one-layer check): `a` a gradient (the recipe's gradient type) or not, `b` a
    weight (blocks) or an activation (tiles)."""
    tile = recipe.tile
    qa, sa = quantize(a_MK, tile, recipe.grad_dtype if a_is_grad else E4M3)
    qb, sb = quantize_blocks(b_NK, tile) if b_is_weight and tile else quantize(b_NK, tile)
    return (dequantize(qa, sa, tile, torch.float64)
            @ dequantize(qb, sb, tile, torch.float64).t())
