"""Per-token scaled float8 e4m3: the one quantizer of the fp8 layouts (docs/formats.md).

Stage 02b's files (`eagle3/core/hidden_states.py`) and the SGLang dump hook's fp8 layout
(`eagle3/extract/sglang_dump.py`, `EAGLE3_DUMP_LAYOUT=fp8`) both quantize through this module,
so that an fp8 dump converted by 02b and a bf16 dump quantized by 02b give the same bytes.
Pure torch, importing nothing from eagle3: the dump hook runs inside SGLang, where it loads this
file by path.

Each row is scaled on its own: scale = max |x| / 448 (clamped to 1e-12), value = fp8 * scale.
A row's bits depend on that row alone, so the result does not depend on how rows are grouped
(`block_rows`, a whole pass or one request's chunk) nor on the device that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


@dataclass(frozen=True)
class Fp8Rows:
    """A `[T, H]` state already quantized: e4m3 `values_TH` and float32 per-token `scale_T`."""

    values_TH: torch.Tensor
    scale_T: torch.Tensor


def quantize_fp8(x_TH: torch.Tensor, block_rows: int = 64,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scaled float8 e4m3 of a `[T, H]` tensor: (fp8 `[T, H]`, float32 scale `[T]`).

    Works through `block_rows` rows at a time, so the float32 temporaries stay in cache on a CPU
    (a third faster than whole-tensor ops, same bits) and bounded on a GPU. `out`: the two
    tensors to fill instead of new ones; for a contiguous 16-bit `x_TH` the fp8 one may be the
    first half of `x_TH`'s own memory (`in_place_fp8`): each block is read whole before its rows
    are written, and output row i ends before input row i+1 begins.
    """
    if out is None:
        out = (torch.empty(x_TH.shape, dtype=torch.float8_e4m3fn, device=x_TH.device),
               torch.empty(x_TH.shape[0], dtype=torch.float32, device=x_TH.device))
    fp8_TH, scale_T = out
    assert fp8_TH.shape == x_TH.shape and scale_T.shape == x_TH.shape[:1], (
        tuple(fp8_TH.shape), tuple(scale_T.shape), tuple(x_TH.shape))
    # A tensor, not a Python number: CUDA divides by a scalar as a product with its float32
    # reciprocal, one ulp off the CPU's division in half of all rows; tensor by tensor, both
    # devices divide exactly
    fp8_max = torch.full((1,), FP8_MAX, dtype=torch.float32, device=x_TH.device)
    for start in range(0, x_TH.shape[0], block_rows):
        x = x_TH[start:start + block_rows].float()
        s = (x.abs().amax(dim=-1) / fp8_max).clamp(min=1e-12)
        scale_T[start:start + block_rows] = s
        fp8_TH[start:start + block_rows] = x.div_(s[:, None]).to(torch.float8_e4m3fn)
    return fp8_TH, scale_T


def quantize_captures(aux_TW: torch.Tensor, num_captures: int, block_rows: int = 64,
                      in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K captures side by side, `[T, K*H]`, each row of each capture on its own:
    (fp8 `[T, K*H]`, float32 scale `[T, K]`). Column block k of the result and `scale[:, k]` are
    bit for bit `quantize_fp8` of capture k alone. `in_place`: the fp8 result overwrites the
    first half of a contiguous 16-bit `aux_TW` (`in_place_fp8`), which is spent afterwards; the
    same bits, and no [T, K*H] allocation (the dump writer's rows, which it owns)."""
    T, width = aux_TW.shape
    hidden = width // num_captures
    assert hidden * num_captures == width, (tuple(aux_TW.shape), num_captures)
    rows = aux_TW.reshape(T * num_captures, hidden)  # row t*K + k: token t, capture k
    out = None
    if in_place:
        out = (in_place_fp8(rows), torch.empty(T * num_captures, dtype=torch.float32,
                                               device=aux_TW.device))
    fp8, scale = quantize_fp8(rows, block_rows, out)
    return fp8.view(T, width), scale.view(T, num_captures)


def in_place_fp8(x_TH: torch.Tensor) -> torch.Tensor:
    """An fp8 `[T, H]` view of the first half of a contiguous 16-bit `x_TH`'s memory."""
    assert x_TH.is_contiguous() and x_TH.element_size() == 2, (x_TH.dtype, x_TH.stride())
    return x_TH.view(-1).view(torch.uint8)[:x_TH.numel()].view(torch.float8_e4m3fn).view(
        x_TH.shape)


def gpu_block_rows(hidden: int, temp_bytes: int = 32 << 20) -> int:
    """Rows per block that keep the float32 temporaries of `quantize_fp8` near `temp_bytes`
    (on a GPU, where a block is a few kernel launches: fewer, larger blocks)."""
    return max(64, temp_bytes // (4 * hidden))
