"""Fast batched generation with an in-process transformers target: a static KV cache, a
left-padded prefill, then decode steps replayed from CUDA graphs (run eagerly on a CPU).

At temperature 0 `FastGenerator.generate_ids` computes what `model.generate` does (greedy,
`DynamicCache`, left padding: `HFGenerator` in eagle3/generate/jobs.py) with the same model code:
only the keys and values live in preallocated buffers, the mask is a 4D tensor (used as given:
transformers' `masking_utils._preprocess_mask_arguments`), and decode steps attend to a bucket
of cache slots through our sdpa call (eagle3/generate/static_cache.py). Only float rounding may
differ: in float32 the tokens are `generate`'s (tests/generate/test_fast_generation.py; on an
H100, benchmarks/bench_generate.py). In bf16 near-ties flip, as they do in `generate` between
two batch sizes: cuDNN's sdpa rounds differently for another key length (measured on an H100),
so no static-shape engine matches it bit for bit; the benchmark gives the shares.

One batch (gpt-fast `generate.py` is the model):
- rows are padded to the next power of two (at most `max_batch`), the cache to `SLOT_BUCKET`
  slots past prompt width + largest budget, and a cache long enough is kept for the next batch
  of as many rows (01b sends batches longest first: one cache and its graphs serve a dataset);
- prefill: eager forwards of at most `PREFILL_TOKENS` tokens, position ids `cumsum(mask) - 1`
  as `model.generate` sets them, keys and values into slots `[0, width)`;
- decode: each step feeds every row its last token, writes slot `width + t`, attends to the first
  `kv_len` slots (the step's bucket: one graph per bucket), picks the next token on the device
  (argmax, or Gumbel-max with noise drawn outside the graph from a seeded `torch.Generator`)
  and marks rows done on eos or budget. The host looks at the done flags every `SYNC_EVERY`
  steps and reads the tokens once per batch.

Targets (`ARCHS`): Llama, Qwen2, Qwen3 (captured in CUDA graphs) and DeepSeek-V3 (eager: its MoE
routing syncs with the host), with sdpa or eager attention and full attention in every layer;
others are refused (01b: `--hf-engine generate` runs them).

Shapes: R rows (padded), W prompt width, L cache slots, V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, replace

import torch

from eagle3.core.stage import StageError
from eagle3.generate.jobs import GenerationJob, cut_output, seed_of
from eagle3.generate.static_cache import DECODE_ATTENTION, DecodeState, decode_sdpa, new_state

log = logging.getLogger(__name__)

SLOT_BUCKET = 128  # cache and attended lengths are multiples of this: few graph shapes
SYNC_EVERY = 16  # decode steps between two looks of the host at the done flags
PREFILL_TOKENS = 1 << 16  # rows x width of one prefill forward (bounds its activations)
PREFILL_MASK = 1 << 28  # rows x width^2 elements of one prefill forward's mask
DECODE_MODES = ("expanded", "grouped", "repeat")  # FastGenerator's decode_attention
WARMUP_STEPS = 2  # eager steps on the capture stream before each capture (cuBLAS workspaces)
# model_type -> why its decode step cannot be captured in a CUDA graph (None: it can)
ARCHS = {"llama": None, "qwen2": None, "qwen3": None,
         "deepseek_v3": "its MoE routing syncs with the host (nonzero, where)"}


class GenerationError(StageError):
    """The fast generator cannot run this target or batch; the message says why and the fix."""


@dataclass
class GenerationStats:
    """What the generator did so far (read by 01b's summary and the benchmark)."""

    batches: int = 0
    prompts: int = 0
    tokens: int = 0  # output tokens returned (through eos or budget)
    decode_steps: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    graphs: int = 0  # graphs captured
    capture_s: float = 0.0  # warm-up and capture, included in decode_s
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_bytes: int = 0  # size of the current cache
    eager_reason: str | None = None  # why decode steps run eagerly (None: CUDA graphs)


@dataclass(frozen=True)
class _Sampling:
    """How a call picks tokens; temperature and top_p are baked into a captured graph."""

    temperature: float  # 0 = greedy
    top_p: float
    gen: torch.Generator | None  # the seeded source of the noise (None when greedy)


def _bucket(n: int) -> int:
    return -(-n // SLOT_BUCKET) * SLOT_BUCKET


def _pick(logits_RV, temperature: float, top_p: float, noise_RV):
    """The next token per row: argmax (of the logits as they come: a float32 copy, as
    GenerationMixin makes, is exact and keeps their order), or Gumbel-max over the top-p nucleus
    of logits / temperature with `noise_RV` uniform in [0, 1)."""
    if temperature == 0:
        return logits_RV.argmax(-1)
    logits = logits_RV.float()
    logits = logits / temperature
    if top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the smallest set holding top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    tiny = torch.finfo(torch.float32).tiny
    gumbel = -torch.log(-torch.log(noise_RV.clamp(tiny, 1 - 1e-7)))
    return (logits + gumbel).argmax(-1)


class FastGenerator:
    """Batched greedy or sampled generation with a static cache and CUDA-graph decoding.

    `cuda_graphs`: None = capture on a CUDA device when the target allows (else eager, logged);
    True = required (GenerationError otherwise); False = eager. `decode_attention` (sdpa GQA
    targets, eagle3/generate/static_cache.py): `grouped` (a cache of the kv heads: the least
    memory and bytes read per step; bf16 rounding of its own), `expanded` (transformers' sdpa
    call on a cache of every query head: closest to `generate` in bf16) or `repeat`
    (transformers' own: `repeat_kv` copies every step)."""

    def __init__(self, model, eos_ids: list[int], pad_id: int, *, max_batch: int = 256,
                 cuda_graphs: bool | None = None, decode_attention: str = "grouped"):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if decode_attention not in DECODE_MODES:
            raise ValueError(f"decode_attention must be one of {DECODE_MODES}")
        cfg = model.config
        arch = getattr(cfg, "model_type", None)
        if arch not in ARCHS:
            raise GenerationError(f"fast generation supports {', '.join(ARCHS)} targets, not "
                                  f"{arch!r}: use transformers' generate (01b: --hf-engine "
                                  "generate)")
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            raise GenerationError(f"fast generation needs full attention in every layer; this "
                                  f"{arch} target has {sorted(set(cfg.layer_types))} (01b: "
                                  "--hf-engine generate)")
        self.attn = cfg._attn_implementation
        if self.attn not in ("sdpa", "eager"):
            raise GenerationError(f"fast generation runs sdpa or eager attention, not "
                                  f"{self.attn!r}: load the target with one of them")
        self.model, self.pad_id, self.max_batch = model, pad_id, max_batch
        self.eos_ids = list(eos_ids)
        self.device = next(model.parameters()).device
        self.vocab = model.get_output_embeddings().weight.shape[0]
        problem = self._graph_problem(arch)
        if cuda_graphs and problem:
            raise GenerationError(f"CUDA graphs asked for, but {problem}")
        self.cuda_graphs = cuda_graphs is not False and problem is None
        self.stats = GenerationStats(eager_reason=None if self.cuda_graphs
                                     else problem or "CUDA graphs switched off")
        if problem and cuda_graphs is None and self.device.type == "cuda":
            log.warning("fast generation decodes eagerly: %s", problem)
        groups = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None)
                                             or cfg.num_attention_heads)
        gqa = self.attn == "sdpa" and ARCHS[arch] is None and groups > 1
        self.decode_attention = decode_attention if gqa else "repeat"
        self.expand = groups if self.decode_attention == "expanded" else 1
        if self.decode_attention != "repeat":
            from transformers import AttentionInterface

            AttentionInterface.register(DECODE_ATTENTION, decode_sdpa)
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self._state: DecodeState | None = None
        self._stream = None  # the side stream graphs are warmed up and captured on

    def _graph_problem(self, arch: str) -> str | None:
        """Why decode steps cannot be captured here, or None."""
        if self.device.type != "cuda":
            return f"the target is on {self.device.type}, not a CUDA device"
        if ARCHS[arch]:
            return f"a {arch} target's forward cannot be captured: {ARCHS[arch]}"
        rope = getattr(self.model.config, "rope_parameters", None) or {}
        kind = str(rope.get("rope_type", "default")) if isinstance(rope, dict) else "default"
        if "dynamic" in kind or kind == "longrope":
            return f"rope type {kind!r} recomputes its frequencies on the host"
        return None

    # ------------------------------------------------------------------ public API

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: list[int] | int,
                     temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[tuple[list[int], str]]:
        """(output ids, finish reason 'stop'|'length') per prompt, in order; a 'stop' output
        ends with its eos id. temperature 0 = greedy (top_p unused). Sampling is deterministic
        for given prompts, batch order, settings and `seed` (a torch.Generator on the device)."""
        budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                   else list(max_new_tokens))
        if len(budgets) != len(prompts):
            raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
        if any(b < 1 for b in budgets) or any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs >= 1 token and max_new_tokens >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        sampling = _Sampling(temperature, top_p, gen)
        results = []
        # inference_mode around everything, buffers included: no inference tensor is ever
        # touched outside it (an in-place update there would raise)
        with torch.inference_mode():
            for start in range(0, len(prompts), self.max_batch):
                end = start + self.max_batch
                results += self._generate_batch(prompts[start:end], budgets[start:end],
                                                sampling)
        return results

    # ------------------------------------------------------------------ one batch

    def _rows(self, n: int) -> int:
        """Padded row count: the next power of two, at most max_batch (a function of n alone,
        so a batch pads alike in every run)."""
        return max(n, min(1 << (n - 1).bit_length(), self.max_batch))

    def _generate_batch(self, prompts, budgets, sampling: _Sampling):
        width, longest = max(len(p) for p in prompts), max(budgets)
        rows, slots = self._rows(len(prompts)), _bucket(width + longest)
        t0 = time.perf_counter()
        try:
            st = self._state_for(rows, slots, sampling.temperature > 0)
            self._prefill(st, prompts, budgets, sampling)
            t1 = self._sync()
            steps = self._decode(st, width, longest, sampling)
            out = st.out_RL[: len(prompts), :longest].tolist()  # the batch's one read
        except torch.OutOfMemoryError as e:
            self._state = None
            raise GenerationError(
                f"out of GPU memory for a batch of {rows} rows x {slots} cache slots "
                f"({self.decode_attention} decode attention): lower the batch size (01b: "
                "--batch-size) or --max-new-tokens") from e
        results = [cut_output(row, b, self.eos_ids) for row, b in zip(out, budgets)]
        s = self.stats
        s.batches, s.prompts = s.batches + 1, s.prompts + len(prompts)
        s.decode_steps += steps
        s.tokens += sum(len(ids) for ids, _ in results)
        s.prefill_s += t1 - t0
        s.decode_s += time.perf_counter() - t1
        return results

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _state_for(self, rows: int, slots: int, sampling: bool) -> DecodeState:
        """The state for `rows` rows and at least `slots` slots: the current one when it fits,
        else a new one (the old cache and graphs freed first: a cache is GBs)."""
        st = self._state
        if st is None or st.rows != rows or st.slots < slots:
            self._state = st = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            st = self._state = new_state(rows, slots, self.device, self.expand)
        if sampling and st.noise_RV is None:
            st.noise_RV = torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device)
        return st

    def _mask(self, allowed):
        """The 4D mask the model uses as given: bool for sdpa, additive for eager attention."""
        if self.attn == "sdpa":
            return allowed
        dtype = self.model.dtype
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    def _forward(self, st: DecodeState, ids, mask, pos):
        """The last position's logits [rows, V]."""
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          past_key_values=st.kv, use_cache=True, logits_to_keep=1).logits[:, -1]

    def _prefill(self, st: DecodeState, prompts, budgets, sampling: _Sampling) -> None:
        """Left-padded prompts through the model in row chunks; each row's first token into
        out_RL[:, 0]; then the decode state (every graph input is written in place)."""
        rows, dev, width = st.rows, self.device, max(len(p) for p in prompts)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((rows, width), dtype=torch.bool)
        for b, p in enumerate(prompts):  # left padding, as HFGenerator
            ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            real[b, width - len(p):] = True
        ids, real = ids.to(dev), real.to(dev)
        pos = (real.long().cumsum(-1) - 1).masked_fill_(~real, 0)  # as GenerationMixin
        q = torch.arange(width, device=dev)
        causal = q[None, :] <= q[:, None]  # [W, W]: key <= query
        self_only = torch.eye(width, dtype=torch.bool, device=dev)  # no fully masked query
        noise = None
        if sampling.gen is not None:  # drawn for all rows at once, whatever the chunks
            noise = st.noise_RV.uniform_(generator=sampling.gen)
        st.kv.write_at, st.kv.kv_len, st.kv.decoding = q, width, False
        first = torch.empty(rows, dtype=torch.long, device=dev)
        chunk = max(1, min(rows, PREFILL_TOKENS // width, PREFILL_MASK // (width * width)))
        for a in range(0, rows, chunk):
            b = min(a + chunk, rows)
            st.kv.rows = slice(a, b)
            allowed = (causal[None] & real[a:b, None, :]) | self_only[None]
            logits = self._forward(st, ids[a:b], self._mask(allowed[:, None]), pos[a:b])
            first[a:b] = _pick(logits, sampling.temperature, sampling.top_p,
                               None if noise is None else noise[a:b])
        if self.stats.kv_bytes != st.kv.nbytes():
            self.stats.kv_bytes = st.kv.nbytes()
            log.info("fast generation: cache of %d rows x %d slots, %.2f GB; CUDA graphs %s",
                     rows, st.slots, self.stats.kv_bytes / 1e9,
                     "on" if self.cuda_graphs else "off")
        st.kv.rows, st.kv.write_at, st.kv.decoding = slice(None), st.slot_1, True
        st.slot_1.fill_(width)
        st.key_ok_RL.zero_()
        st.key_ok_RL[:, :width] = real
        st.tok_R1.copy_(first[:, None])
        st.pos_R1.copy_(pos[:, -1:] + 1)
        st.out_RL.fill_(self.pad_id)
        st.out_RL[:, 0] = first
        st.n_out_1.fill_(1)
        budget = torch.zeros(rows, dtype=torch.long)
        budget[: len(budgets)] = torch.tensor(budgets, dtype=torch.long)
        st.budget_R.copy_(budget)
        st.done_R.copy_(self._is_eos(first) | (st.budget_R <= 1))

    def _is_eos(self, ids_R):
        return (ids_R[:, None] == self._eos[None, :]).any(-1)

    # ------------------------------------------------------------------ decode

    def _decode(self, st: DecodeState, width: int, longest: int, sampling: _Sampling) -> int:
        """Decode steps until every row is done or the largest budget is spent; the count."""
        steps = 0
        for t in range(longest - 1):  # the prefill gave each row its first token
            if t % SYNC_EVERY == 0 and bool(st.done_R.all()):  # the host's one look per window
                break
            if sampling.gen is not None:  # outside the graph, so that the generator advances
                st.noise_RV.uniform_(generator=sampling.gen)
            self._run_step(st, _bucket(width + t + 1), sampling)
            steps += 1
        return steps

    def _run_step(self, st: DecodeState, kv_len: int, sampling: _Sampling) -> None:
        key = (kv_len, sampling.temperature, sampling.top_p)
        if key not in st.graphs and self.cuda_graphs:
            st.graphs[key] = self._capture(st, kv_len, sampling)
        graph = st.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.stats.graph_steps += 1
        else:
            self._step(st, kv_len, sampling)

    @contextlib.contextmanager
    def _decode_attention(self):
        """Our decode attention for the block's forwards (the config names the
        attention function each layer looks up when it runs)."""
        if self.decode_attention == "repeat":
            yield
            return
        self.model.config._attn_implementation = DECODE_ATTENTION
        try:
            yield
        finally:
            self.model.config._attn_implementation = self.attn

    def _step(self, st: DecodeState, kv_len: int, sampling: _Sampling) -> None:
        """One decode step on static tensors only: what a graph captures and what the eager
        loop runs. `kv_len` (a Python int) is baked into a captured graph: one per bucket."""
        st.kv.kv_len = kv_len
        st.key_ok_RL.index_fill_(1, st.slot_1, True)  # the fed token sees itself
        with self._decode_attention():
            logits = self._forward(st, st.tok_R1, self._mask(st.key_ok_RL[:, None, None, :kv_len]),
                                   st.pos_R1)
        nxt = _pick(logits, sampling.temperature, sampling.top_p, st.noise_RV)
        st.out_RL.index_copy_(1, st.n_out_1, nxt[:, None])
        st.n_out_1.add_(1)
        st.done_R.logical_or_(self._is_eos(nxt) | (st.n_out_1 >= st.budget_R))
        st.tok_R1.copy_(nxt[:, None])
        st.pos_R1.add_(1)
        st.slot_1.add_(1)

    def _capture(self, st: DecodeState, kv_len: int, sampling: _Sampling):
        """A CUDA graph of `_step` at `kv_len`, warmed up and captured on a side stream, or None
        when capture fails (logged; every later step runs eagerly). The warm-up steps advance
        the state: it is saved and put back, so decoding goes on where it was (the slots they
        wrote are masked until a real step writes them again)."""
        saved = [t.clone() for t in st.loop_tensors()]
        t0 = time.perf_counter()
        graph = None
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            if st.pool is None:  # one pool for the state's graphs: no tensor outlives a replay
                st.pool = torch.cuda.graph_pool_handle()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for _ in range(WARMUP_STEPS):
                    self._step(st, kv_len, sampling)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=st.pool, stream=self._stream):
                self._step(st, kv_len, sampling)
            torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError:  # a RuntimeError, but the batch's, not the capture's
            raise
        except RuntimeError as e:  # torch reports capture faults (a host sync, ...) this way
            graph, self.cuda_graphs = None, False
            self.stats.eager_reason = (f"CUDA graph capture failed at {kv_len} slots "
                                       f"({type(e).__name__}: {str(e)[:300]})")
            log.warning("%s; decoding eagerly from here on", self.stats.eager_reason)
        finally:
            for dst, src in zip(st.loop_tensors(), saved):
                dst.copy_(src)
        self.stats.capture_s += time.perf_counter() - t0
        self.stats.graphs += graph is not None
        log.debug("captured the decode step at %d slots (rows %d) in %.2fs", kv_len, st.rows,
                  time.perf_counter() - t0)
        return graph


class FastJobGenerator:
    """The hf backend's default engine (`--hf-engine fast`): `eagle3.generate.fast.
    FastGenerator` on jobs, greedy or sampled. A sampled batch draws from a seed of its first
    record id, so a resumed run (the same fixed batches) writes what an uninterrupted one did."""

    def __init__(self, model, eos_ids: list[int], pad_id: int, batch_size: int,
                 temperature: float = 0.0):
        self.fast = FastGenerator(model, eos_ids, pad_id, max_batch=batch_size)
        self.temperature = temperature

    def generate(self, jobs: list[GenerationJob]) -> list[tuple[list[int], str]]:
        return self.fast.generate_ids([j.prompt_ids.tolist() for j in jobs],
                                      [j.max_new_tokens for j in jobs], self.temperature,
                                      seed=seed_of(jobs[0].id))

    def take_stats(self) -> dict:
        """The engine's counts since the last call (`GenerationStats`: graphs, steps, times)."""
        stats = self.fast.stats
        self.fast.stats = replace(type(stats)(), kv_bytes=stats.kv_bytes,
                                  eager_reason=stats.eager_reason)
        return asdict(stats)
