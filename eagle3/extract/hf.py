"""Stage 02b with the `hf` backend: hidden states from an in-process transformers target; and
the check of stored files against that forward pass (the sglang backend's `--verify-against-hf`).

The `hf` backend runs fixed length-sorted batches (the same batches on every run, whatever was
already written), so a resumed run writes the same bytes as an uninterrupted one. Batching
changes float rounding (padding changes the shapes of the kernels), so the files of a batch size
differ from those of another in the last bf16 bit; `max_batch_size=1` gives each record's own
forward pass, which is what an SGLang server (or the tests' fake one) computes per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict

import torch

from eagle3.core import hidden_states as hs
from eagle3.core.target import TargetInfo, load_hf_model
from eagle3.extract.checks import BadStates, pack_checked
from eagle3.extract.config import ExtractConfig
from eagle3.extract.teacher import maybe_teacher
from eagle3.extract.writer import (
    ExtractCounts,
    ExtractError,
    ExtractProgress,
    SplitWriter,
    VerificationFailed,
    record_meta,
)

log = logging.getLogger(__name__)


def extract(cfg: ExtractConfig, writers: dict[str, SplitWriter], layers: list[int],
            info: TargetInfo) -> tuple[dict, dict]:
    """The backend's door: every split; returns (outputs per split, manifest extras)."""
    model = load_model(cfg)
    return extract_hf(model, writers, layers, cfg.dtype, cfg.max_batch_tokens,
                      cfg.max_batch_size, maybe_teacher(cfg, model)), {}


def load_model(cfg: ExtractConfig):
    """The target in transformers, as `--model-dtype` and `--device` say."""
    return load_hf_model(cfg.target, cfg.model_dtype, cfg.device, cfg.trust_remote_code)


def fixed_batches(lengths: list[int], max_tokens: int, max_batch: int) -> list[list[int]]:
    """Record indices grouped into padded batches of at most `max_tokens` (longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        width = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and (width * (len(cur) + 1) > max_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def extract_hf(model, writers: dict[str, SplitWriter], capture_layers: list[int], dtype: str,
               max_tokens: int, max_batch: int, teacher=None) -> dict[str, dict]:
    """Every split with the hf backend; returns the manifest outputs per split. `teacher`: the
    TeacherHead of the fp8-topk layout (eagle3/extract/teacher.py), None for the others."""
    outputs = {}
    for split, writer in writers.items():
        prog = ExtractProgress(writer, f"02b {split}")
        counts = extract_split(model, writer, capture_layers, dtype, max_tokens, max_batch, prog,
                               teacher)
        prog.close()
        outputs[split] = {"samples": len(writer.records), **asdict(counts)}
    return outputs


def extract_split(model, writer: SplitWriter, capture_layers: list[int], dtype: str,
                  max_tokens: int, max_batch: int, prog: ExtractProgress,
                  teacher=None) -> ExtractCounts:
    """Write a file for every record of the split still without one; returns the counts.
    Records with NaN/Inf states are skipped as bad; a stop signal ends the split after the
    batch in flight."""
    records = writer.records
    good = [i for i, r in enumerate(records) if r is not None]  # bad lines: never batched
    try:
        for batch in fixed_batches([len(records[i]["input_ids"]) for i in good], max_tokens,
                                   max_batch):
            if writer.stopping:
                break
            batch = [good[b] for b in batch]
            todo = {i for i in batch if i not in writer.done and i not in writer.skipped}
            if todo:
                _extract_batch(model, writer, batch, todo, capture_layers, dtype, prog, teacher)
    except BaseException:
        writer.abandon()
        raise
    return writer.close()


def _extract_batch(model, writer: SplitWriter, batch: list[int], todo: set[int],
                   capture_layers: list[int], dtype: str, prog: ExtractProgress,
                   teacher) -> None:
    """One fixed batch through the target; files for the records of `todo`."""
    records, device = writer.records, model.device
    width = max(len(records[i]["input_ids"]) for i in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, i in enumerate(batch):  # right padding: causal attention never sees it
        n = len(records[i]["input_ids"])
        ids[b, :n] = torch.tensor(records[i]["input_ids"])
        attn[b, :n] = 1
    # The whole fixed batch runs even when some files exist: same shapes, same bytes.
    aux, final = hs.capture_hf(model, ids.to(device), attn.to(device), capture_layers)
    for b, i in enumerate(batch):
        if i not in todo:
            continue
        rec, n = records[i], len(records[i]["input_ids"])
        try:
            data = pack_checked(rec, [a[b, :n].cpu() for a in aux], final[b, :n].cpu(),
                                record_meta(rec, capture_layers), dtype, teacher)
        except BadStates as e:
            writer.skip(i, str(e))
            continue
        saved = writer.save(i, data)
        writer.mark_written(i, n, saved.bytes, saved.sha256)
        prog.advance(n, saved.bytes)


# ---------------------------------------------------------------- verification against hf


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))


def _final_rel_err(data: dict, got_final: torch.Tensor | None, ref_final_TH: torch.Tensor,
                   teacher) -> float:
    """The stored final state against the reference's (through the same storage); for an
    fp8-topk file, the stored top-k log-probs against the reference's at the same draft ids."""
    if got_final is not None:
        storage = "fp8" if hs.layout_of(data) == "fp8-all" else "bf16"
        return _rel_err(got_final, hs.stored_value(ref_final_TH, storage))
    if teacher is None:
        raise ExtractError("an fp8-topk file can only be verified with its teacher head")
    got = hs.unpack_teacher(data)
    x = hs.stored_value(ref_final_TH, "bf16").to(teacher.device, teacher.hot_VdH.dtype)
    ref_TV = torch.log_softmax((x @ teacher.hot_VdH.T).float(), dim=-1).cpu()
    return _rel_err(got["logprobs"], ref_TV.gather(-1, got["ids"]))


@torch.no_grad()
def verify_against_hf(model, writer: SplitWriter, idxs: list[int], capture_layers: list[int],
                      tolerance: float, teacher=None) -> list[dict]:
    """Compare stored files with the record's own transformers forward; returns one row each.

    The reference goes through the same storage (bf16 or fp8) as the file, so what remains is
    the server's numerical noise. Each aux tensor must lie closest to its own capture index
    among the neighbouring ones (a one-layer shift is caught however alike layers are) and
    within `tolerance` relative L2 error; the final state (or an fp8-topk file's teacher
    log-probs, with `teacher` its TeacherHead) within `tolerance` too.
    """
    rows, bad = [], []
    for idx in idxs:
        rec, data = writer.records[idx], hs.load(writer.path(idx))
        layout = hs.layout_of(data)
        dtype = "bf16" if layout == "bf16" else "fp8"
        out = model(input_ids=torch.tensor([rec["input_ids"]], device=model.device),
                    output_hidden_states=True, use_cache=False).hidden_states
        layer_inputs = [o[0].cpu() for o in out[:-1]]  # out[-1] is the post-norm final state
        got_aux, got_final = hs.unpack(data, torch.float32)
        row = {"idx": idx, "id": rec["id"], "aux_rel_err": [], "nearest_layer": [],
               "final_rel_err": round(_final_rel_err(data, got_final, out[-1][0].cpu(), teacher),
                                      6)}
        for k, layer in enumerate(capture_layers):
            errs = {c: _rel_err(got_aux[k], hs.stored_value(layer_inputs[c], dtype))
                    for c in (layer - 1, layer, layer + 1) if 0 <= c < len(layer_inputs)}
            row["aux_rel_err"].append(round(errs[layer], 6))
            row["nearest_layer"].append(min(errs, key=errs.get))
        rows.append(row)
        log.info("verify %s: aux rel err %s (nearest layers %s, expected %s), final %.2e",
                 rec["id"], row["aux_rel_err"], row["nearest_layer"], capture_layers,
                 row["final_rel_err"])
        if (row["nearest_layer"] != list(capture_layers) or max(row["aux_rel_err"]) > tolerance
                or row["final_rel_err"] > tolerance):
            bad.append(row)
    if bad:
        raise VerificationFailed(
            f"{len(bad)} of {len(rows)} verified samples differ from the transformers forward "
            f"(tolerance {tolerance}): {bad[:3]}. Nearest layers other than {capture_layers} "
            "mean the server captures other layers (see python -m eagle3.extract.patching --check); "
            "a large final error means a pre-norm state or another model",
            [row["idx"] for row in bad])
    return rows


def make_verifier(model, capture_layers: list[int], tolerance: float, teacher=None
                  ) -> Callable[[SplitWriter, list[int]], list[dict]]:
    return lambda writer, idxs: verify_against_hf(model, writer, idxs, capture_layers, tolerance,
                                                  teacher)
