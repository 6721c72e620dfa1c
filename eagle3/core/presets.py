"""Named targets and the draft 04 trains for each: one table, looked up by exact key.

Each number that describes a target appears here once; 04 (`--preset`), the plan's figures, the
benchmarks and the tests take shapes from here (gpt-fast `transformer_configs`, torchtitan's
`llama3_configs`). A preset's `draft` is the Llama-style EAGLE-3 layer (`LlamaForCausalLMEagle3`);
its hidden size is the target's (serving reuses the target's embedding).

- `kimi-k2.5`: moonshotai/Kimi-K2.5 (DeepSeek-V3 architecture, 61 layers). The draft is the shape
  of the published Kimi-K2.5 EAGLE-3 drafts: 64 heads x 128, 64 KV heads, MLP 12288
  (lightseekorg/kimi-k2.5-eagle3, which TorchSpec's `configs/draft_models/kimi_k25_eagle3.json`
  and later Kimi-K2.5 drafts follow).
- `tiny-deepseek-v3`, `tiny-llama`: the embedded tiny targets (`python -m eagle3.tiny.target`,
  `--arch deepseek_v3` / `llama`, default TinyTargetConfig); their drafts are what 04 derives
  from the target without a preset (heads and MLP of the target, head_dim = hidden / heads).
- `tiny-qwen2`: the embedded tiny Qwen2 target (`--arch qwen2`), drafted as the other tiny ones.
- `smollm2-135m`: HuggingFaceTB/SmolLM2-135M-Instruct (LlamaForCausalLM); its draft follows the
  target's own attention (9 heads x 64, 3 KV heads, MLP 1536).
- `qwen2.5-coder-1.5b`: Qwen/Qwen2.5-Coder-1.5B-Instruct (Qwen2ForCausalLM: 28 layers, 12 heads
  x 128, 2 KV heads, MLP 8960, vocab 151936, untied head). Draft: 12 heads x 128, 2 KV heads,
  MLP 8960, 32000 draft ids: 106M parameters besides the borrowed embedding. Why:
  - A draft step at serving is a GEMV over the draft's weights (SGLang, batch <= 64 rows: far
    below the ~300 FLOP/byte an H100 needs to be compute-bound), so it costs its bytes: 212 MB in
    bf16, ~0.08 ms. Measured on one H100 (docs/PIPELINE.md, "Qwen2.5-Coder-1.5B-Instruct on one
    H100"): a chain of 7 costs 3.9-4.0 ms a round against 3.6-3.9 for a chain of 3, so four more
    draft steps cost at most 0.4 ms of a round that is ~2x a 2.1 ms plain step.
  - The MLP is 39% of those bytes (41.3M of 106M). MLP 4608 (3 x hidden) would save ~0.015 ms a
    step, ~0.12 ms of a 4.0 ms chain-7 round (3%); at the ~0.53 speedup per accepted token of
    this round cost that equals ~0.1 token of acceptance, less than a draft with half the MLP of
    the layer it imitates can be expected to lose. In training it would cut the draft's FLOPs a
    token by 20% (4.24 to 3.40 GFLOP at TTT 7, eagle3/train/flops.py), which buys nothing while
    the run is bounded by the data the target can write in the session, as on one GPU it is. So
    the MLP stays the target's (as the EAGLE-3 drafts of Llama-3.1-8B keep theirs).
  - 2 KV heads, the target's own grouping, not the 12 that 04 derives without a preset (the
    114M-parameter draft measured above): 7.9M fewer parameters (7% of a step's weight bytes)
    and a KV cache of 1 KB a token instead of 6 KB, which at concurrency 16 and 2K-token
    contexts would read ~200 MB a step, as much as the weights. The queries keep all 12 heads.
  - head_dim 128 (hidden / heads, the target's), the size SGLang's attention kernels are built
    for; rope base and norm epsilon come from the target's config (04 reads them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftShape:
    """The draft layer's attention and MLP (the hidden size is the target's)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


@dataclass(frozen=True)
class Preset:
    """A target's config.json fields the pipeline checks, and the draft trained for it."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int
    draft: DraftShape
    draft_vocab_size: int = 32000  # 03's default


PRESETS: dict[str, Preset] = {
    "kimi-k2.5": Preset(hidden_size=7168, num_hidden_layers=61, vocab_size=163840,
                        num_attention_heads=64, intermediate_size=18432,
                        draft=DraftShape(64, 64, 128, 12288)),
    "tiny-deepseek-v3": Preset(hidden_size=64, num_hidden_layers=8, vocab_size=554,
                               num_attention_heads=4, intermediate_size=128,
                               draft=DraftShape(4, 4, 16, 128), draft_vocab_size=256),
    "tiny-llama": Preset(hidden_size=64, num_hidden_layers=8, vocab_size=554,
                         num_attention_heads=2, intermediate_size=128,
                         draft=DraftShape(2, 2, 32, 128), draft_vocab_size=256),
    "tiny-qwen2": Preset(hidden_size=64, num_hidden_layers=8, vocab_size=540,
                         num_attention_heads=4, intermediate_size=128,
                         draft=DraftShape(4, 4, 16, 128), draft_vocab_size=256),
    # The real small target; 05 and the demo wiring come with its stage support.
    "smollm2-135m": Preset(hidden_size=576, num_hidden_layers=30, vocab_size=49152,
                           num_attention_heads=9, intermediate_size=1536,
                           draft=DraftShape(9, 3, 64, 1536)),
    "qwen2.5-coder-1.5b": Preset(hidden_size=1536, num_hidden_layers=28, vocab_size=151936,
                                 num_attention_heads=12, intermediate_size=8960,
                                 draft=DraftShape(12, 2, 128, 8960)),
}


def get_preset(name: str) -> Preset:
    """The preset named exactly `name`; ValueError listing the names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def check_target(name: str, hidden_size: int, num_hidden_layers: int, vocab_size: int) -> None:
    """Refuse a target whose config.json is not the preset's (a preset names one target)."""
    p = get_preset(name)
    got, want = (hidden_size, num_hidden_layers, vocab_size), (p.hidden_size,
                                                             p.num_hidden_layers, p.vocab_size)
    if got != want:
        raise ValueError(f"--preset {name} is a target of hidden size, layers, vocab {want}, "
                         f"but the target's config.json has {got}: drop --preset or use the "
                         "preset of this target")


def draft_fields(name: str) -> dict:
    """DraftConfig keyword arguments of the preset's draft (SGLang's default captures
    [2, N//2, N-3])."""
    from eagle3.core.target import default_capture_layers

    p = get_preset(name)
    return {"hidden_size": p.hidden_size, "num_attention_heads": p.draft.num_attention_heads,
            "num_key_value_heads": p.draft.num_key_value_heads, "head_dim": p.draft.head_dim,
            "intermediate_size": p.draft.intermediate_size, "vocab_size": p.vocab_size,
            "draft_vocab_size": p.draft_vocab_size, "target_hidden_size": p.hidden_size,
            "capture_layers": default_capture_layers(p.num_hidden_layers)}
