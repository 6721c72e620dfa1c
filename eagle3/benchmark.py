"""Stage 05 offline (`--backend hf`): acceptance length of a draft on held-out prompts.

Runs plain greedy decoding (the reference output and the baseline throughput) and chain
speculative decoding for each step count, checks the speculative output equals the greedy one
token for token, and aggregates acceptance the way SGLang reports it: committed tokens over
verify passes, over all prompts, plus the per-position acceptance rate (share of verify passes
that accepted at least i draft tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagle3.evaluate import Eagle3Proposer, greedy_decode, speculative_decode

log = logging.getLogger(__name__)


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]


def per_position_rates(accept_lengths: list[int], steps: int) -> list[float]:
    """Share of verify passes whose accepted draft count is >= i, for i = 1..steps."""
    n = max(len(accept_lengths), 1)
    return [sum(1 for a in accept_lengths if a - 1 >= i) / n for i in range(1, steps + 1)]


def run_offline(model, draft, embed, prompt_set: PromptSet, steps_list: list[int],
                max_new_tokens: int, eos: set[int], bar=None) -> dict:
    """Greedy baseline + speculative runs; returns the results dict of one prompt set."""
    capture = draft.cfg.capture_layers
    proposer = Eagle3Proposer(draft, embed)
    greedy, spec = [], {s: [] for s in steps_list}
    for prompt in prompt_set.prompts:
        ref = greedy_decode(model, prompt, max_new_tokens, eos)
        greedy.append(ref)
        for s in steps_list:
            spec[s].append(speculative_decode(model, proposer, prompt, max_new_tokens, eos, s,
                                              capture))
        if bar is not None:
            bar.update(1)
    base_tokens = sum(len(r.output_ids) for r in greedy)
    base_seconds = sum(r.seconds for r in greedy)
    out = {"prompts": len(prompt_set.prompts), "baseline_tokens": base_tokens,
           "baseline_tok_s": base_tokens / max(base_seconds, 1e-9), "steps": {}}
    for s, results in spec.items():
        lengths = [a for r in results for a in r.accept_lengths]
        tokens = sum(len(r.output_ids) for r in results)
        seconds = sum(r.seconds for r in results)
        mismatches = sum(1 for r, g in zip(results, greedy) if r.output_ids != g.output_ids)
        out["steps"][str(s)] = {
            "acceptance_length": sum(lengths) / max(len(lengths), 1),
            "verify_passes": len(lengths),
            "per_position_acceptance": per_position_rates(lengths, s),
            "tok_s": tokens / max(seconds, 1e-9),
            "speedup": (tokens / max(seconds, 1e-9)) / out["baseline_tok_s"],
            "lossless_mismatches": mismatches,
        }
        if mismatches:
            log.error("steps %d: %d of %d outputs differ from greedy decoding", s, mismatches,
                      len(results))
    return out


def report_markdown(results: dict) -> str:
    """A report.md table of every prompt set and step count."""
    lines = ["# 05 benchmark (offline, hf backend)", "",
             "| prompt set | steps | acceptance length | per-position acceptance | "
             "spec tok/s | baseline tok/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results["prompt_sets"].items():
        for s, m in r["steps"].items():
            rates = ", ".join(f"{x:.2f}" for x in m["per_position_acceptance"])
            lines.append(f"| {name} | {s} | {m['acceptance_length']:.3f} | {rates} | "
                         f"{m['tok_s']:.1f} | {r['baseline_tok_s']:.1f} | {m['speedup']:.2f} | "
                         f"{'yes' if m['lossless_mismatches'] == 0 else 'NO'} |")
    return "\n".join(lines) + "\n"
