"""Hidden-state files equal an independent forward at the capture indices and after the norm."""

from __future__ import annotations

import pytest
import torch

from eagle3.core import hidden_states as hs
from eagle3.core.records import read_jsonl
from eagle3.extract.teacher import TeacherHead
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


def test_files_match_independent_forward_at_capture_layers(demo_run, demo_target_model):
    target_model = demo_target_model
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


def _head(H: int, k: int, draft_vocab: int = 100, target_vocab: int = 300):
    g = torch.Generator().manual_seed(H)
    d2t = torch.arange(draft_vocab) * 2 - torch.arange(draft_vocab)  # target id = 2 * draft id
    return TeacherHead(torch.randn(target_vocab, H, generator=g), d2t, k)


def test_estimate_bytes_bounds_real_file_sizes_when_saved(tmp_path):
    for dtype in hs.DTYPES:
        for T, H in ((1, 64), (57, 64), (300, 512)):
            k = 64 if dtype == "fp8-topk" else 0
            aux = [torch.randn(T, H) for _ in range(3)]
            data = hs.pack(list(range(T)), [1] * T, aux, torch.randn(T, H),
                           {"id": "sharegpt/" + "x" * 40, "capture_layers": [2, 30, 58],
                            "final": "post_norm", "source": "sharegpt"}, dtype,
                           _head(H, k) if k else None)
            size = hs.save(data, tmp_path / f"{dtype}_{T}_{H}.pt")
            estimate = hs.estimate_bytes(T, 1, H, dtype, k)
            assert estimate - hs.FILE_OVERHEAD_BYTES < size <= estimate, (dtype, T, H, size)
    kimi = {d: hs.bytes_per_token(7168, d, 64) for d in hs.DTYPES}
    assert kimi == {"bf16": 57_360, "fp8": 35_868, "fp8-all": 28_704, "fp8-topk": 21_792}
    assert kimi["fp8-topk"] <= 22_000  # the target


def test_fp8_all_stores_the_final_state_in_e4m3_with_its_own_scale():
    torch.manual_seed(0)
    aux, final = [torch.randn(6, 32) for _ in range(3)], torch.randn(6, 32) * 20
    data = hs.pack(list(range(6)), [1] * 6, aux, final, {"id": "x"}, "fp8-all")
    assert [t.dtype for t in data["hidden_states"]] == [torch.float8_e4m3fn] * 4
    assert hs.layout_of(data) == "fp8-all" and data["meta"]["dtype"] == "fp8_e4m3"
    _, got_final = hs.unpack(data, torch.float32)
    assert torch.equal(got_final, hs.stored_value(final, "fp8"))
    hs.validate(data, 32)


def test_topk_file_stores_the_largest_draft_logprobs_and_the_full_vocabulary_argmax():
    torch.manual_seed(1)
    T, H = 7, 16
    head = _head(H, 5)
    aux, final = [torch.randn(T, H) for _ in range(3)], torch.randn(T, H)
    data = hs.pack(list(range(T)), [1] * T, aux, final, {"id": "x"}, "fp8-topk", head)
    hs.validate(data, H)
    assert len(data["hidden_states"]) == 3 and hs.unpack(data)[1] is None
    assert data["teacher_ids"].dtype == torch.int16 and data["target_top"].dtype == torch.int32
    assert data["meta"]["topk"] == 5 and data["meta"]["draft_vocab"] == 100
    # an independent reference: the full logits of the bf16-rounded final state
    x = final.to(torch.bfloat16).float()
    full = x @ head.full_VH.T
    lp = torch.log_softmax(full[:, ::2][:, :100], -1)  # target id 2d is draft id d
    ref_v, ref_i = lp.topk(5, -1)
    got = hs.unpack_teacher(data)
    assert torch.equal(got["ids"], ref_i)
    torch.testing.assert_close(got["logprobs"], ref_v, rtol=1e-3, atol=1e-3)  # float16
    assert torch.equal(got["target_top"], full.argmax(-1))


def test_validate_names_the_missing_teacher_when_a_topk_file_lacks_it():
    data = hs.pack([1, 2], [0, 1], [torch.zeros(2, 16)] * 3, torch.zeros(2, 16), {},
                   "fp8-topk", _head(16, 4))
    del data["teacher_logprobs"]
    with pytest.raises(hs.HiddenStateError, match="teacher_logprobs"):
        hs.validate(data, 16, "data_3.pt")


def test_pack_refuses_a_teacher_for_a_layout_that_stores_the_final_state():
    with pytest.raises(ValueError, match="fp8-topk"):
        hs.pack([1], [1], [torch.zeros(1, 16)] * 3, torch.zeros(1, 16), {}, "fp8", _head(16, 4))
    with pytest.raises(ValueError, match="fp8-topk"):
        hs.pack([1], [1], [torch.zeros(1, 16)] * 3, torch.zeros(1, 16), {}, "fp8-topk")


def test_pack_writes_same_bytes_when_aux_is_a_strided_view_or_fp32(tmp_path):
    torch.manual_seed(0)
    packed_TK = torch.randn(1, 3 * 16).to(torch.bfloat16)  # a one-token dump: [T, 3H] in bf16
    views = list(packed_TK.split(16, dim=-1))  # [1, H] views that count as contiguous
    copies = [v.float().clone() for v in views]
    final = torch.randn(1, 16)
    for dtype in hs.DTYPES:
        head = _head(16, 4) if dtype == "fp8-topk" else None
        a = hs.save(hs.pack([7], [1], views, final, {}, dtype, head), tmp_path / "a.pt")
        b = hs.save(hs.pack([7], [1], copies, final, {}, dtype, head), tmp_path / "b.pt")
        assert a == b and (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_stored_value_equals_unpacked_file_when_dtype_is_fp8():
    x = torch.randn(9, 32) * 5
    data = hs.pack([0] * 9, [0] * 9, [x, x, x], x, {}, "fp8")
    aux, _ = hs.unpack(data, torch.float32)
    assert torch.equal(aux[0], hs.stored_value(x, "fp8"))
    assert torch.equal(hs.stored_value(x, "bf16"), x.to(torch.bfloat16).float())
