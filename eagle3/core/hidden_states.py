"""Hidden-state files (docs/PIPELINE.md, "Hidden-state file") and their capture with transformers.

A file holds `input_ids [T]`, `loss_mask [T]`, `hidden_states`: the three aux captures then the
final post-norm state, each `[T, H]`, and `meta`. With fp8 storage the aux tensors are float8
e4m3 with a per-token float32 scale in `hidden_states_scale` (value = fp8.float() * scale); the
final state stays bf16 (it is the lm_head's input, the training target). Both backends of stage
02b quantize from the bf16 value with `eagle3.core.fp8.quantize_fp8`, which the SGLang dump hook's
fp8 layout uses too, so a file does not depend on which backend or which dump layout it came from.

Capture index i is the residual stream entering decoder layer i: transformers'
`output_hidden_states[i]` (index 0 is the embedding output). The final state is the one the
lm_head sees, after the model's final norm: `output_hidden_states[-1]` in transformers, which is
checked against `model.model.norm` in the tests.

Layouts (`--dtype` of 02b; `meta.layout` names the two compact ones, older files are told by
`meta.dtype`):
- `bf16` (default): four bf16 tensors.
- `fp8`: the three aux tensors e4m3 + per-token scale, the final state bf16.
- `fp8-all`: all four tensors e4m3 + per-token scale (`hidden_states_scale[3]` is set too).
- `fp8-topk`: the three aux tensors e4m3 + scale and, instead of the final state (which is only
  the teacher's input), the teacher itself: `teacher_ids` int16 `[T, K]` (draft ids, largest
  first), `teacher_logprobs` float16 `[T, K]` (log-softmax of `lm_head_hot @ final` over the whole
  draft vocabulary, so `1 - sum(exp)` is the mass outside the top K), and `target_top` int32 `[T]`
  (the target's full-vocabulary argmax, a target id: what the acceptance estimate needs).
  `hidden_states` holds 3 tensors; `meta` gains `topk`, `draft_vocab` and `vocab_sha256` (of the
  03 mapping's `d2t`), so that 04 refuses files made with another draft vocabulary.

Size on disk, per token (H = hidden size, K = top-k), two int64 ids included: bf16 `8H + 16`,
fp8 `5H + 28`, fp8-all `4H + 32`, fp8-topk `3H + 4K + 32` (three e4m3 rows, three float32
scales, K int16 ids + K float16 log-probs, one int32), plus under FILE_OVERHEAD_BYTES per file
(torch.save's zip records). Kimi-K2.5 (H = 7168): 57,360, 35,868, 28,704 and (K = 64) 21,792
bytes a token.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.core.faults import InputFileError
from eagle3.core.fp8 import Fp8Rows, quantize_fp8
from eagle3.core.stage import STAGE_DIRS, atomic_writer, file_sha256, read_manifest

log = logging.getLogger(__name__)

FILES_PER_SHARD = 1000
DTYPES = ("bf16", "fp8", "fp8-all", "fp8-topk")  # the layouts; "fp8" = fp8 aux, bf16 final
TOPK_MAX_DRAFT_VOCAB = 32768  # draft ids are stored as int16
FILE_OVERHEAD_BYTES = 5120  # zip headers, pickle and meta; measured 2.8-3.6 KB, fp8-topk 4.7


class HiddenStateError(ValueError):
    """A hidden-state file that breaks the contract; the message names the file and field."""


def read_capture_layers(workdir: Path) -> list[int] | None:
    """The capture layers of the files 02b wrote in `workdir` (its manifest's `capture_layers`),
    None when 02b has not finished there: the one reader of that key."""
    manifest = read_manifest(Path(workdir) / STAGE_DIRS["02b"]) or {}
    layers = manifest.get("capture_layers")
    return list(layers) if layers else None


def file_path(root: Path, idx: int) -> Path:
    """`<root>/shard_NNNNN/data_<idx>.pt`, at most FILES_PER_SHARD files per shard."""
    return Path(root) / f"shard_{idx // FILES_PER_SHARD:05d}" / f"data_{idx}.pt"


def file_index(path: Path) -> int:
    """The record index of `data_<idx>.pt`."""
    return int(Path(path).stem.split("_")[1])


def bytes_per_token(hidden_size: int, dtype: str, topk: int = 0) -> int:
    """Stored bytes per token of a file (see the module docstring), without the file overhead;
    `topk` is K of the fp8-topk layout (ignored by the others)."""
    if dtype == "bf16":
        return 8 * hidden_size + 16
    if dtype == "fp8":
        return 5 * hidden_size + 28
    if dtype == "fp8-all":
        return 4 * hidden_size + 32
    if dtype == "fp8-topk":
        if topk < 1:
            raise ValueError("the fp8-topk layout needs topk >= 1 (--teacher-topk)")
        return 3 * hidden_size + 4 * topk + 32
    raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")


def estimate_bytes(num_tokens: int, num_files: int, hidden_size: int, dtype: str,
                   topk: int = 0) -> int:
    """Upper estimate of the bytes `num_files` files holding `num_tokens` tokens take."""
    return (num_tokens * bytes_per_token(hidden_size, dtype, topk)
            + num_files * FILE_OVERHEAD_BYTES)


def _owned(x_TH: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`x` in `dtype` with row-major strides, in a storage of its own. torch.save writes a
    tensor's whole storage (a row slice would drag its batch into every file) and its strides
    (a `[1, H]` column slice counts as contiguous but keeps the stride of its parent)."""
    x = x_TH.to(dtype)
    if (x.stride() != torch.empty(x.shape, device="meta").stride()
            or x.untyped_storage().nbytes() != x.numel() * x.element_size()):
        x = torch.empty(x.shape, dtype=dtype).copy_(x)
    return x


def stored_value(x_TH: torch.Tensor, dtype: str) -> torch.Tensor:
    """What a tensor `[T, H]` reads back as (float32) after storage in `dtype` ("bf16" or "fp8")."""
    x = x_TH.to(torch.bfloat16)
    if dtype != "bf16":
        q, scale_T = quantize_fp8(x)
        return q.float() * scale_T[:, None]
    return x.float()


def pack(input_ids, loss_mask, aux: list[torch.Tensor | Fp8Rows], final: torch.Tensor,
         meta: dict, dtype: str = "bf16", teacher=None) -> dict:
    """The dict stored in one file; `aux` are the three captures `[T, H]`, `final` `[T, H]`.

    An aux capture may come quantized already (`Fp8Rows`, from an fp8 dump of the SGLang hook,
    made by the same `eagle3.core.fp8.quantize_fp8`): it is stored as it is, which gives the
    bytes its bf16 value would give; such captures need an fp8 layout.

    `teacher` (fp8-topk only): an object with `topk(final_TH) -> dict` of `teacher_ids`,
    `teacher_logprobs`, `target_top` and `meta() -> dict` (eagle3.extract.teacher.TeacherHead).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    if (teacher is not None) != (dtype == "fp8-topk"):
        raise ValueError(f"layout {dtype!r}: a teacher head is needed by fp8-topk and only by it")
    if dtype == "bf16" and any(isinstance(t, Fp8Rows) for t in aux):
        raise ValueError("fp8 aux states cannot be stored in the bf16 layout")
    final = _owned(final)
    hidden = [t if isinstance(t, Fp8Rows) else _owned(t) for t in aux]
    hidden += [] if teacher is not None else [final]
    data = {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int64),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int64),
        "hidden_states": hidden,
        "meta": {**meta, "dtype": "bf16" if dtype == "bf16" else "fp8_e4m3"},
    }
    if dtype in ("fp8-all", "fp8-topk"):
        data["meta"]["layout"] = dtype
    if dtype != "bf16":
        scales = []
        n_fp8 = 4 if dtype == "fp8-all" else 3
        for i in range(n_fp8):  # from the bf16 value: the same bytes whatever the source
            if isinstance(hidden[i], Fp8Rows):
                hidden[i], s = (_owned(hidden[i].values_TH, torch.float8_e4m3fn),
                                _owned(hidden[i].scale_T, torch.float32))
            else:
                hidden[i], s = quantize_fp8(hidden[i])
            scales.append(s)
        data["hidden_states_scale"] = scales + [None] * (len(hidden) - n_fp8)
    if teacher is not None:  # from the bf16 final state, as training from a bf16 file sees it
        data.update(teacher.topk(final))
        data["meta"].update(teacher.meta())
    return data


def layout_of(data: dict) -> str:
    """The file's layout (one of DTYPES)."""
    meta = data["meta"]
    return meta.get("layout") or ("fp8" if meta.get("dtype") == "fp8_e4m3" else "bf16")


def num_tokens(data: dict) -> int:
    return int(data["input_ids"].shape[0])


def unpack(data: dict, dtype: torch.dtype = torch.bfloat16
           ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(aux list of 3 `[T, H]`, final `[T, H]`) in `dtype`, dequantizing fp8 tensors; final is
    None in an fp8-topk file (it stores the teacher instead: `unpack_teacher`)."""
    hidden = data["hidden_states"]
    scales = data.get("hidden_states_scale") or [None] * len(hidden)
    out = []
    for t, s in zip(hidden, scales):
        out.append((t.float() * s[:, None]).to(dtype) if s is not None else t.to(dtype))
    return out[:3], (out[3] if len(out) > 3 else None)


def unpack_teacher(data: dict) -> dict | None:
    """The stored teacher of an fp8-topk file: `ids` int64 `[T, K]` (draft ids), `logprobs`
    float32 `[T, K]`, `target_top` int64 `[T]`; None for the other layouts."""
    if "teacher_ids" not in data:
        return None
    return {"ids": data["teacher_ids"].long(), "logprobs": data["teacher_logprobs"].float(),
            "target_top": data["target_top"].long()}


def load(path: Path, mmap: bool = False) -> dict:
    """Load a file safely (`weights_only`); `mmap=True` reads tensors lazily (cheap checks)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def save(data: dict, path: Path) -> int:
    """Write a file atomically and durably (temp file, fsync, rename); returns its size.
    `save_with_sha256` also returns the hash of the bytes written."""
    return save_with_sha256(data, path).bytes


@dataclass(frozen=True)
class SavedFile:
    """What `save_with_sha256` wrote: the file's size and the hex sha256 of its bytes."""

    bytes: int
    sha256: str


class _HashingWriter:
    """A write-only file that hashes every byte on its way to `f`. torch.save writes a
    file-like object strictly in sequence (a `write` callback, no seek), so the hash is the
    hash of the file as written, without reading it back."""

    def __init__(self, f):
        self._f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()


def save_with_sha256(data: dict, path: Path) -> SavedFile:
    """`save`, returning the size and the sha256 of the bytes written (02b's index records it;
    readers verify it). Hashing on the way costs what sha256 costs (about 2 GB/s a core), no
    second read.

    torch.save goes straight to the temp file (no in-memory copy of a file that can reach
    470 MB); a killed writer leaves only a `.data_*.tmp` file, which the stage sweeps
    (`eagle3.core.stage.sweep_temp_files`). A full or read-only disk raises
    `eagle3.core.faults.DiskError` (the folder, the bytes needed), the temp file removed.
    """
    with atomic_writer(path) as f:
        out = _HashingWriter(f)
        torch.save(data, out)
        size = f.tell()
    return SavedFile(size, out.sha.hexdigest())


def validate(data: dict, expected_hidden: int, path: Path | str = "<memory>") -> None:
    """Check shapes: 4 tensors `[T, H]` (3 and a `[T, K]` teacher for fp8-topk),
    T == len(input_ids) == len(loss_mask), H as expected."""
    T = data["input_ids"].shape[0]
    if data["loss_mask"].shape[0] != T:
        raise HiddenStateError(f"{path}: loss_mask has {data['loss_mask'].shape[0]} rows, T={T}")
    hidden, layout = data["hidden_states"], layout_of(data)
    want = 3 if layout == "fp8-topk" else 4
    if len(hidden) != want:
        raise HiddenStateError(f"{path}: {len(hidden)} hidden-state tensors, expected {want} "
                               f"for layout {layout} (three aux captures"
                               f"{', then the final state' if want == 4 else ''})")
    for i, t in enumerate(hidden):
        if tuple(t.shape) != (T, expected_hidden):
            raise HiddenStateError(
                f"{path}: hidden_states[{i}] has shape {tuple(t.shape)}, expected "
                f"({T}, {expected_hidden}) — a width of 3x hidden means aux states were stored "
                "concatenated, a different width means another target's states"
            )
    if layout == "fp8-topk":
        K = data["meta"].get("topk")
        for key, shape in (("teacher_ids", (T, K)), ("teacher_logprobs", (T, K)),
                           ("target_top", (T,))):
            if key not in data or tuple(data[key].shape) != shape:
                got = tuple(data[key].shape) if key in data else "missing"
                raise HiddenStateError(f"{path}: {key} is {got}, expected {shape} "
                                       f"(fp8-topk layout, meta.topk = {K})")


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


# ---------------------------------------------------------------- checked reading (stage 04)
# A reader meets files that 02b wrote and that a disk, a copy or a hand may have damaged since:
# `check_header` (memory-mapped, only the zip directory and the pickle are read: the pre-flight
# of every file before training), `load_checked` (the full read, checksum verified against the
# split's index), `nonfinite_problem` (a NaN/Inf value anywhere). Each turns what is wrong into
# an `InputFileError` naming the file (its `problem` starts with a kind: `unreadable`, `missing`,
# `wrong dtype`, `wrong shape`, `wrong layout`, `checksum mismatch`, `non-finite`).

# dtypes of each layout's hidden_states tensors (aux captures, then the final state)
_LAYOUT_DTYPES = {"bf16": [torch.bfloat16] * 4,
                  "fp8": [torch.float8_e4m3fn] * 3 + [torch.bfloat16],
                  "fp8-all": [torch.float8_e4m3fn] * 4,
                  "fp8-topk": [torch.float8_e4m3fn] * 3}
_TEACHER_DTYPES = {"teacher_ids": torch.int16, "teacher_logprobs": torch.float16,
                   "target_top": torch.int32}


@dataclass
class FileFacts:
    """What the pre-flight read in a file's header."""

    tokens: int  # T
    topk: int  # K of its stored teacher (0: the file stores the final state)
    vocab_sha256: str | None  # the draft vocabulary of its teacher ids (fp8-topk only)
    record_id: str | None  # meta.id


def check_header(path: Path, hidden_size: int, capture_layers: list[int] | None = None
                 ) -> FileFacts:
    """Check a file without reading its tensors (memory-mapped): it opens as a torch zip, has
    the keys of its layout, each tensor the layout's dtype and `[T, H]` shape, T agreeing
    everywhere, H == `hidden_size`, and `meta.capture_layers` == `capture_layers` (when given).
    Raises InputFileError naming the file and the first problem."""
    data = _load_or_raise(path, mmap=True)
    problem = _header_problem(data, hidden_size, capture_layers)
    if problem:
        raise InputFileError(path, problem)
    meta = data["meta"]
    return FileFacts(num_tokens(data), int(meta.get("topk", 0)), meta.get("vocab_sha256"),
                     meta.get("id"))


def _load_or_raise(path: Path, mmap: bool) -> dict:
    if not Path(path).is_file():
        raise InputFileError(path, "missing: the file is not there (02b's index lists it)")
    if Path(path).stat().st_size == 0:
        raise InputFileError(path, "unreadable: the file is empty")
    try:
        data = load(path, mmap=mmap)
    except Exception as e:  # torch's zip / unpickler errors name no file: any of them is this
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise InputFileError(path, f"unreadable: not a complete torch file ({first}); "
                                   "truncated or corrupt: re-run 02b for it") from e
    if not isinstance(data, dict):
        raise InputFileError(path, f"unreadable: holds a {type(data).__name__}, not a dict")
    return data


def _header_problem(data: dict, hidden_size: int, capture_layers) -> str | None:
    missing = [k for k in ("input_ids", "loss_mask", "hidden_states", "meta") if k not in data]
    if missing:
        return f"missing keys: {missing}"
    meta = data["meta"]
    if not isinstance(meta, dict) or not isinstance(data["hidden_states"], list):
        return "wrong layout: meta is not a dict or hidden_states not a list"
    layout = layout_of(data)
    if layout not in _LAYOUT_DTYPES:
        return f"wrong layout: {layout!r} (expected one of {DTYPES})"
    for key in ("input_ids", "loss_mask"):
        t = data[key]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            return f"wrong dtype: {key} must be a 1-D int64 tensor"
    try:
        validate(data, hidden_size)
    except HiddenStateError as e:
        return "wrong shape: " + str(e).removeprefix("<memory>: ")
    for i, (t, want) in enumerate(zip(data["hidden_states"], _LAYOUT_DTYPES[layout])):
        if t.dtype != want:
            return f"wrong dtype: hidden_states[{i}] is {t.dtype}, layout {layout} stores {want}"
    problem = _scale_problem(data, layout) or _teacher_problem(data, layout)
    if problem:
        return problem
    if capture_layers is not None and list(meta.get("capture_layers") or []) != capture_layers:
        return (f"wrong layout: captured at layers {meta.get('capture_layers')}, 02b's manifest "
                f"says {capture_layers}")
    return None


def _scale_problem(data: dict, layout: str) -> str | None:
    n_fp8 = sum(d == torch.float8_e4m3fn for d in _LAYOUT_DTYPES[layout])
    if not n_fp8:
        return None
    scales = data.get("hidden_states_scale")
    if not isinstance(scales, list) or len(scales) < n_fp8:
        return f"missing keys: hidden_states_scale (layout {layout} stores {n_fp8} scales)"
    T = num_tokens(data)
    for i in range(n_fp8):
        s = scales[i]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (T,):
            return f"wrong dtype: hidden_states_scale[{i}] must be float32 [{T}]"
    return None


def _teacher_problem(data: dict, layout: str) -> str | None:
    if layout != "fp8-topk":
        return None
    for key, want in _TEACHER_DTYPES.items():
        if data[key].dtype != want:
            return f"wrong dtype: {key} is {data[key].dtype}, fp8-topk stores {want}"
    if not data["meta"].get("vocab_sha256"):
        return "missing keys: meta.vocab_sha256 (an fp8-topk file names its draft vocabulary)"
    return None


def load_checked(path: Path, sha256: str | None = None) -> dict:
    """The whole file, its bytes first checked against `sha256` (02b's index) when given: a
    flipped or truncated file raises InputFileError here, where it is read. The hash streams
    the file (one extra read, from the page cache when the file was just hashed)."""
    if sha256 is not None and Path(path).is_file():
        got = file_sha256(path)
        if got != sha256:
            raise InputFileError(path, f"checksum mismatch: sha256 {got[:16]}..., 02b's index "
                                       f"says {sha256[:16]}... (the file changed on disk since "
                                       "02b wrote it: re-run 02b for it)")
    return _load_or_raise(path, mmap=False)


def nonfinite_problem(data: dict) -> str | None:
    """`non-finite: ...` naming the tensor and the first token holding a NaN or an Inf (the
    stored values and their fp8 scales), None when every value is finite."""
    named = [(f"hidden_states[{i}]", t) for i, t in enumerate(data["hidden_states"])]
    named += [(f"hidden_states_scale[{i}]", s)
              for i, s in enumerate(data.get("hidden_states_scale") or []) if s is not None]
    if "teacher_logprobs" in data:  # -inf is legitimate there (mass outside the top K)
        lp = data["teacher_logprobs"]
        named.append(("teacher_logprobs", lp.masked_fill(lp == -math.inf, 0.0)))
    for name, t in named:
        if t.dtype == torch.float8_e4m3fn:  # e4m3fn has no Inf; NaN is S.1111.111
            bad = t.view(torch.uint8).bitwise_and(0x7F) == 0x7F
        elif t.numel() and bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            continue  # min/max propagate NaN and show Inf: 30x faster than isfinite on bf16
        else:
            bad = ~torch.isfinite(t)
        if bool(bad.any()):
            token = int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0])
            return f"non-finite: {name} holds NaN/Inf at token {token}"
    return None
