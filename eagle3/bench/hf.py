"""Stage 05 with the `hf` backend: offline, against a transformers target.

Plain decoding (the reference output and the baseline throughput) and chain speculative decoding
for each step count, per prompt. At temperature 0 the speculative output must equal greedy
decoding token for token; at temperature > 0 it is speculative sampling
(eagle3/bench/evaluate.py). Acceptance is aggregated the way SGLang reports it: committed tokens
over verify passes, over all prompts, plus the per-position acceptance rate (share of verify
passes that accepted at least i draft tokens). Every output's token ids are kept; next to every
acceptance length stand the loop share of the outputs and the acceptance of the rounds before
each output's first loop (eagle3/core/loops.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3.bench import sglang
from eagle3.bench.config import BenchmarkConfig, DraftCheck
from eagle3.bench.context import acceptance_by_context
from eagle3.bench.evaluate import (
    Eagle3Proposer,
    TargetRunner,
    autoregressive_decode,
    speculative_decode,
)
from eagle3.bench.faults import PartialRun
from eagle3.bench.prompts import PromptSet
from eagle3.core.faults import Interrupted
from eagle3.core.loops import loop_stats, loop_summary
from eagle3.core.progress import progress
from eagle3.core.target import load_embedding, load_hf_model
from eagle3.draft.export import load_draft

log = logging.getLogger(__name__)

# The draft folder and the preflight are SGLang's (04's final/ is the folder SGLang serves).
default_draft = sglang.default_draft
check_only = sglang.check_only


def check_draft(cfg: BenchmarkConfig, draft_dir: Path) -> DraftCheck:
    """The draft folder, its layers on the SGLang release named by --sglang-version."""
    return sglang.check_draft(cfg, draft_dir)


def measure(cfg: BenchmarkConfig, draft_dir: Path, sets: list[PromptSet], stage_dir: Path,
            renderer, check: DraftCheck, stop=None) -> dict:
    """Every prompt set, plain and speculative at each --steps; the results dict. `stop` (a
    StopSignals) is checked between prompts: a signal raises PartialRun with the prompt sets
    finished before it."""
    if stop is not None:
        stop.polled = True  # a prompt takes seconds: finish it, then stop
    dtype = getattr(torch, cfg.dtype)
    model = load_hf_model(cfg.target, cfg.dtype, cfg.device, cfg.trust_remote_code)
    draft = load_draft(draft_dir, cfg.device, dtype)
    embed = load_embedding(cfg.target).to(cfg.device, dtype)
    eos = {renderer.end_of_turn_id}
    out = {}
    for ps in sets:
        bar = progress(total=len(ps.prompts), desc=f"05 {ps.name}", unit="prompt")
        try:
            out[ps.name] = run_offline(model, draft, embed, ps, cfg.steps, cfg.max_new_tokens,
                                       eos, bar, cfg.temperature, cfg.seed, stop)
        except Interrupted as e:
            raise PartialRun(e.signum, {"temperature": cfg.temperature, "prompt_sets": out}) \
                from None
        finally:
            bar.close()
        for m in out[ps.name]["steps"].values():  # the table at the requested bucket width
            m["acceptance_by_context"] = acceptance_by_context(
                m["accept_lengths"], m["round_contexts"], cfg.context_bucket_tokens)
    peak = (torch.cuda.max_memory_allocated(torch.device(cfg.device))
            if torch.device(cfg.device).type == "cuda" else None)
    return {"temperature": cfg.temperature, "prompt_sets": out, "peak_gpu_bytes": peak}


def per_position_rates(accept_lengths: list[int], steps: int) -> list[float]:
    """Share of verify passes whose accepted draft count is >= i, for i = 1..steps."""
    n = max(len(accept_lengths), 1)
    return [sum(1 for a in accept_lengths if a - 1 >= i) / n for i in range(1, steps + 1)]


def run_offline(model, draft, embed, prompt_set: PromptSet, steps_list: list[int],
                max_new_tokens: int, eos: set[int], bar=None, temperature: float = 0.0,
                seed: int = 0, stop=None) -> dict:
    """Baseline + speculative runs of one prompt set; returns its results dict. `stop` (a
    StopSignals): checked before each prompt (Interrupted)."""
    capture = draft.cfg.capture_layers
    proposer = Eagle3Proposer(draft, embed)
    base, spec = [], {s: [] for s in steps_list}
    for i, prompt in enumerate(prompt_set.prompts):
        if stop is not None:
            stop.check()
        gen = sampling_generator(seed, i)
        base.append(autoregressive_decode(TargetRunner(model, [0]), prompt, max_new_tokens, eos,
                                          temperature, gen))
        for s in steps_list:
            gen = sampling_generator(seed, i)
            spec[s].append(speculative_decode(model, proposer, prompt, max_new_tokens, eos, s,
                                              capture, temperature, gen))
        if bar is not None:
            bar.update(1)
    base_tokens = sum(len(r.output_ids) for r in base)
    out = {"prompts": len(prompt_set.prompts), "prompt_ids": prompt_set.ids,
           "temperature": temperature, "baseline_tokens": base_tokens,
           "baseline_tok_s": base_tokens / max(sum(r.seconds for r in base), 1e-9),
           "baseline_outputs": [r.output_ids for r in base],
           "baseline_loop_share": loop_stats([r.output_ids for r in base], eos).share,
           "steps": {}}
    for s, results in spec.items():
        out["steps"][str(s)] = _offline_steps(results, base, s, out["baseline_tok_s"],
                                              temperature, eos)
    return out


def sampling_generator(seed: int, prompt_index: int) -> torch.Generator:
    """The CPU generator (where sampling happens) of one prompt's decode: baseline and every
    step count of prompt `prompt_index` draw from the same seed, so greedy runs stay lossless
    and sampled runs are comparable."""
    return torch.Generator().manual_seed(seed + prompt_index)


def offline_summary(results, baseline_outputs: list[list[int]], steps: int,
                    baseline_tok_s: float, temperature: float,
                    eos: set[int] | None = None) -> dict:
    """Acceptance length (tokens per verify round), per-position acceptance, tok/s, speedup,
    (greedy only) outputs that differ from plain decoding, and the loop share and loop-free
    acceptance beside them (eagle3/core/loops.py; a trailing `eos` id is not counted), for one
    step count's decode results (`speculative_decode` answers, one per prompt, in the
    baseline's order)."""
    lengths = [a for r in results for a in r.accept_lengths]
    tok_s = sum(len(r.output_ids) for r in results) / max(sum(r.seconds for r in results), 1e-9)
    mismatches = None  # sampling: outputs differ from the baseline's by design
    if temperature == 0:
        mismatches = sum(1 for r, g in zip(results, baseline_outputs) if r.output_ids != g)
        if mismatches:
            log.error("steps %d: %d of %d outputs differ from greedy decoding", steps, mismatches,
                      len(results))
    return {
        "acceptance_length": sum(lengths) / max(len(lengths), 1),
        "verify_passes": len(lengths),
        "per_position_acceptance": per_position_rates(lengths, steps),
        "tok_s": tok_s,
        "speedup": tok_s / baseline_tok_s,
        "lossless_mismatches": mismatches,
        **loop_summary([r.output_ids for r in results], [r.accept_lengths for r in results],
                       eos),
        "acceptance_by_context": acceptance_by_context([r.accept_lengths for r in results],
                                                       [r.round_contexts for r in results]),
    }


def _offline_steps(results, base, steps: int, base_tok_s: float, temperature: float,
                   eos: set[int]) -> dict:
    return {**offline_summary(results, [g.output_ids for g in base], steps, base_tok_s,
                              temperature, eos),
            "outputs": [r.output_ids for r in results],
            "accept_lengths": [r.accept_lengths for r in results],
            "round_contexts": [r.round_contexts for r in results]}
