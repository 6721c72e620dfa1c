"""The device-side state of fast generation (eagle3/generate/fast.py): the static KV cache, the
decode loop's tensors, and the attention function decode steps use.

`StaticKV` is a transformers `Cache` whose `update` writes into preallocated per-layer buffers at
slots given as a device tensor, so that a CUDA graph of a decode step replays with the slot
advanced in place; `DecodeState` holds every other tensor such a graph reads or writes. Both
are allocated once per (rows, slots) shape and reused across batches.

Decode attention. With a mask, transformers' sdpa path repeats each kv head for its query heads
at every layer of every step (`repeat_kv`: [R, H, L, D] copied, since CUDA's masked sdpa kernels
take no `enable_gqa`: `integrations/sdpa_attention.py: use_gqa_in_sdpa`). Two ways around it,
both through `decode_sdpa` (registered with transformers as `DECODE_ATTENTION`):

- `grouped` (the default): the cache holds the kv heads only and the G = H / Hkv query heads of
  a kv head are passed as G queries of that head ([R, Hkv, G, D]; head h reads kv head h // G):
  the smallest cache and the fewest bytes read, but another kernel shape than transformers', so
  bf16 rounds differently at every step;
- `expanded`: the cache stores every query head's keys and values (each kv head written G times
  at its write, in `repeat_kv`'s order) and decode steps make transformers' own sdpa call on
  it: the same call on the same values (bitwise equal logits on an H100 while the key length
  stays within cuDNN's first 128-key block), for a G times larger cache.

Prefill forwards attend to their own tokens only: `update` returns the keys and values it was
given, as transformers' `DynamicCache` does on its first write, so prefill is transformers' own.

Shapes: R rows, L cache slots, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

DECODE_ATTENTION = "eagle3_decode"  # decode_sdpa's name in transformers' registry


class StaticKV(Cache):
    """Per-layer key and value buffers [R, h * expand, L, d], allocated at each layer's first
    write with the shapes the model gives (per-head keys for Llama, MLA latents for
    DeepSeek-V3). `update` writes the forward's tokens of rows `rows` at slots `write_at` (a
    device tensor, so that a graph replays it), each head `expand` times; a decode step gets
    the first `kv_len` slots back (the mask hides unwritten ones), a prefill its own states."""

    def __init__(self, rows: int, slots: int, expand: int = 1):
        super().__init__(layers=[])
        self.shape, self.expand = (rows, slots), expand
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_at: torch.Tensor | None = None  # [n] slots of the forward's n tokens
        self.rows = slice(None)  # the forward's rows (the prefill runs in row chunks)
        self.decoding = False  # False: a prefill (attends to its own tokens only)
        self.kv_len = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == len(self.keys):  # first write (a prefill, never a captured step)
            rows, slots = self.shape
            for store, x in ((self.keys, key_states), (self.values, value_states)):
                store.append(x.new_zeros(rows, x.shape[1] * self.expand, slots, x.shape[3]))
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        # head h of the expanded cache holds kv head h // expand, as repeat_kv orders them
        keys.index_copy_(2, self.write_at, key_states.repeat_interleave(self.expand, dim=1))
        values.index_copy_(2, self.write_at, value_states.repeat_interleave(self.expand, dim=1))
        if not self.decoding:
            return key_states, value_states
        return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # only read when no position ids are given; we always give them

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class DecodeState:
    """The static tensors of one (rows, slots) shape; captured graphs read and write them."""

    kv: StaticKV
    tok_R1: torch.Tensor  # the token each row is fed next
    pos_R1: torch.Tensor  # its position id
    key_ok_RL: torch.Tensor  # bool: the slot holds a real token of the row
    out_RL: torch.Tensor  # generated tokens
    n_out_1: torch.Tensor  # [1] tokens generated so far (the next one's column in out_RL)
    budget_R: torch.Tensor  # per-row max new tokens (0 for padding rows)
    done_R: torch.Tensor  # bool: the row met eos or its budget
    slot_1: torch.Tensor  # [1] the cache slot the next decode step writes
    noise_RV: torch.Tensor | None = None  # uniform noise for sampling, drawn before each step
    graphs: dict = field(default_factory=dict)  # (kv_len, temperature, top_p) -> graph | None
    pool: object = None  # the memory pool the graphs share (no tensor outlives a replay)

    @property
    def rows(self) -> int:
        return self.tok_R1.shape[0]

    @property
    def slots(self) -> int:
        return self.key_ok_RL.shape[1]

    def loop_tensors(self) -> tuple[torch.Tensor, ...]:
        """What a decode step changes besides the cache."""
        return (self.tok_R1, self.pos_R1, self.key_ok_RL, self.out_RL, self.n_out_1,
                self.done_R, self.slot_1)


def new_state(rows: int, slots: int, device, expand: int = 1) -> DecodeState:
    def zeros(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return DecodeState(kv=StaticKV(rows, slots, expand), tok_R1=zeros(rows, 1),
                       pos_R1=zeros(rows, 1), key_ok_RL=zeros(rows, slots, dtype=torch.bool),
                       out_RL=zeros(rows, slots), n_out_1=zeros(1), budget_R=zeros(rows),
                       done_R=zeros(rows, dtype=torch.bool), slot_1=zeros(1))


def decode_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """sdpa for one query token per row without `repeat_kv` (module docstring): an expanded
    cache (H heads) is attended as transformers does after repeating, a grouped one (Hkv heads)
    with [R, Hkv, H/Hkv, D] queries. Other shapes (a prefill, MLA latents) go to transformers'
    sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    r, h, q, d = query.shape
    hkv = key.shape[1]
    if q != 1 or h % hkv or key.shape[-1] != d:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(r, hkv, h // hkv, d), key, value, attn_mask=attention_mask, dropout_p=0.0,
        scale=scaling)
    return out.reshape(r, h, 1, -1).transpose(1, 2).contiguous(), None
