"""Helpers of the self-written source's tests: a tiny target with SmolLM2's ChatML template
(the embedded tiny target has Kimi's), generators that write scripted turns, and a target that
closes its turns early."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

KIMI_OPENING = ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>")
CHATML_OPENING = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n<|im_start|>user\n")
WORDS = ("explain how write a short poem about the sea list three ideas for dinner compare "
         "python and rust summarize this plan translate into french why does ice float what is "
         "a good name for my cat help me fix my code give an example of recursion").split()


def chatml_target(folder: Path) -> Path:
    """SmolLM2's ChatML template (default system prompt) and special tokens over a tiny Llama
    sized to that tokenizer."""
    from dataset_helpers import SMOLLM2_TEMPLATE, build_qwen_like_tokenizer

    from eagle3.tiny.target import TinyTargetConfig, build_model

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    tok = build_qwen_like_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    model = build_model(TinyTargetConfig(arch="llama"), len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def with_template(target: Path, folder: Path, template: str) -> Path:
    """A copy of `target` whose tokenizer has another chat template."""
    shutil.copytree(target, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


class ScriptedGenerator:
    """Writes user requests from a word list (sampled: seeded by the call's seed, the row and the
    prompt) and short replies with reasoning (greedy), each closed by `eot_id`; a text over the
    budget is cut ('length'). Deterministic, varied, and blind to the model."""

    def __init__(self, tokenizer, eot_id: int):
        self.tok, self.eot = tokenizer, eot_id
        self.calls: list[dict] = []

    def generate_ids(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.calls.append({"n": len(prompts), "budget": max_new_tokens,
                           "temperature": temperature, "seed": seed})
        return [self.one(p, row, max_new_tokens, temperature, seed)
                for row, p in enumerate(prompts)]

    def one(self, prompt: list[int], row: int, budget: int, temperature: float,
            seed: int) -> tuple[list[int], str]:
        """The answer to row `row` of a call seeded `seed`."""
        rng = random.Random(f"{seed}/{row}/{zlib.crc32(json.dumps(prompt).encode())}")
        words = " ".join(rng.sample(WORDS, rng.randint(4, 9)))
        text = (f"Please {words}?" if temperature > 0
                else f"<think>They ask to {words}.</think>Here is how to {words}.")
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eot]
        return (ids[:budget], "length") if len(ids) > budget else (ids, "stop")


def scripted_server(tokenizer, eot_id: int, faults=None):
    """A fake SGLang server (eagle3.testing.fake_sglang) answering what `ScriptedGenerator`
    answers in process: the call's seed and the row are read from the rid the server generator
    sends (`sw-<seed:x>-<row>`), so a self-written dataset written through it holds the
    conversations the scripted generator writes."""
    from eagle3.testing.fake_sglang import FakeSGLang

    scripted = ScriptedGenerator(tokenizer, eot_id)

    def answer(body: dict) -> tuple[list[int], str]:
        _, seed, row = body["rid"].split("~")[0].split("-")
        params = body["sampling_params"]
        return scripted.one(body["input_ids"], int(row), params["max_new_tokens"],
                            params.get("temperature", 0.0), int(seed, 16))

    return FakeSGLang(faults, eos_id=eot_id, answer=answer)


class ListGenerator:
    """Answers every prompt with the next of `outputs` ((ids, finish) pairs), in order."""

    def __init__(self, outputs: list[tuple[list[int], str]]):
        self.outputs = list(outputs)

    def generate_ids(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        out, self.outputs = self.outputs[:len(prompts)], self.outputs[len(prompts):]
        return out + [([0], "length")] * (len(prompts) - len(out))


class RepliesClose:
    """Wraps a generator: each greedy reply (temperature 0) becomes `reply_ids` closed by the end
    of turn. A random tiny model whose end of turn is favoured answers a greedy reply with
    nothing but that token (an empty reply ends the conversation); with a closed reply, the
    later user turns are sampled by the wrapped generator (the multi-turn path under a seed)."""

    def __init__(self, inner, reply_ids: list[int], eot_id: int):
        self.inner, self.reply, self.eot = inner, list(reply_ids), eot_id

    def generate_ids(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        out = self.inner.generate_ids(prompts, max_new_tokens, temperature, top_p, seed)
        if temperature > 0:
            return out
        return [(self.reply + [self.eot], "stop") for _ in out]


class Interrupting:
    """Wraps a generator; its call number `at` raises KeyboardInterrupt (a kill mid-round)."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def generate_ids(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner.generate_ids(*args, **kwargs)


def closing_early(load_hf_model, eot_id: int, bias: float = 6.0):
    """`load_hf_model` whose model favours `eot_id` by `bias` logits (an lm_head with a bias): a
    random tiny model then closes most of its user turns within a few tokens, as an
    aligned chat model does."""
    import torch

    def load(*args, **kwargs):
        model = load_hf_model(*args, **kwargs)
        head = model.lm_head
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(head.weight)
            biased.bias.zero_()
            biased.bias[eot_id] = bias
        model.lm_head = biased
        return model

    return load
