"""The embedded tiny target: a few-MB DeepSeek-V3 model and a Kimi-K2-style tokenizer.

Built by the project itself, deterministically, in seconds, so that every stage runs on a CPU
without a model hub. The folder it writes loads through `AutoTokenizer.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` exactly as a real target would.

    python -m eagle3.tiny.target --out runs/demo/target             # random weights (tests)
    python -m eagle3.tiny.target --out runs/demo/target --pretrain  # trained on the demo text

Random weights make greedy decoding loop from the first token, so a draft's acceptance against
them measures nothing; `--pretrain` (the demo's) trains the same architecture briefly on the
demo's conversations (eagle3/tiny/pretrain.py) so that the target has learned behaviour.

The chat template has the shape of Kimi-K2.5's: a `tool_declare` system turn, role headers
`<|im_user|>user<|im_middle|>`, turns closed by `<|im_end|>`, reasoning as `<think>…</think>`
(kept only for assistant turns after the last user message, like Kimi's thinking models),
tool calls in `<|tool_calls_section_begin|>` sections with ids `functions.NAME:IDX`, and tool
results as `## Return of <id>`. Thinking is on by default (`thinking=False` closes an empty
`<think></think>` after the generation prompt).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.tiny.archs import (
    ARCHS,
    QWEN2_SPECIAL_TOKENS,
    build_llama,
    build_qwen2,
    deepseek_v3_serving_fields,
    deepseek_v3_vllm_fields,
    qwen2_text_split,
)

log = logging.getLogger(__name__)

SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
]
END_OF_TURN = "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Whitespace control: `{%-`/`-%}` everywhere, so every character of the output is explicit.
CHAT_TEMPLATE = (
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}"
    "<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n{{ m['content'] }}"
    "<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{%- if m.get('content') -%}{{ m['content'] }}{%- endif -%}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{%- if tc['function']['arguments'] is string -%}{{ tc['function']['arguments'] }}"
    "{%- else -%}{{ tc['function']['arguments'] | tojson(separators=(',', ':')) }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- else -%}"
    "{{ raise_exception('unknown role: ' ~ m['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if not thinking -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)

# Text the tokenizer's BPE merges are learned from: enough variety for chat, code and JSON.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "What is the capital of France? The capital of France is Paris.",
    "Let me think step by step. First, 12 * 7 = 84. Then 84 + 16 = 100.",
    "Hello! How can I help you today? I can answer questions, write code and call tools.",
    "The weather in Paris is sunny with a temperature of 21 degrees.",
    "import json\nimport os\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71",
]


@dataclass
class TinyTargetConfig:
    """Shape of the tiny target. Defaults give ~0.7M parameters and 8 layers."""

    num_hidden_layers: int = 8  # >= 8 so that [2, N//2, N-3] names three distinct layers
    hidden_size: int = 64
    num_attention_heads: int = 4
    intermediate_size: int = 128  # dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    bpe_vocab_size: int = 1024  # BPE vocabulary before the special tokens are added
    max_position_embeddings: int = 4096
    seed: int = 0
    arch: str = "deepseek_v3"  # or "llama", "deepseek_v3_vllm", "qwen2" (eagle3/tiny/archs.py)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown tiny target --arch {self.arch!r}: use one of {ARCHS}")


def build_tokenizer(cfg: TinyTargetConfig):
    """Train a byte-level BPE tokenizer locally and wrap it with the Kimi-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = SPECIAL_TOKENS
    if cfg.arch == "qwen2":  # Qwen2's text split and ChatML tokens (archs.py)
        tok.normalizer, tok.pre_tokenizer = qwen2_text_split()
        special = SPECIAL_TOKENS + QWEN2_SPECIAL_TOKENS
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.bpe_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token=END_OF_TURN,
        pad_token="[PAD]",
        additional_special_tokens=[t for t in special if t not in ("[BOS]", "[PAD]")],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: TinyTargetConfig, vocab_size: int):
    """A randomly initialised DeepseekV3ForCausalLM with MLA and MoE (or `cfg.arch`), seeded."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if cfg.arch in ("llama", "qwen2"):
        model = (build_llama if cfg.arch == "llama" else build_qwen2)(cfg, vocab_size)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # as below
        return model.eval()
    mla = {"kv_lora_rank": 16, "qk_rope_head_dim": 8}
    if cfg.arch == "deepseek_v3_vllm":
        mla = deepseek_v3_vllm_fields()
    model_cfg = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=1,
        n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        **mla,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=cfg.max_position_embeddings,
        **deepseek_v3_serving_fields(cfg.max_position_embeddings),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    model = DeepseekV3ForCausalLM(model_cfg)
    # Random init at std 0.02 gives near-uniform next-token distributions; a larger output
    # scale makes greedy decoding depend on the context, as a trained model's does.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def make_tiny_target(out_dir: Path, cfg: TinyTargetConfig | None = None,
                     pretrain=None) -> Path:
    """Write tokenizer + model to `out_dir` (idempotent: an existing complete folder is kept).

    `pretrain`: a `PretrainConfig` to train the model on the demo text first (None: random
    weights)."""
    cfg = cfg or TinyTargetConfig()
    out_dir = Path(out_dir)
    marker = out_dir / "tiny_target.json"
    wanted = {**cfg.__dict__, "pretrain": None if pretrain is None else pretrain.__dict__}
    if marker.exists() and _marker_key(json.loads(marker.read_text())) == wanted:
        log.info("tiny target already at %s", out_dir)
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(cfg)
    tokenizer.save_pretrained(out_dir)
    model = build_model(cfg, vocab_size=len(tokenizer))
    trained = None
    if pretrain is not None:
        from eagle3.tiny.pretrain import pretrain as run_pretrain

        trained = run_pretrain(model, tokenizer, pretrain)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    marker.write_text(json.dumps({**wanted, "pretrain_result": trained}, indent=1))
    log.info("tiny target written to %s (%d parameters)", out_dir, model.num_parameters())
    return out_dir


def _marker_key(marker: dict) -> dict:
    """The part of tiny_target.json that names what was built (not how long it took)."""
    return {"pretrain": None, **{k: v for k, v in marker.items() if k != "pretrain_result"}}


def main(argv: list[str] | None = None) -> int:
    from eagle3.tiny.pretrain import PretrainConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the target to")
    parser.add_argument("--arch", default=TinyTargetConfig.arch, choices=ARCHS,
                        help="model architecture (default %(default)s; see eagle3/tiny/archs.py)")
    parser.add_argument("--pretrain", action="store_true",
                        help="train the target on the demo text first (CPU, minutes; default: "
                             "random weights, whose greedy output loops)")
    parser.add_argument("--pretrain-steps", type=int, default=PretrainConfig.steps,
                        help="optimizer steps of --pretrain (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    make_tiny_target(args.out, TinyTargetConfig(arch=args.arch),
                     pretrain=PretrainConfig(steps=args.pretrain_steps) if args.pretrain else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
