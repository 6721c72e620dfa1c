"""Stage 05, shared by the server backends: the speculative servers' levels against the
baseline's, per prompt set and concurrency: their speedups (`combine`) and, at temperature 0,
their outputs (`check_lossless`).

Outputs at temperature 0, over the prompts both sides answered (a failed request compares
nothing):
- a speculative level's `lossless_mismatches`: its requests whose output is none of the
  baseline's outputs of that prompt at the same concurrency (of `lossless_compared`);
  `mismatch_share`: the share of prompts with such a request (`mismatch_prompts` of
  `mismatch_compared`);
- the baseline level's `plain_noise_share`: the share of prompts whose plain output at this
  concurrency is none of the plain outputs at `plain_noise_reference`, the lowest concurrency
  measured (0 there by construction; `plain_noise_prompts` of `plain_noise_compared`). In bf16
  a server's kernels change with the batch, so near-ties flip between batch sizes and plain
  disagrees with itself (BENCHMARKS.md, "Served speedup: SGLang on one H100"): the baseline is
  measured at every level anyway, so its own levels give this noise for free;
- `within_plain_noise` of a speculative level with mismatches: True when its share is no larger
  than the plain noise at the same concurrency (what batch size alone does to plain outputs,
  not a draft bug), False beyond it (an error: exit code 1); None without mismatches or when
  sampling.
"""

from __future__ import annotations

BASELINE = "baseline"


def speedup_error(base: dict | None, spec: dict | None) -> str | None:
    """Why a level has no speedup (None: it has one): a side measured nothing, so the ratio
    would be a 0 or a division, not a measurement."""
    for role, s in ((BASELINE, base), ("speculative", spec)):
        if s is None:
            return f"no {role} level measured"
        if not s["requests"] or s["total_tok_s"] <= 0:
            failed = s.get("failed_requests", 0)
            return (f"every {role} request failed ({failed} in failed_requests.jsonl)"
                    if failed else f"no {role} request measured")
    return None


def ratios(base: dict | None, spec: dict | None) -> dict:
    """{speedup, per_request_speedup, speedup_error} of one speculative level over the
    baseline's; the speedups None, with the reason, when a side measured nothing."""
    error = speedup_error(base, spec)
    if error is not None:
        return {"speedup": None, "per_request_speedup": None, "speedup_error": error}
    return {"speedup": spec["total_tok_s"] / base["total_tok_s"],
            "per_request_speedup": spec["per_request_tok_s"] / base["per_request_tok_s"],
            "speedup_error": None}


def combine(baseline: dict, speculative: dict, others: dict | None = None) -> dict:
    """{set: {concurrency: {baseline, speculative, speedup, per_request_speedup,
    speedup_error}}} of the first speculative server; with `others` ({role: its levels}, the
    further speculative servers, SGLang) each row also holds every other role's summary under
    its role and `settings`: {role: its ratios} for every speculative role, the first too."""
    out = {}
    for name, levels in speculative.items():
        out[name] = {}
        for c, spec in levels.items():
            base = baseline.get(name, {}).get(c)
            row = {BASELINE: base, "speculative": spec, **ratios(base, spec)}
            if others is not None:
                row["settings"] = {"speculative": ratios(base, spec)}
                for role, sets in others.items():
                    row[role] = sets.get(name, {}).get(c)
                    row["settings"][role] = ratios(base, row[role])
            out[name][c] = row
    return out


def _differs(outputs: list[list[int]], against: list[list[int]]) -> bool:
    return any(ids not in against for ids in outputs)


def prompt_mismatches(outputs: dict, against: dict) -> tuple[int, int]:
    """(prompts with an output none of `against`'s for that prompt, prompts compared); both
    {prompt index: [output ids of each request]}."""
    common = [p for p in outputs if p in against]
    return sum(_differs(outputs[p], against[p]) for p in common), len(common)


def _share(n: int, of: int) -> float | None:
    return n / of if of else None


def mark_plain_noise(levels: dict) -> None:
    """`plain_noise_*` of each baseline level of one prompt set: against its lowest level."""
    if not levels:
        return
    ref = min(levels, key=int)
    for s in levels.values():
        n, of = prompt_mismatches(s["outputs"], levels[ref]["outputs"])
        s.update(plain_noise_reference=ref, plain_noise_prompts=n, plain_noise_compared=of,
                 plain_noise_share=_share(n, of))


def mark_mismatches(spec: dict, base: dict) -> int:
    """`lossless_*`, `mismatch_*` and `within_plain_noise` of one speculative level against
    the baseline's at the same concurrency; its mismatched requests."""
    pairs = [(ids, base["outputs"][p]) for p, outs in spec["outputs"].items()
             if p in base["outputs"] for ids in outs]
    spec["lossless_compared"] = len(pairs)
    spec["lossless_mismatches"] = bad = sum(ids not in plain for ids, plain in pairs)
    n, of = prompt_mismatches(spec["outputs"], base["outputs"])
    share = _share(n, of)
    spec.update(mismatch_prompts=n, mismatch_compared=of, mismatch_share=share,
                within_plain_noise=(share <= (base.get("plain_noise_share") or 0.0)
                                    if bad else None))
    return bad


def check_lossless(measured: dict, temperature: float) -> tuple[int | None, list[str]]:
    """At temperature 0, every speculative role's levels against the baseline's (the module
    docstring): (the mismatched requests of all roles, preflight notes: an error for those
    beyond the plain noise, a note for those within it). None above temperature 0. Every
    summary's outputs then become a list in prompt order (a prompt's first request)."""
    total = beyond = None
    if temperature == 0:
        total = beyond = 0
        for levels in measured[BASELINE].values():
            mark_plain_noise(levels)
        speculative = {role: sets for role, sets in measured.items() if role != BASELINE}
        for sets in speculative.values():
            for name, levels in sets.items():
                for c, spec in levels.items():
                    bad = mark_mismatches(spec, measured[BASELINE][name][c])
                    total += bad
                    beyond += bad if spec["within_plain_noise"] is False else 0
    for sets in measured.values():
        for levels in sets.values():
            for s in levels.values():
                s["outputs"] = [s["outputs"][p][0] for p in sorted(s["outputs"])]
    notes = []
    if beyond:
        notes.append(f"error: {beyond} speculative outputs differ from the baseline's at "
                     "temperature 0: the speculative server does not decode losslessly (see "
                     "report.md)")
    if total and total > beyond:
        notes.append(f"{total - beyond} speculative outputs differ from the baseline's at "
                     "temperature 0 within the share of plain outputs that differ between the "
                     "baseline's own concurrency levels (batch-size noise, not a draft bug; "
                     "see report.md)")
    return total, notes


def beyond_noise(summary: dict) -> bool:
    """A speculative level whose outputs differ from plain's beyond plain's own noise (results
    written before the noise was measured: any mismatch)."""
    return bool(summary.get("lossless_mismatches")) and summary.get("within_plain_noise") \
        is not True
