"""Stage 05 report: `report.md` tables and PNG plots from `results.json`.

SGLang results: the verdict (the fastest speculative setting per prompt set and concurrency,
and the SGLang flags to serve it, or plain; eagle3/bench/verdict.py), then per prompt set one
row per concurrency level and setting (acceptance length, loop share, speedup, tokens/s in total
and per request, TTFT, outputs differing from plain beside plain differing from itself across
concurrencies) and two plots, speedup and acceptance length against concurrency, a line per
prompt set and setting. vLLM results: the same table and plots, acceptance from vLLM's `/metrics`
counters (1 + accepted / drafts) with the tokens per verify round counted from the outputs, the
per-position acceptance and the loop share beside it. Offline (hf) results: per prompt set,
one row per chain length (acceptance length, loop share, loop-free acceptance, ...) and a plot
of the acceptance length against the chain length.

A run with faults says so: the prompt-set lines skipped (skipped.jsonl), the requests that failed
for good per level (failed_requests.jsonl; in no figure), a level whose acceptance cannot be
figured ("-", with the reason: `acceptance_error`), a level whose speculative outputs differ from
the baseline's at temperature 0 (NOT lossless), and a run stopped by a signal is titled PARTIAL.
"""

from __future__ import annotations

from eagle3.bench.compare import beyond_noise
from eagle3.bench.verdict import verdict_markdown, verdict_rows
from eagle3.core.loops import MAX_PERIOD, MIN_REPEATS, MIN_SPAN

LOOP_RULE = (f"eagle3/core/loops.py: a unit of 1-{MAX_PERIOD} tokens repeated >= {MIN_REPEATS} "
             f"times over >= {MIN_SPAN} tokens")

MEASURED = f"""How these figures are measured (our own requests only): total tok/s = sum of
completion_tokens / wall time of the level; per-request tok/s = mean of completion_tokens /
client latency; TTFT = client time to the first streamed chunk carrying a token; acceptance
length = sum(completion_tokens) / sum(spec_verify_ct); speedup = speculative total tok/s /
baseline total tok/s at the same concurrency; loop share = share of output tokens inside
repetition loops ({LOOP_RULE}), where a draft's acceptance is inflated. Each level sends
max(prompts, 2 x concurrency) requests, prompts cycled."""

NOISE = """Outputs at temperature 0: "outputs differing from plain" = prompts whose speculative
output is none of the plain outputs at the same concurrency; "plain differing from its lowest
concurrency" = prompts whose plain output differs from the plain output at the lowest
concurrency measured (0 there by construction): bf16 kernels change with the batch, so plain
disagrees with itself. A speculative share within plain's own at that concurrency is that noise,
not a draft bug (eagle3/bench/compare.py)."""

LOOPS = f"""Loop share: share of generated tokens inside repetition loops ({LOOP_RULE}), where
any draft is accepted trivially. Loop-free acceptance: the acceptance length over the verify rounds before each output's first
loop; when the two acceptance figures differ, the loop-free one is what the draft has learned."""


def _f(x, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _speedup(x) -> str:
    """Speedups below 1 are flagged: the draft makes serving slower."""
    return "-" if x is None else (f"**{x:.2f} (slower)**" if x < 1 else f"{x:.2f}")


def report_markdown(results: dict) -> str:
    """report.md for either backend."""
    if results.get("backend") == "sglang":
        return _sglang_markdown(results)
    if results.get("backend") == "vllm":
        return _vllm_markdown(results)
    return _offline_markdown(results)


def _header(results: dict, title: str) -> list[str]:
    lines = [f"# {title}", ""]
    if results.get("partial"):
        lines += [f"**PARTIAL: stopped by {results.get('stopped_by')}; only the levels finished "
                  "before it are shown. Re-run the same command for a full run.**", ""]
        only = results.get("baseline_only") or {}
        lines += [f"- measured on the baseline only: {name} c={', '.join(levels)}"
                  for name, levels in only.items()]
    lines.append(f"- draft: `{results.get('draft')}`")
    if results.get("skipped"):
        lines.append(f"- prompt-set lines skipped: {results['skipped']} "
                     f"({results.get('skip_reasons')}; `{results.get('skip_list')}`)")
    if results.get("failed_requests"):
        lines.append(f"- requests failed for good (left out of every figure): "
                     f"{results['failed_requests']} (`{results.get('failed_requests_file')}`)")
    if results.get("layers"):
        lines.append(f"- layers: {results['layers']}")
    for p in results.get("preflight", []):
        lines.append(f"- preflight {p}")
    return lines


def _sglang_markdown(results: dict) -> str:
    lines = _header(results, "05 benchmark (SGLang)")
    for role, info in results.get("servers", {}).items():
        setting = f"{info['label']}: " if info.get("label") else ""
        lines.append(f"- {role} server: {info.get('url')} (SGLang {info.get('version')}, "
                     f"{setting}{info.get('speculative') or 'no draft'})")
        if info.get("layers"):
            lines.append(f"- served draft reads: {info['layers']}")
    lines += [f"- sampling: {results.get('sampling_params')}, streaming: "
              f"{results.get('stream')}", _lossless_line(results), ""]
    lines += verdict_markdown(results)
    for name, levels in results["prompt_sets"].items():
        lines += [f"## {name} ({results.get('prompts', {}).get(name, '?')} prompts)", "",
                  "| concurrency | setting | acceptance length | loop share | speedup | spec tok/s | "
                  "baseline tok/s | spec tok/s per request | baseline tok/s per request | "
                  "TTFT spec / baseline (ms) | outputs differing from plain | plain differing "
                  "from its lowest concurrency |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, row in levels.items():
            b = row["baseline"] or {}
            for _, name_, s, ratios in level_settings(results, row):
                lines.append(
                    f"| {c} | {name_} | {_f(s['acceptance_length'], '.3f')} | "
                    f"{_f(s.get('loop_share'), '.3f')} | {_speedup(ratios.get('speedup'))} | "
                    f"{_f(s['total_tok_s'], '.1f')} | {_f(b.get('total_tok_s'), '.1f')} | "
                    f"{_f(s['per_request_tok_s'], '.1f')} | "
                    f"{_f(b.get('per_request_tok_s'), '.1f')} | "
                    f"{_f(s['ttft_mean_s'], '.0f', 1e3)} / {_f(b.get('ttft_mean_s'), '.0f', 1e3)}"
                    f" | {_of(s, 'mismatch_prompts', 'mismatch_compared')} | "
                    f"{_of(b, 'plain_noise_prompts', 'plain_noise_compared')} |")
        lines += _fault_notes(levels, results) + [""]
    lines += [MEASURED, "", NOISE, ""]
    return "\n".join(lines)


def level_settings(results: dict, row: dict) -> list[tuple[str, str, dict, dict]]:
    """(role, label, summary, ratios) of each speculative setting measured at one level (the
    run's `settings`; a partial run's servers; else the one speculative server)."""
    servers = {role: info for role, info in (results.get("servers") or {}).items()
               if role != "baseline"} or {"speculative": {}}
    settings = results.get("settings") or [{"role": role, "label": info.get("label") or role}
                                           for role, info in servers.items()]
    ratios = row.get("settings") or {"speculative": row}
    return [(s["role"], s["label"], row[s["role"]], ratios.get(s["role"]) or {})
            for s in settings if row.get(s["role"])]


def _of(s: dict, n_key: str, of_key: str) -> str:
    """`3 / 8 (38%)` of prompts, "-" where not compared (sampling, or no request)."""
    n, of = s.get(n_key), s.get(of_key)
    return "-" if n is None or not of else f"{n} / {of} ({n / of:.0%})"


MEASURED_VLLM = """How these figures are measured: tok/s, TTFT and speedup as for SGLang (our own
requests); acceptance length = 1 + accepted / drafts from the deltas of vLLM's
`vllm:spec_decode_*` counters over the level; tokens/round = (completion tokens - 1 a request) /
drafts, from the outputs; per-position = accepted at position i / drafts; loop share = share of
the speculative outputs' tokens inside repetition loops (eagle3/core/loops.py)."""


def _vllm_markdown(results: dict) -> str:
    lines = _header(results, "05 benchmark (vLLM)")
    for role, info in results.get("servers", {}).items():
        lines.append(f"- {role} server: {info.get('url')} ({info.get('speculative') or 'no draft'}"
                     f"; captures {info.get('layers') or '-'})")
    lines += [f"- sampling: {results.get('sampling_params')}, streaming: {results.get('stream')}",
              _lossless_line(results), ""]
    for name, levels in results["prompt_sets"].items():
        lines += [f"## {name} ({results.get('prompts', {}).get(name, '?')} prompts)", "",
                  "| concurrency | acceptance length | tokens/round | per-position | loop share | "
                  "speedup | spec tok/s | baseline tok/s | TTFT spec / baseline (ms) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c, row in levels.items():
            s, b = row["speculative"], row["baseline"] or {}
            pos = ", ".join(f"{x:.2f}" for x in s.get("per_position_acceptance") or [])
            lines.append(
                f"| {c} | {_f(s['acceptance_length'], '.3f')} | "
                f"{_f(s.get('tokens_per_round'), '.3f')} | {pos or '-'} | "
                f"{_f(s.get('loop_share'), '.2f')} | {_speedup(row['speedup'])} | "
                f"{_f(s['total_tok_s'], '.1f')} | {_f(b.get('total_tok_s'), '.1f')} | "
                f"{_f(s['ttft_mean_s'], '.0f', 1e3)} / {_f(b.get('ttft_mean_s'), '.0f', 1e3)} |")
        lines += _fault_notes(levels, results) + [""]
    lines += [MEASURED_VLLM, ""]
    return "\n".join(lines)


def _lossless_line(results: dict) -> str:
    """The server backends' lossless check (speculative outputs against the baseline's)."""
    n = results.get("lossless_mismatches")
    beyond = sum(s["lossless_mismatches"] for levels in results.get("prompt_sets", {}).values()
                 for row in levels.values() for _, _, s, _ in level_settings(results, row)
                 if beyond_noise(s))
    verdict = ("n/a (sampling)" if n is None else "0 (lossless)" if n == 0
               else f"**{n} (NOT lossless: the figures are not those of a correct server)**"
               if beyond else f"{n}, each level's share within plain's own differences "
                              "across concurrencies (batch-size noise, not a draft bug)")
    return f"- speculative outputs differing from the baseline's (temperature 0): {verdict}"


def _fault_notes(levels: dict, results: dict) -> list[str]:
    """Lines under a table: requests that failed for good, acceptance or a speedup that cannot
    be figured, outputs that are not lossless, or whose differences are plain's own."""
    notes = []
    for c, row in levels.items():
        if row.get("speedup_error"):
            notes.append(f"- c={c}: speedup \"-\": {row['speedup_error']}")
        base = row.get("baseline") or {}
        notes += _level_notes(c, "baseline", base, base)
        settings = level_settings(results, row)
        for role, label, s, ratios in settings:
            who = f"{role} ({label})" if len(settings) > 1 else role
            if len(settings) > 1 and ratios.get("speedup_error"):
                notes.append(f"- c={c} {who}: speedup \"-\": {ratios['speedup_error']}")
            notes += _level_notes(c, who, s, base)
    return [""] + notes if notes else []


def _level_notes(c: str, who: str, s: dict, base: dict) -> list[str]:
    """One server's notes at one level; `base`: the baseline's summary there."""
    notes = []
    if s.get("failed_requests"):
        notes.append(f"- c={c} {who}: {s['failed_requests']} requests FAILED, left out of "
                     "every figure (failed_requests.jsonl)")
    if s.get("acceptance_error"):
        notes.append(f"- c={c} {who}: acceptance \"-\": {s['acceptance_error']}")
    if beyond_noise(s):
        notes.append(f"- c={c} {who}: {s['lossless_mismatches']} outputs differ from the "
                     "baseline's at temperature 0 (NOT lossless)")
    elif s.get("lossless_mismatches"):
        notes.append(f"- c={c} {who}: {_of(s, 'mismatch_prompts', 'mismatch_compared')} "
                     f"prompts differ from plain at concurrency {c}, within plain's own "
                     f"{_of(base, 'plain_noise_prompts', 'plain_noise_compared')} between "
                     f"concurrency {c} and {base.get('plain_noise_reference')}: bf16's "
                     "batch-size noise, not a draft bug")
    return notes


def _offline_markdown(results: dict) -> str:
    lines = _header(results, "05 benchmark (offline, hf backend)")
    lines += ["", "| prompt set | temperature | steps | acceptance length | loop share | "
              "loop-free acceptance (rounds) | per-position acceptance | spec tok/s | "
              "baseline tok/s | speedup | lossless |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["prompt_sets"].items():
        for s, m in r["steps"].items():
            rates = ", ".join(f"{x:.2f}" for x in m["per_position_acceptance"])
            mism = m["lossless_mismatches"]
            lossless = "n/a (sampling)" if mism is None else ("yes" if mism == 0 else "NO")
            lines.append(f"| {name} | {r.get('temperature', 0.0)} | {s} | "
                         f"{m['acceptance_length']:.3f} | {_f(m.get('loop_share'), '.3f')} | "
                         f"{_f(m.get('loop_free_acceptance'), '.3f')} "
                         f"({m.get('loop_free_verify_passes', '-')}) | {rates} | "
                         f"{m['tok_s']:.1f} | "
                         f"{r['baseline_tok_s']:.1f} | {m['speedup']:.2f} | {lossless} |")
    return "\n".join(lines + _context_markdown(results) + ["", LOOPS]) + "\n"


def _context_markdown(results: dict) -> list[str]:
    """Acceptance length per bucket of context length at the round's start (hf backend)."""
    lines = ["", "Acceptance by context position (tokens in context when the verify round "
             "started: prompt plus tokens generated so far; eagle3/bench/context.py):", "",
             "| prompt set | steps | context tokens | acceptance length | verify rounds |",
             "|---|---|---|---|---|"]
    for name, r in results["prompt_sets"].items():
        for s, m in r["steps"].items():
            for b in m.get("acceptance_by_context", []):
                lines.append(f"| {name} | {s} | {b['from']}-{b['to'] - 1} | "
                             f"{b['acceptance_length']:.3f} | {b['verify_passes']} |")
    return lines


def summary_rows(results: dict) -> tuple[dict, dict, bool]:
    """(manifest outputs, rows of the closing summary, lossless) of the results."""
    if results["backend"] == "hf":
        outputs, rows, ok = _offline_rows(results)
    else:
        outputs, rows, ok = _served_rows(results)
        rows.update(verdict_rows(results))
    if results.get("failed_requests"):  # figures over the good requests only: look first
        ok = False
        rows["failed requests"] = (f"{results['failed_requests']} (left out of every figure; "
                                   f"{results.get('failed_requests_file')})")
    if results.get("skipped"):
        rows["skipped prompt lines"] = f"{results['skipped']} ({results.get('skip_list')})"
    return outputs, rows, ok


def _offline_rows(results: dict) -> tuple[dict, dict, bool]:
    outputs, rows, ok = {}, {}, True
    for name, r in results["prompt_sets"].items():
        for s, m in r["steps"].items():
            outputs.setdefault(s, m["acceptance_length"])
            outputs.setdefault("loops", {}).setdefault(s, {
                "loop_share": m.get("loop_share"),
                "loop_free_acceptance": m.get("loop_free_acceptance")})
            ok &= not m["lossless_mismatches"]
            lossless = ("n/a (sampling)" if m["lossless_mismatches"] is None
                        else m["lossless_mismatches"] == 0)
            rows[f"{name} steps {s}: acceptance length"] = (
                f"{m['acceptance_length']:.3f} (ceiling {int(s) + 1}), {loop_note(m)}, "
                f"lossless: {lossless}")
    return outputs, rows, ok


def _served_rows(results: dict) -> tuple[dict, dict, bool]:
    """A row per prompt set, level and setting (one setting: `chat c=1`, as before settings;
    several: `chat c=1 chain 3`); lossless unless a setting's outputs differ from plain's
    beyond plain's own noise (temperature 0)."""
    outputs, rows, ok = {}, {}, True
    for name, levels in results["prompt_sets"].items():
        for c, row in levels.items():
            settings = level_settings(results, row)
            for _, label, spec, ratios in settings:
                key = f"{name} c={c}" + (f" {label}" if len(settings) > 1 else "")
                outputs[key] = spec["acceptance_length"]
                rows[key] = _served_row(spec, ratios, row.get("baseline") or {})
                ok &= not beyond_noise(spec)
    return outputs, rows, ok


def _served_row(spec: dict, ratios: dict, base: dict) -> str:
    """`acceptance 2.380 (loop share 6%), speedup 1.42x`, and what went wrong."""
    speedup = ratios.get("speedup")
    speedup_text = (f"{speedup:.2f}x" + (" (SLOWER than no draft)" if speedup < 1 else "")
                    if speedup is not None
                    else f"- ({ratios.get('speedup_error') or 'not measured'})")
    failed = base.get("failed_requests", 0) + spec.get("failed_requests", 0)
    within = spec.get("lossless_mismatches") and not beyond_noise(spec)
    return (f"acceptance {_f(spec['acceptance_length'], '.3f')} (loop share "
            f"{_f(spec.get('loop_share'), '.0%')}), speedup {speedup_text}"
            + (f", {failed} requests FAILED" if failed else "")
            + (f", {spec['lossless_mismatches']} outputs NOT lossless"
               if beyond_noise(spec) else "")
            + (f", {spec['lossless_mismatches']} outputs differ from plain within plain's own "
               "noise" if within else "")
            + (f" (acceptance: {spec['acceptance_error']})"
               if spec.get("acceptance_error") else ""))


def loop_note(m: dict) -> str:
    """`loop share 88%, loop-free acceptance 1.000 (12 rounds)` of one offline result."""
    free = m.get("loop_free_acceptance")
    return (f"loop share {_f(m.get('loop_share'), '.0%')}, loop-free acceptance "
            f"{_f(free, '.3f')} ({m.get('loop_free_verify_passes', 0)} rounds)")
