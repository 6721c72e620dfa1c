"""FP8 recipes (eagle3/train/fp8_scaling.py) and the gradient criterion (eagle3/train/fp8_check.py):
each recipe against a float64 simulation of its own rounding, the criterion on hand-made
gradients, and a tiny 04 run with 1 x t tiles and t x t weight blocks."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import train_helpers as th
from torch import nn

from eagle3.train import fp8 as fp8_module
from eagle3.train.fp8 import Fp8Linear, fp8_matmul, use_fp8_gemms
from eagle3.train.fp8_check import grad_error, judge_gradients
from eagle3.train.fp8_scaling import (
    E4M3,
    E5M2,
    dequantize,
    parse_recipe,
    quantize,
    quantize_blocks,
    simulate_gemm,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def operands(M=48, K=64, N=32, seed=0):
    """x whose columns' magnitudes vary over 6 decades within each row (what one scale per row
    flushes and a scale per tile keeps), w whose rows vary over 4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)[None, :]
    w = torch.randn(N, K, generator=g) * torch.logspace(-2, 2, N)[:, None]
    return x, w


def grads_of(recipe: str, x, w, g):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_matmul(xr, wr, recipe=recipe)
    y.backward(g)
    return y, xr.grad, wr.grad


@pytest.mark.parametrize("recipe", ["block16", "block16.e5m2", "rowwise.e5m2", "block"])
def test_forward_and_both_gradients_equal_the_float64_simulation_of_the_recipe(recipe):
    x, w = operands()
    g = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    y, gx, gw = grads_of(recipe, x, w, g)
    r = parse_recipe(recipe)
    for got, want in ((y, simulate_gemm(x, w, r, True, False)),
                      (gx, simulate_gemm(g, w.t(), r, True, True)),
                      (gw, simulate_gemm(g.t(), x.t(), r, False, True))):
        for row_got, row_want in zip(got, want):  # only the bf16 output rounding apart
            assert rel(row_got, row_want) < 1e-2


def test_tiles_keep_the_small_columns_that_one_scale_per_row_flushes():
    x, w = operands()
    exact = x.double() @ w.double().t()
    small = slice(0, 16)  # x's first 16 columns are 1e-3..1e-2 of a row whose largest is 1e3
    rowwise = dequantize(*quantize(x), 0, torch.float64)
    tiled = dequantize(*quantize(x, 16), 16, torch.float64)
    assert rel(tiled[:, small], x[:, small]) < 0.05 < rel(rowwise[:, small], x[:, small])
    # and the whole product barely notices (the large columns dominate it)
    assert rel(fp8_matmul(x, w, recipe="block16"), exact) < 0.05


def test_weight_blocks_share_one_scale_per_block_read_both_ways():
    _, w = operands(N=32, K=64)
    q, s = quantize_blocks(w, 16)
    assert s.shape == (2, 4) and q.dtype == E4M3
    back = dequantize(q, s, 16, torch.float64)
    assert torch.allclose(back.abs().amax(), w.abs().amax().double(), rtol=1e-6)
    # the transposed weight quantised in blocks is the same fp8 values, transposed
    qt, st = quantize_blocks(w.t(), 16)
    assert torch.equal(qt.float(), q.t().float()) and torch.equal(st, s.t())


def test_e5m2_gradients_round_to_two_mantissa_bits():
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    q4, s4 = quantize(g, 16, E4M3)
    q5, s5 = quantize(g, 16, E5M2)
    assert q5.dtype == E5M2
    err4 = rel(dequantize(q4, s4, 16, torch.float64), g)
    err5 = rel(dequantize(q5, s5, 16, torch.float64), g)
    assert 1.5 < err5 / err4 < 3  # one mantissa bit fewer: about twice the error


def test_a_recipe_with_only_some_gemms_in_fp8_runs_the_others_plain():
    x, w = operands()
    g = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    y, gx, gw = grads_of("rowwise.w", x, w, g)
    torch.testing.assert_close(y, x @ w.t())
    torch.testing.assert_close(gx, g @ w)
    assert rel(gw, simulate_gemm(g.t(), x.t(), parse_recipe("rowwise.w"), False, True)) < 1e-2
    assert rel(gw, g.t() @ x) > 1e-4  # the weight gradient did go through fp8
    y, gx, gw = grads_of("block16.f", x, w, g)
    assert rel(y, x @ w.t()) > 1e-4
    torch.testing.assert_close(gw, g.t() @ x)


def test_recipe_names_parse_and_a_bad_one_names_the_grammar():
    r = parse_recipe("block")
    assert (r.tile, r.grad_dtype, r.gemms) == (128, E4M3, "fiw")
    r = parse_recipe("block32.e5m2.wf")
    assert (r.tile, r.grad_dtype, r.gemms) == (32, E5M2, "fw")
    assert parse_recipe("rowwise").tile == 0
    for bad in ("rowwise16", "blocks", "block.e4m3", "block.x", "block0"):
        with pytest.raises(ValueError, match="rowwise\\|block"):
            parse_recipe(bad)


def test_a_block_of_input_columns_must_start_on_a_tile():
    layer = nn.Linear(64, 32, bias=False)
    use_fp8_gemms(layer, recipe="block16")
    assert isinstance(layer, Fp8Linear) and layer.fp8_emulate  # no tile kernel on CPU
    x = torch.randn(8, 32)
    y = layer.forward_columns(x, 32)
    r = parse_recipe("block16")
    assert rel(y, simulate_gemm(x, layer.weight[:, 32:].detach(), r, True, False)) < 1e-2
    with pytest.raises(ValueError, match="16-wide tile"):
        layer.forward_columns(torch.randn(8, 24), 8)


def test_criterion_passes_gradients_closer_than_the_floor_and_names_the_rest():
    g = torch.Generator().manual_seed(0)
    ref = {"a": torch.randn(100, generator=g), "b": torch.randn(100, generator=g),
           "frozen": torch.zeros(10)}
    noise = {k: torch.randn(v.shape, generator=g) for k, v in ref.items()}
    floor = {k: v + 0.02 * noise[k] for k, v in ref.items()}
    close = {k: v + 0.01 * noise[k] for k, v in ref.items()}  # half the floor's error: 1/4 in 1-cos
    verdict = judge_gradients(close, floor, ref)
    assert verdict.passed and verdict.failing == [] and "frozen" not in verdict.ratio
    assert verdict.ratio["a"] == pytest.approx(0.25, rel=0.05)
    assert verdict.error["a"] == pytest.approx(grad_error(close["a"], ref["a"]))
    far = {**close, "b": ref["b"] + 0.1 * noise["b"]}  # 5x the floor's error: 25x in 1-cos
    verdict = judge_gradients(far, floor, ref)
    assert not verdict.passed and verdict.failing == ["b"]
    assert verdict.worst() == ("b", pytest.approx(25, rel=0.05))
    assert judge_gradients(far, floor, ref, max_ratio=30).passed
    missing = judge_gradients({**close, "a": None}, floor, ref)
    zero = judge_gradients({**close, "a": torch.zeros(100)}, floor, ref)
    assert missing.failing == zero.failing == ["a"] and not missing.passed
    assert missing.error["a"] == float("inf")


def test_grad_error_is_one_minus_the_cosine_in_float64():
    a = torch.tensor([1.0, 0.0])
    assert grad_error(a, a) == 0.0
    assert grad_error(torch.tensor([1.0, 1.0]), a) == pytest.approx(1 - 2 ** -0.5)
    assert grad_error(-a, a) == pytest.approx(2.0)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return th.write_splits(tmp_path_factory.mktemp("fp8recipedata"), 24, 4)


def test_04_trains_with_tiles_and_weight_blocks_like_the_fp32_run(tiny_data, tmp_path,
                                                                  monkeypatch):
    """04's loop with every draft linear but lm_head on the block16 recipe (16 wide: the tiny
    draft's sizes), eager: the loss falls as the fp32 run's does."""
    from eagle3.train import loop

    monkeypatch.setattr(loop, "use_fp8_gemms", partial(use_fp8_gemms, recipe="block16"))
    calls = {"n": 0}
    original = fp8_module._scaled_mm

    def counted(*a):
        calls["n"] += 1
        assert a[5] == 16  # the tile
        return original(*a)

    monkeypatch.setattr(fp8_module, "_scaled_mm", counted)
    fp8, draft = th.run_tiny(tiny_data, tmp_path / "fp8", kv_heads=2, fp8_gemm="on", epochs=3)
    assert fp8["fp8_gemm"] is True and calls["n"] > 0
    assert all(m.fp8_recipe.name == "block16" for m in draft.modules()
               if isinstance(m, Fp8Linear))
    plain, _ = th.run_tiny(tiny_data, tmp_path / "plain", kv_heads=2, fp8_gemm="off", epochs=3)
    start = th.first_eval_loss(tmp_path / "plain")
    assert start - fp8["eval_loss"][0] > 0.9 * (start - plain["eval_loss"][0]) > 0
    assert abs(fp8["eval_loss"][0] - plain["eval_loss"][0]) < 0.01 * plain["eval_loss"][0]


def test_compiled_block_recipe_reads_the_cached_blocks_and_its_gradients_equal_eager():
    draft, _, _ = th.tiny_parts(kv_heads=2)
    use_fp8_gemms(draft, recipe="block16.e5m2")
    mlp = draft.midlayer.mlp
    x = torch.randn(2, 24, mlp.gate_proj.in_features)

    def grads(fn):
        mlp.zero_grad(set_to_none=True)
        fn(x).square().sum().backward()
        return [p.grad.clone() for p in mlp.parameters()]

    eager = grads(mlp)
    compiled = grads(torch.compile(mlp, backend="aot_eager"))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(eager, compiled))
    assert all(bool(g.ne(0).any()) for g in compiled)


def test_kernel_scale_layouts_are_the_ones_scaled_mm_checks_for_deepseek_scaling():
    """What aten's ScaledBlas.cpp (`is_blockwise_1x128_scaling`, `is_blockwise_128x128_scaling`)
    asks of `torch._scaled_mm(a, b)` with b = qb.t(): a's 1x128 scale [M, K/128] strides (1, M);
    a 128x128 scale [M/128, K/128] row-major; b's checked as `scale_b.t()` against b.t() = qb.
    Only the CUDA kernel reads these; this pins the layouts where no Hopper GPU is."""
    from eagle3.train.fp8_scaling import _kernel_scales

    M, K, N = 384, 512, 256
    x, w = torch.randn(M, K), torch.randn(N, K)
    qx, sx = quantize(x, 128)
    qw, sw = quantize_blocks(w, 128)
    sa, sb = _kernel_scales(qx, sx, qw, sw)  # forward: 1x128 activation, 128x128 weight
    assert sa.shape == (M, 4) and sa.stride() == (1, M)
    assert sb.t().shape == (2, 4) and sb.t().stride() == (4, 1)
    qg, sg = quantize(torch.randn(N, K), 128)
    sa, sb = _kernel_scales(qx, sx, qg, sg)  # weight gradient: 1x128 both
    assert sb.t().shape == (N, 4) and sb.t().stride() == (1, N)
    assert torch.equal(sa, sx) and torch.equal(sb.t(), sg)  # the same values, laid out anew
