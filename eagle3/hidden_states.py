"""Hidden-state files (PIPELINE.md, "Hidden-state file") and their capture with transformers.

A file holds `input_ids [T]`, `loss_mask [T]`, `hidden_states`: the three aux captures then the
final post-norm state, each `[T, H]`, and `meta`. With fp8 storage the aux tensors are float8
e4m3 with a per-token float32 scale in `hidden_states_scale` (value = fp8.float() * scale).

Capture index i is the residual stream entering decoder layer i: transformers'
`output_hidden_states[i]` (index 0 is the embedding output). The final state is the one the
lm_head sees, after the model's final norm: `output_hidden_states[-1]` in transformers, which is
checked against `model.model.norm` in the tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FILES_PER_SHARD = 1000
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DTYPES = ("bf16", "fp8")


class HiddenStateError(ValueError):
    """A hidden-state file that breaks the contract; the message names the file and field."""


def file_path(root: Path, idx: int) -> Path:
    """`<root>/shard_NNNNN/data_<idx>.pt`, at most FILES_PER_SHARD files per shard."""
    return Path(root) / f"shard_{idx // FILES_PER_SHARD:05d}" / f"data_{idx}.pt"


def quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scaled float8 e4m3: returns (fp8 [T, H], float32 scale [T])."""
    x = x_TH.float()
    scale_T = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (x / scale_T[:, None]).to(torch.float8_e4m3fn), scale_T


def pack(input_ids, loss_mask, aux: list[torch.Tensor], final: torch.Tensor, meta: dict,
         dtype: str = "bf16") -> dict:
    """The dict stored in one file; `aux` are the three captures `[T, H]`, `final` `[T, H]`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    hidden = [t.to(torch.bfloat16).contiguous() for t in aux] + [final.to(torch.bfloat16)]
    data = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int64),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int64),
        "hidden_states": hidden,
        "meta": {**meta, "dtype": "bf16" if dtype == "bf16" else "fp8_e4m3"},
    }
    if dtype == "fp8":
        scales = []
        for i in range(len(aux)):
            hidden[i], s = quantize_fp8(aux[i])
            scales.append(s)
        data["hidden_states_scale"] = scales + [None]
    return data


def unpack(data: dict, dtype: torch.dtype = torch.bfloat16) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(aux list of 3 `[T, H]`, final `[T, H]`) in `dtype`, dequantizing fp8 tensors."""
    hidden = data["hidden_states"]
    scales = data.get("hidden_states_scale") or [None] * len(hidden)
    out = []
    for t, s in zip(hidden, scales):
        out.append((t.float() * s[:, None]).to(dtype) if s is not None else t.to(dtype))
    return out[:3], out[3]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def validate(data: dict, expected_hidden: int, path: Path | str = "<memory>") -> None:
    """Check shapes: 4 tensors `[T, H]`, T == len(input_ids) == len(loss_mask), H as expected."""
    T = data["input_ids"].shape[0]
    if data["loss_mask"].shape[0] != T:
        raise HiddenStateError(f"{path}: loss_mask has {data['loss_mask'].shape[0]} rows, T={T}")
    hidden = data["hidden_states"]
    if len(hidden) != 4:
        raise HiddenStateError(f"{path}: {len(hidden)} hidden-state tensors, expected 4 "
                               "(three aux captures, then the final state)")
    for i, t in enumerate(hidden):
        if tuple(t.shape) != (T, expected_hidden):
            raise HiddenStateError(
                f"{path}: hidden_states[{i}] has shape {tuple(t.shape)}, expected "
                f"({T}, {expected_hidden}) — a width of 3x hidden means aux states were stored "
                "concatenated, a different width means another target's states"
            )


@torch.no_grad()
def capture_hf(model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
               capture_layers: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Aux states at `capture_layers` and the post-norm final state, each `[B, T, H]`."""
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    n_layers = model.config.num_hidden_layers
    if len(hs) != n_layers + 1:
        raise HiddenStateError(f"model returned {len(hs)} hidden states, expected {n_layers + 1}")
    if max(capture_layers) >= n_layers:
        raise HiddenStateError(f"capture layers {capture_layers} exceed {n_layers} layers")
    return [hs[i] for i in capture_layers], hs[-1]
