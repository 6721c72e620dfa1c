"""Stage 04's configuration: every flag of `04_train.py`, its default and its validation, and
the draft it builds (the shape from `--preset` or the target, eagle3/core/presets.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.cli import UpstreamStageFlags, arg
from eagle3.core.presets import PRESETS, DraftShape, check_target, get_preset
from eagle3.core.spool import SPOOL_DIR
from eagle3.draft.mla import mla_draft_config, read_mla_dims
from eagle3.draft.model import DraftConfig
from eagle3.train.fp8 import MODES as FP8_MODES
from eagle3.train.teacher import TOPK_MODES
from eagle3.train.ttt import UNROLLS

__all__ = ["TrainConfig", "build_draft_config", "draft_shape"]


@dataclass
class TrainConfig(UpstreamStageFlags):
    target: Path = arg(help="target model folder (config.json, embedding and lm_head tensors)")
    ttt_steps: int = arg(7, "training-time-test unroll length (draft steps per anchor)")
    step_weight: float = arg(0.8, "loss weight of step k is step_weight**k")
    epochs: int = arg(1, "passes over the train split")
    max_seq_len: int = arg(8192, "samples are truncated to this many tokens")
    pack_tokens: int = arg(0, "tokens per packed micro-batch row (0 = the longest sample, at "
                              "most --max-seq-len), rounded up to a multiple of 128")
    grad_accum: int = arg(1, "micro-batches (packed rows) per optimizer step and rank")
    lr: float = arg(1e-4, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final learning rate as a share of --lr (cosine floor)")
    warmup_steps: int = arg(-1, "linear warmup steps (-1 = 3%% of all steps)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(0.5, "gradient clipping norm")
    preset: str = arg("", "named target whose draft shape to train (heads, KV heads, head dim, "
                          "MLP; eagle3/core/presets.py); '' = from the target's config: its "
                          "heads and MLP width, head dim = hidden / heads",
                      choices=["", *PRESETS])
    draft_arch: str = arg("llama", "draft attention: llama (GQA, LlamaForCausalLMEagle3) or mla "
                                   "(the target's multi-latent attention sizes, "
                                   "Eagle3DeepseekV2ForCausalLM)", choices=["llama", "mla"])
    fc_norm: bool = arg(False, "EAGLE-3.1: RMSNorm each aux state before fc")
    norm_output: bool = arg(False, "EAGLE-3.1: the next draft step reads the normed output")
    eval_every: int = arg(100, "evaluate the eval split every N steps (and at the end)")
    max_eval_samples: int = arg(256, "eval samples per evaluation")
    save_every: int = arg(500, "checkpoint every N steps (and at the end)")
    keep_latest: int = arg(2, "checkpoints kept")
    log_every: int = arg(10, "log a line every N steps")
    num_workers: int = arg(2, "background data-loading processes per rank (0 = main process)")
    seed: int = arg(0, "seed of the init and the data order")
    device: str = arg("cpu", "torch device: cpu, or cuda (each torchrun rank takes its GPU)")
    precision: str = arg("auto", "bf16 autocast or fp32; auto = bf16 on cuda, fp32 on cpu",
                         choices=["auto", "bf16", "fp32"])
    attention: str = arg("auto", "TTT attention: flex (fused kernel, CUDA) or naive "
                                 "(materialised scores); auto = flex on cuda, naive on cpu",
                         choices=["auto", "flex", "naive"])
    compile: bool | None = arg(None, "torch.compile the TTT forward (the first steps compile; "
                                     "None = on for cuda, off for cpu; --no-compile = eager)")
    compile_cache: Path | None = arg(None, "folder of torch.compile's cache (Inductor's and "
                                           "Triton's compiled kernels), kept across runs: a "
                                           "resumed or re-run 04 compiles from it in a fraction "
                                           "of the time, also in a fresh container that mounts "
                                           "the same workdir (default <workdir>/.cache/torch_compile; a "
                                           "TORCHINDUCTOR_CACHE_DIR set in the environment "
                                           "wins)")
    ttt_unroll: str = arg("shared", "shared: the embedding half of the attention's input "
                                    "projections once per batch and flex attention over step "
                                    "0's keys with the later steps' merged in (14%% fewer "
                                    "FLOPs at Kimi-K2.5 size); per-step: each step's in full, "
                                    "keys concatenated (the same logits; for comparison)",
                          choices=list(UNROLLS))
    fp8_gemm: str = arg("off", "the draft's linear layers but lm_head train with FP8 GEMMs "
                               "(e4m3, per-row scales; eagle3/train/fp8.py); experimental: "
                               "fails the gradient criterion of eagle3/train/fp8_check.py by "
                               "~25x, as every recipe with FP8 forward or input-gradient GEMMs "
                               "does (the weight-gradient-only one passes, no faster than bf16: "
                               "BENCHMARKS.md); auto = off on every device until a recipe "
                               "passes the criterion and trains faster; "
                               "eval and the exported draft stay bf16",
                        choices=list(FP8_MODES))
    tensorboard: bool = arg(True, "also log to TensorBoard when the package is installed")
    sglang_version: str | None = arg(None, "SGLang release serving the draft (only needed for "
                                           "capture layers whose first index is not 2)")
    topk_teacher: str = arg("renorm", "files storing a top-k teacher (02b --dtype fp8-topk): "
                                      "renorm = top-k renormalised to 1; tail = the rest of "
                                      "the mass as one bucket", choices=list(TOPK_MODES))

    stream: bool = arg(False, "stream mode: train while `02b ... --stream` extracts, reading "
                              "the train split from --spool in the order this run publishes "
                              "there (eagle3/train/stream.py); start both, in either order")
    spool: Path | None = arg(None, "stream: the spool folder (default <workdir>/02b_spool), "
                                   "the same as 02b's")
    stream_wait_s: float = arg(3600.0, "stream: stop with an error after waiting this long "
                                       "for a 02b that has not been heard from (a restarted "
                                       "02b is waited for until then)")
    gpu_memory_fraction: float = arg(0.0, "cuda: the most of each GPU's memory this run's "
                                          "allocator takes (0 = no limit); for a trainer "
                                          "colocated with the target server, whose "
                                          "--mem-fraction-static takes the rest")
    max_bad: int = arg(10, "hidden-state files skipped as bad (missing, unindexed, unreadable, "
                           "wrong dtype/shape/layout, checksum mismatch, NaN/Inf) before the "
                           "stage stops naming 04_train/skipped.jsonl (-1 = no limit); a few "
                           "cost a few samples, more mean the 02b folder is damaged")

    def __post_init__(self) -> None:
        if self.max_bad < -1:
            raise ValueError("--max-bad must be >= 0, or -1 for no limit")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError("--gpu-memory-fraction must be in [0, 1]")
        if self.ttt_steps < 1:
            raise ValueError("--ttt-steps must be >= 1")
        if self.grad_accum < 1 or self.epochs < 1:
            raise ValueError("--grad-accum and --epochs must be >= 1")
        for name in ("eval_every", "save_every", "log_every", "keep_latest"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def spool_dir(cfg: TrainConfig) -> Path:
    return cfg.spool if cfg.spool is not None else cfg.workdir / SPOOL_DIR


def draft_shape(cfg: TrainConfig, info) -> DraftShape:
    """The draft's attention and MLP: the preset's (its target checked), else the target's."""
    if cfg.preset:
        check_target(cfg.preset, info.hidden_size, info.num_hidden_layers, info.vocab_size)
        return get_preset(cfg.preset).draft
    heads = info.num_attention_heads
    return DraftShape(heads, heads, info.hidden_size // heads, info.intermediate_size)


def build_draft_config(cfg: TrainConfig, info, draft_vocab: int, capture_layers) -> DraftConfig:
    shape = draft_shape(cfg, info)
    base = DraftConfig(
        hidden_size=info.hidden_size,  # serving reuses the target's embedding: same width
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=info.hidden_size,
        rms_norm_eps=info.rms_norm_eps,
        rope_theta=info.rope_theta,
        max_position_embeddings=info.max_position_embeddings,
        capture_layers=list(capture_layers),
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
    )
    # the MLA draft takes the target's own MLA sizes (Kimi-K2.5: kv 512, q 1536, rope 64, 64 heads)
    return base if cfg.draft_arch != "mla" else mla_draft_config(
        base, read_mla_dims(cfg.target), shape.num_attention_heads if cfg.preset else 0)
