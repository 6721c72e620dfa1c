"""The trainer: schedule, loss alignment, DDP equivalence, kill-and-resume, and the demo result."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import train_helpers as th

from eagle3.train.log import read_metrics
from eagle3.train.loop import lr_at
from eagle3.train.ttt import TTTModel, stats_dict

# ---------------------------------------------------------------- schedule


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    peak, floor = 1e-3, 0.1
    assert [lr_at(s, 110, peak, 10, floor) for s in (0, 4, 9)] == pytest.approx(
        [1e-4, 5e-4, 1e-3])
    assert lr_at(10, 110, peak, 10, floor) == pytest.approx(peak)  # cosine starts at the peak
    assert lr_at(60, 110, peak, 10, floor) == pytest.approx(peak * (0.1 + 0.9 * 0.5))  # halfway
    assert lr_at(110, 110, peak, 10, floor) == pytest.approx(peak * floor)
    assert lr_at(500, 110, peak, 10, floor) == pytest.approx(peak * floor)  # clamped after
    assert lr_at(0, 10, peak, 0, floor) == pytest.approx(peak)  # no warmup


def test_row_width_refuses_pack_tokens_below_the_longest_sample():
    from eagle3.train.data import DataError, row_width

    assert row_width(8192, 0, 300) == 384  # the data's longest sample, block-aligned
    assert row_width(256, 0, 300) == 256  # truncated by --max-seq-len
    assert row_width(512, 1000, 300) == 1024
    with pytest.raises(DataError, match="--pack-tokens"):
        row_width(512, 200, 300)


def test_training_forward_is_compiled_by_default_on_cuda_only_and_no_compile_turns_it_off():
    from eagle3.train.distributed import DistInfo
    from eagle3.train.loop import TrainConfig, build_runtime

    def compiled(device: str, **kw) -> bool:
        cfg = TrainConfig(target=Path("t"), **kw)
        return build_runtime(cfg, torch.device(device), DistInfo()).compile

    assert compiled("cuda") and not compiled("cpu")
    assert not compiled("cuda", compile=False) and compiled("cpu", compile=True)


# ---------------------------------------------------------------- loss alignment


def _packed_example():
    """Two sequences (6 and 4 tokens) in a row of 12: ids, mask, doc, positions."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0]])
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1]], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    return ids, mask, doc, pos


def test_loss_weights_follow_the_shifted_mask_when_sequences_are_packed():
    ids, mask, doc, pos = _packed_example()
    draft, embed, teacher = th.tiny_parts()
    model = TTTModel(draft, embed, teacher, steps=4, step_weight=0.8)
    aux, final = torch.randn(1, 12, 3 * th.H), torch.randn(1, 12, th.H)
    with torch.no_grad():
        _, stats = model(ids, mask, doc, pos, aux, final)
    weights = stats[8:12].tolist()
    # step k at anchor t weighs mask[t+1+k] when t+1+k is in t's sequence. Sequence 0 (mask
    # 0,0,0,1,1,1): the last prompt row t=2 is trained at step 0 (mask[3] = 1).
    # step 0: rows 0..4 -> mask[1..5] = 0,0,1,1,1 (3); seq 1 rows 6..8 -> mask[7..9] = 1,1,1 (3)
    # step 1: rows 0..3 -> mask[2..5] = 0,1,1,1 (3); rows 6,7 -> mask[8,9] (2)
    # step 2: rows 0..2 -> mask[3..5] (3); row 6 -> mask[9] (1)
    # step 3: rows 0,1 -> mask[4,5] (2); none in sequence 1
    assert weights == [6.0, 5.0, 4.0, 2.0]


def test_loss_compares_each_step_with_the_target_distribution_at_t_plus_1_plus_k():
    ids, mask, doc, pos = _packed_example()
    draft, embed, teacher = th.tiny_parts()
    model = TTTModel(draft, embed, teacher, steps=3, step_weight=0.5)
    torch.manual_seed(0)
    aux, final = torch.randn(1, 12, 3 * th.H), torch.randn(1, 12, th.H)
    with torch.no_grad():
        loss, stats = model(ids, mask, doc, pos, aux, final)
        step_logits = list(model.unroll(ids, doc, pos, aux))
    teacher_p = torch.softmax(final[0] @ teacher.T, -1)
    expected, dens = 0.0, []
    for k, logits in enumerate(step_logits):  # explicit loops over anchors
        num, den = 0.0, 0.0
        for t in range(12):
            j = t + 1 + k
            if j < 12 and doc[0, j] == doc[0, t] >= 0 and mask[0, j] == 1:
                logp = torch.log_softmax(logits[0, t], -1)
                num += float(-(teacher_p[j] * logp).sum())
                den += 1
        expected += 0.5 ** k * num / den
        dens.append(den)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    m = stats_dict(stats, 3)
    assert m["supervised"] == dens[0]  # every step-0 term counted once


# ---------------------------------------------------------------- distributed and resume


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    return th.write_splits(tmp_path_factory.mktemp("tinydata"), 40, 6)


def test_ddp_on_two_processes_equals_one_process_when_the_global_batch_is_equal(
        tiny_data, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(th.ddp_worker, args=(2, str(tiny_data), str(tmp_path / "ddp"), port), nprocs=2,
             join=True)
    ddp_state = torch.load(tmp_path / "ddp" / "draft.pt")
    summary, single = th.run_tiny(tiny_data, tmp_path / "single", grad_accum=2)
    assert summary["num_steps"] >= 8
    for name, value in single.state_dict().items():
        torch.testing.assert_close(ddp_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    ddp_log = [r for r in read_metrics(tmp_path / "ddp" / "metrics.jsonl") if "loss" in r]
    single_log = [r for r in read_metrics(tmp_path / "single" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in ddp_log] == pytest.approx([r["loss"] for r in single_log],
                                                          rel=1e-5)
    assert [r["tokens"] for r in ddp_log] == [r["tokens"] for r in single_log]


def _curve(out: Path) -> list[tuple]:
    recs = read_metrics(out / "metrics.jsonl")
    return [(r["step"], r.get("loss"), tuple(r.get("acc", r.get("eval_acc", []))))
            for r in recs]


TIMING = ("dt_ms", "tok_s", "data_wait", "elapsed_s", "wall_s")  # wall-clock fields of a row


def _canonical(obj) -> str:
    """A loaded state as text: tensors by dtype, shape and bytes, keys in their order."""
    if isinstance(obj, torch.Tensor):
        return f"T({obj.dtype},{tuple(obj.shape)},{obj.contiguous().numpy().tobytes().hex()})"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_canonical(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in obj) + "]"
    return repr(obj)


def _folder(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative name, `root` itself written `<root>` (the config
    names it); metrics.jsonl without its timing fields; state.pt by its loaded content
    (torch.save writes a random `serialization_id` into every file, and pickle's memo follows
    object identity)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "state.pt":
                data = _canonical(torch.load(p, weights_only=True)).encode()
            if p.name == "metrics.jsonl":
                rows = [{k: v for k, v in r.items() if k not in TIMING}
                        for r in read_metrics(p)]
                data = json.dumps(rows).encode()
            out[str(p.relative_to(root))] = data.replace(str(root).encode(), b"<root>")
    return out


def test_run_killed_twice_resumes_to_the_folder_of_an_uninterrupted_run(tiny_data, tmp_path):
    """Killed before its first checkpoint, then mid-epoch after one: the resumed run ends with
    the same files, checkpoints byte for byte and one metrics curve (one eval row a step)."""
    helper = Path(th.__file__)
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    subprocess.run([sys.executable, str(helper), str(tiny_data), str(whole)], check=True,
                   timeout=300)
    proc = subprocess.run([sys.executable, str(helper), str(tiny_data), str(crashed), "2"],
                          timeout=300)
    assert proc.returncode == -9  # before the first checkpoint (at step 3): starts afresh
    assert not list((crashed / "checkpoints").glob("step_*"))
    assert [r["step"] for r in read_metrics(crashed / "metrics.jsonl")][:2] == [0, 1]
    proc = subprocess.run([sys.executable, str(helper), str(tiny_data), str(crashed), "7"],
                          timeout=300)
    assert proc.returncode == -9  # SIGKILL after the update of step 7 (checkpoints at 3, 6)
    steps = sorted(int(p.name[5:]) for p in (crashed / "checkpoints").glob("step_*"))
    assert steps == [3, 6]
    assert max(r["step"] for r in read_metrics(crashed / "metrics.jsonl")) == 7  # logged past 6
    subprocess.run([sys.executable, str(helper), str(tiny_data), str(crashed)], check=True,
                   timeout=300)
    a, b = _curve(whole), _curve(crashed)
    assert [r[0] for r in a] == [r[0] for r in b]
    evals = [r["step"] for r in read_metrics(crashed / "metrics.jsonl") if "eval_acc" in r]
    assert evals == sorted(set(evals)) and evals[0] == 0  # one eval row per eval step
    for x, y in zip(a, b):
        if x[1] is None or y[1] is None:  # eval rows carry eval_* fields, no "loss"
            assert x[1] is y[1], x[0]
        else:
            assert x[1] == pytest.approx(y[1], rel=1e-6, abs=1e-9), x[0]
        assert x[2] == pytest.approx(y[2], abs=1e-9), x[0]
    ckpt = torch.load(sorted((crashed / "checkpoints").glob("step_*"))[-1] / "state.pt",
                      weights_only=True)
    final = torch.load(sorted((whole / "checkpoints").glob("step_*"))[-1] / "state.pt",
                       weights_only=True)
    for name, value in final["model"].items():
        torch.testing.assert_close(ckpt["model"][name], value, msg=name)
    got, want = _folder(crashed), _folder(whole)
    assert sorted(got) == sorted(want)
    assert [n for n in want if got[n] != want[n]] == []


# ---------------------------------------------------------------- the demo


def test_demo_training_lowers_the_loss_and_raises_acceptance_above_an_untrained_draft(
        demo_run, demo_target_model, tokenizer):
    target_model = demo_target_model
    from eagle3.bench.hf import run_offline
    from eagle3.bench.prompts import PromptSet
    from eagle3.core.records import read_jsonl
    from eagle3.core.target import load_embedding
    from eagle3.draft.export import load_draft
    from eagle3.train.loop import build_draft

    records = read_metrics(demo_run / "04_train/metrics.jsonl")
    train_recs = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_acc" in r]
    # the soft CE is bounded below by the teacher's entropy (~5 nats on the tiny target)
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]
    assert evals[0]["step"] == 0  # the untrained draft is evaluated first
    assert evals[-1]["eval_loss"][0] < evals[0]["eval_loss"][0] - 0.3
    assert evals[-1]["eval_acc"][0] > evals[0]["eval_acc"][0] + 0.2
    trained = load_draft(demo_run / "04_train/final")
    untrained = build_draft(trained.cfg, 0, trained.d2t, trained.t2d)
    prompts = [r["input_ids"][: r["n_prompt_tokens"]]
               for r in read_jsonl(demo_run / "01c_merged/eval.jsonl")][:4]
    embed = load_embedding(demo_run / "target")
    from eagle3.core.chat import ChatRenderer

    eos = {ChatRenderer(tokenizer).end_of_turn_id}
    results = {name: run_offline(target_model, d, embed, PromptSet("eval", prompts), [3], 24,
                                 eos)["steps"]["3"]["acceptance_length"]
               for name, d in (("trained", trained), ("untrained", untrained.eval()))}
    assert results["untrained"] < 1.2
    assert results["trained"] > results["untrained"] + 0.5, results
    summary = json.loads((demo_run / "04_train/manifest.json").read_text())["outputs"]
    assert math.isfinite(summary["tok_s"]) and 0.0 <= summary["padding"] < 0.5
    assert sorted(p.name for p in (demo_run / "04_train/plots").glob("*.png")) == [
        "accuracy.png", "loss.png", "lr.png", "sim_accept.png", "throughput.png"]


# ---------------------------------------------------------------- FLOP count


@pytest.mark.parametrize("unroll", ["shared", "per-step"])
def test_flop_count_matches_torch_flop_counter_when_attention_is_dense(unroll):
    from torch.utils.flop_counter import FlopCounterMode

    from eagle3.train.flops import micro_step_flops

    draft, embed, teacher = th.tiny_parts()
    model = TTTModel(draft, embed, teacher, steps=3, step_weight=0.8, unroll=unroll)
    T = 20
    ids, mask = torch.randint(0, th.VT, (1, T)), torch.ones(1, T, dtype=torch.long)
    doc, pos = torch.zeros(1, T, dtype=torch.int32), torch.arange(T)[None]
    aux, final = torch.randn(1, T, 3 * th.H), torch.randn(1, T, th.H)
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(ids, mask, doc, pos, aux, final)
        loss.backward()
    expected = micro_step_flops(draft.cfg, T, [T], 3, dense_attention=True, unroll=unroll)
    assert counter.get_total_flops() == expected.train
    exact = micro_step_flops(draft.cfg, T, [T], 3, unroll=unroll)  # MFU: visible keys only
    assert exact.attention < expected.attention and exact.fc == expected.fc


def test_flop_count_at_kimi_dimensions_counts_fc_once_per_row():
    from eagle3.core.presets import draft_fields
    from eagle3.draft.model import DraftConfig
    from eagle3.train.flops import micro_step_flops

    cfg = DraftConfig(**draft_fields("kimi-k2.5"))  # 64 heads x 128, 64 KV heads, MLP 12288
    f = micro_step_flops(cfg, 4096, [4096], 7, unroll="per-step")
    per_token = f.train / 4096
    # 7 steps x 3 x 1.7651 GF of GEMMs, fc 2 x 0.308 GF, teacher 0.459 GF, causal attention
    gemm = 2 * (14336 * 24576 + 8192 * 7168 + 3 * 7168 * 12288 + 7168 * 32000)
    attn = sum(4 * 64 * 128 * (4096 * 4097 // 2 + s * 4096) for s in range(7)) / 4096
    assert per_token == pytest.approx(21 * gemm + 3 * attn + 2 * 2 * 21504 * 7168
                                      + 2 * 7168 * 32000)
    assert 40e9 < per_token < 41e9
    # shared: the embedding half of q/k/v (7168 of the 14336 input columns) once, not 7 times
    shared = micro_step_flops(cfg, 4096, [4096], 7).train / 4096
    assert per_token - shared == pytest.approx(6 * 3 * 2 * 7168 * 24576)
    assert 0.15 < 1 - shared / per_token < 0.16
    with pytest.raises(ValueError, match="per-step"):
        micro_step_flops(cfg, 4096, [4096], 7, unroll="perstep")
