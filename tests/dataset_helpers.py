"""Test helpers for dataset preparation: the fixture sources and other tokenizer shapes.

- `FIXTURES`: every file of tests/fixtures/datasets/ (a few rows of each public source in its
  own schema) with its adapter; `fixture_conversations()` loads them as conversation records.
- A second chat-template shape, ChatML like Qwen3's thinking models: `<think>\\n` closes the
  generation prompt, reasoning is kept only for assistant turns after the last user query (and
  the last turn always shows a think block), tool calls are `<tool_call>` JSON blocks and tool
  results `<tool_response>` blocks inside a user turn.
- A SentencePiece-style tokenizer (Metaspace, `prepend_scheme="first"`) that marks the start
  of a text, with the tiny target's template.

All built on locally trained BPEs, so that tests need no model hub.
"""

from __future__ import annotations

from pathlib import Path

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "datasets"
# file -> (adapter, mode)
FIXTURES = {
    "sharegpt_vicuna.jsonl": ("sharegpt", "keep"),
    "open_perfectblend.jsonl": ("sharegpt", "keep"),
    "openthoughts.jsonl": ("sharegpt", "keep"),
    "ultrachat_200k.parquet": ("openai", "keep"),
    "nemotron_post_training.jsonl": ("openai", "keep"),
    "llama_nemotron.jsonl": ("openai", "keep"),
    "openhands_traces.jsonl": ("openai", "keep"),
    "magicoder.jsonl": ("instruction_response", "keep"),
    "opencodereasoning.jsonl": ("input_output", "keep"),
    "codefeedback.jsonl": ("query_answer", "keep"),
    "xlam_function_calling.json": ("xlam", "keep"),
    "glaive_function_calling_v2.json": ("glaive", "keep"),
    "hermes_function_calling.json": ("hermes", "keep"),
    "swe_agent_trajectories.parquet": ("swe_agent", "keep"),
    "prompts_only.jsonl": ("sharegpt", "prompt_only"),
}


def fixture_rows(name: str) -> list[dict]:
    """The rows of one fixture file, parsed."""
    from eagle3.prepare.sources import LocalSource, parse_row

    src = LocalSource(FIXTURE_DIR / name)
    return [parse_row(payload)[0] for _, payload in src.rows(range(len(src)))]


def fixture_conversations(modes: tuple = ("keep",)) -> dict[str, list[dict]]:
    """{fixture file: its conversation records} for the fixtures of the given modes."""
    from eagle3.prepare.conversations import to_conversation

    out = {}
    for name, (adapter, mode) in FIXTURES.items():
        if mode in modes:
            out[name] = [to_conversation(r, Path(name).stem, adapter, None, mode)
                         for r in fixture_rows(name)]
    return out

QWEN_LIKE_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(looking=true, last_query=messages|length - 1) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- set index = (messages|length - 1) - loop.index0 -%}"
    "{%- if ns.looking and m.role == 'user' -%}"
    "{%- set ns.looking = false -%}{%- set ns.last_query = index -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- if m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{%- if (loop.first and content) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' -}}"
    "{%- if tc.function.arguments is string -%}{{- tc.function.arguments -}}"
    "{%- else -%}{{- tc.function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)

QWEN_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN_ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                     "</tool_response>"]


def build_qwen_like_tokenizer():
    """The tiny target's BPE with ChatML special tokens and the Qwen-like template."""
    from tokenizers import AddedToken

    from eagle3.tiny.target import TinyTargetConfig, build_tokenizer

    tok = build_tokenizer(TinyTargetConfig())
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS})
    # Like Qwen3: the reasoning and tool tags are added tokens that are not "special".
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_LIKE_TEMPLATE
    return tok


def build_metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace, prepend_scheme="first") with the Kimi-style
    template: text after an added token is not tokenized as the start of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eagle3.tiny.target import _CORPUS, CHAT_TEMPLATE, END_OF_TURN, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token=END_OF_TURN, pad_token="[PAD]",
        unk_token="[PAD]",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[BOS]", "[PAD]")])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def code_shipping_target(tiny_target_dir, folder):
    """The tiny target with its tokenizer shipped as code (`auto_map`), as Kimi-K2.5's is."""
    import json
    import shutil

    shutil.copytree(tiny_target_dir, folder)
    (folder / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "CustomTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    cfg_path.write_text(json.dumps(cfg))
    return folder


# SmolLM2-135M-Instruct's chat template, as its GGUF ships it (eagle3/smollm2/target.py): ChatML
# with a default system prompt; it renders message text only (no tools, no tool calls).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml_target(tiny_target_dir, folder):
    """The tiny target with SmolLM2's ChatML template and special tokens: a target whose
    template renders no tool declarations and no tool calls."""
    import shutil

    shutil.copytree(tiny_target_dir, folder)
    tok = build_qwen_like_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    tok.save_pretrained(folder)
    return folder
