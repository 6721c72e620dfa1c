"""Hidden-state files equal an independent forward at the capture indices and after the norm."""

from __future__ import annotations

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.records import read_jsonl
from eagle3.train.loop import list_files


def _reference(model, ids: list[int]):
    """Inputs of every decoder layer and the final norm's output, by hooks (not hidden_states)."""
    layer_inputs, final = {}, {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: layer_inputs.__setitem__(
            i, (args[0] if args else kwargs["hidden_states"])[0].detach()),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_hook(
        lambda mod, args, out: final.__setitem__("post", out[0].detach())))
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda mod, args: final.__setitem__("pre", args[0][0].detach())))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return layer_inputs, final


def _close(stored: torch.Tensor, ref: torch.Tensor) -> bool:
    # bf16 keeps 8 bits of mantissa: relative error <= 2**-8 per element, plus fp32 noise
    return bool(((stored.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all())


def test_files_match_independent_forward_at_capture_layers(demo_run, target_model):
    files = list_files(demo_run / "02b_hidden_states/train")
    records = list(read_jsonl(demo_run / "01c_merged/train.jsonl"))
    for path in files[:6]:
        data = hs.load(path)
        idx = int(path.stem.split("_")[1])
        assert data["input_ids"].tolist() == records[idx]["input_ids"]
        assert data["loss_mask"].tolist() == records[idx]["loss_mask"]
        layers = data["meta"]["capture_layers"]
        assert layers == [2, 4, 5] and data["meta"]["final"] == "post_norm"
        hs.validate(data, target_model.config.hidden_size, path)
        layer_inputs, final = _reference(target_model, data["input_ids"].tolist())
        for k, layer in enumerate(layers):
            assert _close(data["hidden_states"][k], layer_inputs[layer]), (path, layer)
            # a shift by one layer would be caught
            assert not _close(data["hidden_states"][k], layer_inputs[layer + 1])
            assert not _close(data["hidden_states"][k], layer_inputs[layer - 1])
        assert _close(data["hidden_states"][3], final["post"])
        assert not _close(data["hidden_states"][3], final["pre"])  # a pre-norm final is caught


def test_fp8_storage_roundtrips_within_e4m3_precision_when_packed():
    torch.manual_seed(0)
    aux = [torch.randn(10, 32) * s for s in (0.1, 1.0, 30.0)]
    final = torch.randn(10, 32)
    data = hs.pack(list(range(10)), [1] * 10, aux, final, {"id": "x"}, dtype="fp8")
    assert data["hidden_states"][0].dtype == torch.float8_e4m3fn
    assert data["hidden_states"][3].dtype == torch.bfloat16
    assert data["hidden_states_scale"][3] is None
    assert data["meta"]["dtype"] == "fp8_e4m3"
    got_aux, got_final = hs.unpack(data, torch.float32)
    for a, g in zip(aux, got_aux):
        # e4m3 has 3 mantissa bits: relative error <= 1/16 of the value, after bf16 rounding
        assert ((g - a).abs() <= a.abs() / 16 + a.abs().amax(-1, keepdim=True) / 448 * 2).all()
    assert torch.allclose(got_final, final, rtol=2 ** -7)


def test_validate_names_the_file_when_aux_states_are_concatenated():
    data = hs.pack([1, 2], [0, 1], [torch.zeros(2, 8)] * 3, torch.zeros(2, 8), {})
    data["hidden_states"] = [torch.cat(data["hidden_states"][:3], -1), data["hidden_states"][3]]
    try:
        hs.validate(data, 8, "shard_00000/data_7.pt")
    except hs.HiddenStateError as e:
        assert "data_7.pt" in str(e) and "4" in str(e)
    else:
        raise AssertionError("validate accepted a 2-tensor file")


def test_estimate_bytes_bounds_real_file_sizes_when_saved(tmp_path):
    for dtype in hs.DTYPES:
        for T, H in ((1, 64), (57, 64), (300, 512)):
            aux = [torch.randn(T, H) for _ in range(3)]
            data = hs.pack(list(range(T)), [1] * T, aux, torch.randn(T, H),
                           {"id": "sharegpt/" + "x" * 40, "capture_layers": [2, 30, 58],
                            "final": "post_norm", "source": "sharegpt"}, dtype)
            size = hs.save(data, tmp_path / f"{dtype}_{T}_{H}.pt")
            estimate = hs.estimate_bytes(T, 1, H, dtype)
            assert estimate - hs.FILE_OVERHEAD_BYTES < size <= estimate, (dtype, T, H, size)
    assert hs.bytes_per_token(7168, "bf16") == 57_360 and hs.bytes_per_token(7168, "fp8") == 35_868


def test_pack_writes_same_bytes_when_aux_is_a_strided_view_or_fp32(tmp_path):
    torch.manual_seed(0)
    packed_TK = torch.randn(1, 3 * 16).to(torch.bfloat16)  # a one-token dump: [T, 3H] in bf16
    views = list(packed_TK.split(16, dim=-1))  # [1, H] views that count as contiguous
    copies = [v.float().clone() for v in views]
    final = torch.randn(1, 16)
    for dtype in hs.DTYPES:
        a = hs.save(hs.pack([7], [1], views, final, {}, dtype), tmp_path / "a.pt")
        b = hs.save(hs.pack([7], [1], copies, final, {}, dtype), tmp_path / "b.pt")
        assert a == b and (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_stored_value_equals_unpacked_file_when_dtype_is_fp8():
    x = torch.randn(9, 32) * 5
    data = hs.pack([0] * 9, [0] * 9, [x, x, x], x, {}, "fp8")
    aux, _ = hs.unpack(data, torch.float32)
    assert torch.equal(aux[0], hs.stored_value(x, "fp8"))
    assert torch.equal(hs.stored_value(x, "bf16"), x.to(torch.bfloat16).float())
