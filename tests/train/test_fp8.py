"""FP8 GEMMs in training (eagle3/train/fp8.py): the arithmetic against a float64 simulation, the
layer conversion, the flag, and a tiny 04 run with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_helpers as th
from torch import nn

from eagle3.train import fp8 as fp8_module
from eagle3.train.fp8 import (
    E4M3,
    Fp8Linear,
    fp8_matmul,
    quantize_rows,
    refresh_fp8_weights,
    resolve_mode,
    use_fp8_gemms,
)


def deq(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to e4m3 with one scale per row, back in float64."""
    t = t.double()
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).to(E4M3).double() * scale


def simulated(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """`a @ b^T` in float64 from each operand rounded to e4m3 with one scale per row."""
    return deq(a_MK) @ deq(b_NK).t()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def operands(M=40, K=64, N=48):
    g = torch.Generator().manual_seed(0)
    # rows of x and w of very different magnitudes: only a scale per row keeps them all
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M)[:, None]
    w = torch.randn(N, K, generator=g) * torch.logspace(-2, 2, N)[:, None]
    return x, w


def test_forward_and_both_gradients_equal_the_float64_simulation_of_rowwise_e4m3():
    x, w = operands()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_matmul(xr, wr)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(g)
    # each result against the same rounding done in float64 (only bf16 output rounding apart),
    # row by row: a scale shared across rows would lose the small rows entirely
    for got, want in ((y, simulated(x, w)), (xr.grad, simulated(g, w.t())),
                      (wr.grad, simulated(g.t(), x.t()))):
        for row_got, row_want in zip(got, want):
            assert rel(row_got, row_want) < 1e-2
    # and the rounding is real: e4m3 keeps 3 mantissa bits
    assert 1e-3 < rel(y, x.double() @ w.double().t()) < 0.08


def test_a_block_of_input_columns_keeps_whole_row_scales_and_its_gradients_reach_the_block():
    # the shared TTT unroll's halves of an input projection: W[:, :K/2] and W[:, K/2:]
    x, w = operands(K=64)
    layer = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    use_fp8_gemms(nn.Sequential(layer))
    g = torch.randn(40, 48, generator=torch.Generator().manual_seed(2))
    w_deq = deq(w)  # the whole rows' scales
    for start in (0, 32):
        layer.zero_grad(set_to_none=True)
        xb = x[:, start:start + 32].clone().requires_grad_()
        y = layer.forward_columns(xb, start)
        y.backward(g)
        block = w[:, start:start + 32]
        want = deq(xb.detach()) @ w_deq[:, start:start + 32].t()
        assert rel(y, want) < 1e-2
        # a block's own scales would round it differently where its amax is below the row's
        assert rel(simulated(xb, block), want) > 1e-4
        assert rel(xb.grad, simulated(g, block.t())) < 1e-2
        grad = layer.weight.grad
        assert rel(grad[:, start:start + 32], simulated(g.t(), xb.detach().t())) < 1e-2
        assert grad[:, :start].abs().sum() == 0 and grad[:, start + 32:].abs().sum() == 0
    layer.eval()  # eval mode: the plain GEMM of the block
    torch.testing.assert_close(layer.forward_columns(x[:, 32:], 32), x[:, 32:] @ w[:, 32:].t())


def test_compiled_step_keeps_the_fp8_operator_whole_and_its_gradients_equal_eager():
    """torch.compile must call the operator (and its registered backward), never inline it."""
    draft, _, _ = th.tiny_parts(kv_heads=2)
    use_fp8_gemms(draft)
    mlp = draft.midlayer.mlp
    x = torch.randn(2, 24, mlp.gate_proj.in_features)
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward  # run the captured graph as it is

    def grads(fn):
        mlp.zero_grad(set_to_none=True)
        fn(x).square().sum().backward()
        return [p.grad.clone() for p in mlp.parameters()]

    eager = grads(mlp)
    compiled = grads(torch.compile(mlp, backend=backend))
    assert any("eagle3.fp8_linear" in t for t in seen), seen
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(eager, compiled))
    aot = grads(torch.compile(mlp, backend="aot_eager"))  # the joint graph AOTAutograd builds
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(eager, aot))
    assert all(bool(g.ne(0).any()) for g in aot)


def test_fused_adamw_updates_weights_without_moving_their_version_counter():
    """Why the weight copies are refreshed by the trainer and not on a version change: the
    fused AdamW 04 runs on CUDA leaves `_version` where it was (the same on CPU)."""
    p = nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad, before, version = torch.randn(4, 4), p.detach().clone(), p._version
    opt.step()
    assert not torch.equal(p.detach(), before) and p._version == version


def test_refresh_requantises_the_weight_copies_the_compiled_forward_reads():
    torch.manual_seed(0)
    layer = nn.Linear(32, 48, bias=False)
    use_fp8_gemms(layer)  # a bare Linear converts too (its name is "")
    assert isinstance(layer, Fp8Linear)

    def fresh():
        q, s = quantize_rows(layer.weight.detach())
        qt, st = quantize_rows(layer.weight.detach().t())
        return (torch.equal(layer.fp8_w.float(), q.float()) and torch.equal(layer.fp8_w_scale, s)
                and torch.equal(layer.fp8_wt.float(), qt.float())
                and torch.equal(layer.fp8_wt_scale, st))

    assert fresh()  # quantised at conversion
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    layer(torch.randn(16, 32)).sum().backward()
    opt.step()
    assert not fresh() and refresh_fp8_weights(layer) == 1 and fresh()
    layer.load_state_dict({"weight": torch.randn(48, 32)})
    assert not fresh() and refresh_fp8_weights(layer) == 1 and fresh()
    assert "fp8_w" not in layer.state_dict()  # buffers, never saved


def train_small(compiled: bool, refresh: bool, steps: int = 4) -> list[torch.Tensor]:
    """Losses of a small FP8 MLP trained with fused AdamW; compiled with aot_eager (the graph
    AOTAutograd builds, run as is)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32))
    use_fp8_gemms(mlp)
    opt = torch.optim.AdamW(mlp.parameters(), lr=0.05, fused=True)
    fn = torch.compile(mlp, backend="aot_eager") if compiled else mlp
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        if refresh:
            refresh_fp8_weights(mlp)
        loss = fn(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_a_compiled_trainer_that_refreshes_after_each_update_trains_like_eager():
    """Eager quantises the weight at every call; compiled reads the copies, which only the
    trainer's refresh renews: with it compiled equals eager, without it the forward keeps the
    first weights while the optimizer moves the real ones (the check can fail)."""
    eager = train_small(False, False)
    assert all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(eager, train_small(True, True)))
    stale = train_small(True, False)
    assert torch.equal(stale[0], eager[0]) and not torch.allclose(stale[-1], eager[-1], rtol=1e-2)


def test_weight_gradient_pads_a_row_count_that_is_not_a_multiple_of_16():
    x, w = operands(M=37)
    wr = w.clone().requires_grad_()
    fp8_matmul(x, wr).sum().backward()
    ones = torch.ones(37, 48)
    assert rel(wr.grad, simulated(ones.t(), x.t())) < 1e-2


def test_quantized_rows_never_saturate_and_keep_each_rows_largest_value():
    x, _ = operands()
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and q.is_contiguous() and scale.shape == (x.shape[0], 1)
    back = q.float() * scale
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)


def test_conversion_keeps_the_state_dict_and_skips_lm_head_and_eval_mode_is_the_plain_gemm():
    draft, _, _ = th.tiny_parts(kv_heads=2)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    names = use_fp8_gemms(draft)
    assert "lm_head" not in names and "fc" in names and "midlayer.mlp.down_proj" in names
    assert type(draft.lm_head) is nn.Linear
    assert all(isinstance(m, Fp8Linear) for n, m in draft.named_modules() if n in names)
    after = draft.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    layer = draft.midlayer.mlp.up_proj
    x = torch.randn(3, 5, layer.in_features)
    layer.eval()
    assert torch.equal(layer(x), x @ layer.weight.t())
    layer.train()
    trained = layer(x)
    assert trained.shape == (3, 5, layer.out_features)
    assert not torch.equal(trained, x @ layer.weight.t())  # the fp8 path ran
    assert rel(trained.reshape(15, -1), simulated(x.reshape(15, -1), layer.weight)) < 1e-2


def test_a_layer_whose_size_is_not_a_multiple_of_16_is_refused_by_name():
    draft, _, _ = th.tiny_parts(kv_heads=1)  # k_proj/v_proj: 32 -> 8
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.k_proj.*--fp8-gemm off"):
        use_fp8_gemms(draft)


def test_04_is_off_by_default_until_the_gpu_run_with_refreshed_copies_is_measured():
    from eagle3.train.distributed import DistInfo
    from eagle3.train.loop import TrainConfig, build_runtime

    assert TrainConfig(target=Path("t")).fp8_gemm == "off"
    assert build_runtime(TrainConfig(target=Path("t")), torch.device("cpu"), DistInfo()).fp8 is False


def test_auto_stays_off_even_on_a_gpu_with_fp8_and_on_works_on_cpu(monkeypatch):
    """`auto` must not turn on the recipe that fails the gradient criterion on an FP8 GPU."""
    import eagle3.train.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_supported", lambda device: None)  # as on an H200
    assert resolve_mode("auto", torch.device("cuda")) is False
    assert resolve_mode("on", torch.device("cuda")) is True
    monkeypatch.undo()
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) is False
    assert resolve_mode("on", cpu) is True
    assert resolve_mode("off", cpu) is False
    with pytest.raises(ValueError, match="--fp8-gemm"):
        resolve_mode("fast", cpu)
    with pytest.raises(ValueError, match="--fp8-gemm on"):
        resolve_mode("on", torch.device("meta"))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return th.write_splits(tmp_path_factory.mktemp("fp8data"), 24, 4)


def test_04_with_fp8_gemms_compiled_and_fused_adamw_learns_like_the_fp32_run(
        tiny_data, tmp_path, monkeypatch):
    """04 as it runs on CUDA: compiled forward (aot_eager here: the same graph, no Inductor
    compile time) and fused AdamW, whose updates move no version counter. The loop's refresh
    keeps the weights' e4m3 copies current; without it (stale copies) the eval loss fell by
    half as much as the fp32 run's and the check below fails."""
    from functools import partial

    from eagle3.train import loop

    calls = {"n": 0}
    original = fp8_module._scaled_mm

    def counted(*a):
        calls["n"] += 1
        return original(*a)

    def fused(draft, lr, weight_decay, device):
        return torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=weight_decay, fused=True)

    monkeypatch.setattr(fp8_module, "_scaled_mm", counted)
    monkeypatch.setattr(loop, "build_optimizer", fused)
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))
    fp8, _ = th.run_tiny(tiny_data, tmp_path / "fp8", kv_heads=2, fp8_gemm="on", epochs=3,
                         compile=True)
    assert fp8["fp8_gemm"] is True and calls["n"] > 0
    n = calls["n"]
    plain, _ = th.run_tiny(tiny_data, tmp_path / "plain", kv_heads=2, fp8_gemm="off", epochs=3)
    assert plain["fp8_gemm"] is False and calls["n"] == n  # off: not one fp8 GEMM
    # fp8 learns as much as the fp32 run (within 10% of its eval-loss drop) and ends close to it
    start = th.first_eval_loss(tmp_path / "plain")
    assert th.first_eval_loss(tmp_path / "fp8") == pytest.approx(start, rel=1e-6)
    assert start - fp8["eval_loss"][0] > 0.9 * (start - plain["eval_loss"][0]) > 0
    assert abs(fp8["eval_loss"][0] - plain["eval_loss"][0]) < 0.01 * plain["eval_loss"][0]


def test_a_backward_graph_cut_stops_04_at_its_first_step_naming_the_parameters(
        tiny_data, tmp_path, monkeypatch):
    from eagle3.draft.model import MLP
    from eagle3.train.guards import TrainError

    def cut(self, x):  # the MLP's output reaches the loss, its gradient goes nowhere
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
                              ).detach()

    monkeypatch.setattr(MLP, "forward", cut)
    with pytest.raises(TrainError, match=r"midlayer\.mlp\.up_proj\.weight.*--fp8-gemm off"):
        th.run_tiny(tiny_data, tmp_path / "cut", kv_heads=2, fp8_gemm="on")
    assert not (tmp_path / "cut" / "checkpoints").exists() or not any(
        (tmp_path / "cut" / "checkpoints").glob("step_*"))
