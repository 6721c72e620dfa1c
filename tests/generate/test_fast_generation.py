"""The fast generation engine (eagle3/generate/fast.py) against transformers' `model.generate`.

Every greedy output is compared with `HFGenerator` (left-padded `model.generate`, DynamicCache)
on the same prompts, in float32 on tiny random models of each supported architecture: the eager
decode step checked here is the one a CUDA graph captures on a GPU (same function, same
bucketed attention length). Then sampling (seeded, top-p), the refusals, the capture fallback,
and 01b end to end with `--hf-engine fast` against `--hf-engine generate`, killed and resumed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from eagle3.generate.fast import FastGenerator, GenerationError, _pick
from eagle3.generate.jobs import GenerationJob, HFGenerator
from eagle3.testing.conversations import synthetic_conversations, write_prepared_stage

LENGTHS = [5, 17, 1, 30, 9, 12, 2]
BUDGETS = [20, 7, 1, 33, 15, 20, 5]
PAD = 0


def _tiny(arch: str, attn: str = "sdpa"):
    """A random 2-layer model of `arch` (GQA 4/2), its output scaled so greedy decoding
    depends on the context (as eagle3/tiny does)."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    assert model.config._attn_implementation == attn
    return model


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompts, budgets, eos: list[int]):
    jobs = [GenerationJob(str(i), "t", p, b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    return HFGenerator(model, eos, PAD).generate(jobs)


def _mid_eos(model, prompts, budgets) -> list[int]:
    """An eos id that ends some rows mid-way: a token greedy decoding writes at step 3 of the
    longest row (found with an eos that never comes)."""
    never = model.config.vocab_size - 1
    first = _reference(model, prompts, budgets, [never])
    return [first[LENGTHS.index(30)][0][3]]


@pytest.fixture(scope="module")
def models(target_model):
    """The tiny targets: Llama (sdpa and eager attention), Qwen2, Qwen3, and the project's
    DeepSeek-V3 (MLA, MoE)."""
    return {"llama": _tiny("llama"), "llama-eager": _tiny("llama", "eager"),
            "qwen2": _tiny("qwen2"), "qwen3": _tiny("qwen3"), "deepseek_v3": target_model}


@pytest.mark.parametrize("name", ["llama", "llama-eager", "qwen2", "qwen3", "deepseek_v3"])
def test_greedy_equals_model_generate_with_mixed_lengths_budgets_and_eos(models, name):
    model = models[name]
    prompts = _prompts(model.config.vocab_size)
    eos = _mid_eos(model, prompts, BUDGETS)
    want = _reference(model, prompts, BUDGETS, eos)
    reasons = [r for _, r in want]
    stopped_early = [len(ids) < b for (ids, r), b in zip(want, BUDGETS) if r == "stop"]
    assert "stop" in reasons and "length" in reasons and any(stopped_early), want
    assert want[LENGTHS.index(1)][0].__len__() == 1  # the budget-1 row
    # 7 prompts in batches of 3 (rows padded to 4, then 1), and all in one batch of 8 rows
    for max_batch in (3, 8):
        gen = FastGenerator(model, eos, PAD, max_batch=max_batch)
        assert gen.generate_ids(prompts, BUDGETS) == want
        assert gen.stats.prompts == 7 and gen.stats.graph_steps == 0


@pytest.mark.parametrize("mode", ["grouped", "expanded", "repeat"])
def test_every_decode_attention_gives_the_tokens_of_generate(models, mode):
    """grouped (the default), expanded (a cache of every query head) and repeat (transformers'
    repeat_kv); the model's attention setting is back to sdpa after every step."""
    model = models["llama"]
    prompts = _prompts(256)
    want = _reference(model, prompts, BUDGETS, [255])
    gen = FastGenerator(model, [255], PAD, max_batch=8, decode_attention=mode)
    assert gen.generate_ids(prompts, BUDGETS) == want
    assert gen._state.kv.keys[0].shape[1] == (4 if mode == "expanded" else 2)  # 4 heads, 2 kv
    assert model.config._attn_implementation == "sdpa"


def test_cache_kept_across_batches_gives_the_outputs_of_a_fresh_one(models):
    """A batch after a longer one reuses its cache (stale slots stay masked): its tokens equal
    those of a generator that starts at that batch, as a resumed 01b run does."""
    model = models["llama"]
    long_batch, short_batch = _prompts(256, [40, 35], seed=2), _prompts(256, [6, 3], seed=3)
    gen = FastGenerator(model, [255], PAD, max_batch=2)
    gen.generate_ids(long_batch, 150)
    slots = gen._state.slots
    got = gen.generate_ids(short_batch, 12)
    assert gen._state.slots == slots  # kept, not reallocated
    assert got == FastGenerator(model, [255], PAD, max_batch=2).generate_ids(short_batch, 12)
    assert got == _reference(model, short_batch, [12, 12], [255])


def test_sampling_is_seeded_varies_with_the_seed_and_tiny_top_p_is_greedy(models):
    model = models["llama"]
    prompts, budgets = _prompts(256), BUDGETS
    gen = FastGenerator(model, [255], PAD, max_batch=4)
    a = gen.generate_ids(prompts, budgets, temperature=1.0, seed=7)
    assert a == gen.generate_ids(prompts, budgets, temperature=1.0, seed=7)
    assert a == FastGenerator(model, [255], PAD, max_batch=4).generate_ids(
        prompts, budgets, temperature=1.0, seed=7)
    assert a != gen.generate_ids(prompts, budgets, temperature=1.0, seed=8)
    assert [len(ids) for ids, _ in a] == budgets  # eos 255 never sampled here: full budgets
    greedy = gen.generate_ids(prompts, budgets)
    assert a != greedy
    assert gen.generate_ids(prompts, budgets, temperature=1.0, top_p=1e-6, seed=7) == greedy


def test_pick_samples_the_softmax_of_the_top_p_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40_000
    logits = probs.log().repeat(n, 1)
    g = torch.Generator().manual_seed(0)
    for top_p, want in ((1.0, probs), (0.7, torch.tensor([0.625, 0.375, 0, 0]))):
        noise = torch.rand(n, 4, generator=g)
        freq = torch.bincount(_pick(logits, 1.0, top_p, noise), minlength=4) / n
        assert torch.allclose(freq, want, atol=0.01), (top_p, freq)
    hot = torch.bincount(_pick(logits, 0.25, 1.0, torch.rand(n, 4, generator=g)),
                         minlength=4) / n  # temperature 0.25: p^4, renormalised
    assert torch.allclose(hot, probs ** 4 / (probs ** 4).sum(), atol=0.01)


def test_capture_failure_falls_back_to_the_eager_step_and_restores_the_state(models,
                                                                               monkeypatch):
    """CUDA stand-ins let `_capture` run its warm-up steps on the CPU, then the capture fails:
    the steps the warm-up took are undone and decoding goes on eagerly, token for token."""
    model = models["llama"]
    prompts = _prompts(256)
    want = FastGenerator(model, [255], PAD, max_batch=8).generate_ids(prompts, BUDGETS)

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    def failing_graph(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: torch.no_grad())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    gen = FastGenerator(model, [255], PAD, max_batch=8)
    gen.cuda_graphs = True  # as on a GPU
    assert gen.generate_ids(prompts, BUDGETS) == want
    assert not gen.cuda_graphs and gen.stats.graphs == 0 and gen.stats.graph_steps == 0
    assert "capture failed" in gen.stats.eager_reason and "stream is capturing" in \
        gen.stats.eager_reason


def test_unsupported_targets_and_settings_are_refused_naming_the_fix(models):
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(GenerationError, match="not 'gpt2'.*--hf-engine generate"):
        FastGenerator(gpt2, [1], PAD)
    sliding = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
        sliding_window=16, max_window_layers=0)
    with pytest.raises(GenerationError, match="full attention in every layer"):
        FastGenerator(transformers.Qwen2ForCausalLM(sliding), [1], PAD)
    with pytest.raises(GenerationError, match="CUDA graphs asked for, but the target is on cpu"):
        FastGenerator(models["llama"], [1], PAD, cuda_graphs=True)
    gen = FastGenerator(models["llama"], [1], PAD)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate_ids([[5]], 3, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=">= 1 token"):
        gen.generate_ids([[]], 3)


# ---------------------------------------------------------------- 01b end to end

def _main(argv: list[str]) -> int:
    return importlib.import_module("01b_generate_synthetic").main(argv)


def _run_01b(workdir: Path, target: Path, *flags: str) -> bytes:
    write_prepared_stage(workdir, {"ds": synthetic_conversations(10)})
    assert _main(["--workdir", str(workdir), "--target", str(target), "--backend", "hf",
                  "--max-new-tokens", "12", "--batch-size", "3", "--log-level", "WARNING",
                  *flags]) == 0
    return (workdir / "01b_generated/ds/tokenized.jsonl").read_bytes()


def test_01b_fast_engine_writes_the_records_of_the_generate_engine(tmp_path, tiny_target_dir):
    fast = _run_01b(tmp_path / "fast", tiny_target_dir)  # the default engine
    assert fast == _run_01b(tmp_path / "gen", tiny_target_dir, "--hf-engine", "generate")
    assert fast.count(b"\n") == 10
    manifest = (tmp_path / "fast/01b_generated/manifest.json").read_text()
    assert '"hf_engine": "fast"' in manifest and '"decode_steps"' in manifest


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_01b_fast_engine_killed_and_resumed_writes_what_an_uninterrupted_run_writes(
        tmp_path, tiny_target_dir, monkeypatch, temperature):
    """Stopped after two of its four batches and re-run (a fresh generator starts at batch 3,
    with a cache of another length): the same files as one run, greedy or sampled."""
    flags = ("--temperature", temperature)
    want = _run_01b(tmp_path / "ref", tiny_target_dir, *flags)
    calls = []
    real = FastGenerator.generate_ids

    def dies_at_batch_3(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(FastGenerator, "generate_ids", dies_at_batch_3)
        with pytest.raises(KeyboardInterrupt):
            _run_01b(tmp_path / "run", tiny_target_dir, *flags)
    out = tmp_path / "run/01b_generated/ds"
    assert (out / "tokenized.jsonl").read_bytes().count(b"\n") == 6
    assert _run_01b(tmp_path / "run", tiny_target_dir, *flags) == want
    assert (out / "raw.jsonl").read_bytes() == \
        (tmp_path / "ref/01b_generated/ds/raw.jsonl").read_bytes()


def test_01b_generate_engine_refuses_sampling(tmp_path, tiny_target_dir, capsys):
    with pytest.raises(SystemExit):
        _run_01b(tmp_path, tiny_target_dir, "--hf-engine", "generate", "--temperature", "1")
    assert "--hf-engine generate is greedy only" in capsys.readouterr().err
