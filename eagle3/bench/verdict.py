"""Stage 05's verdict on SGLang: for each prompt set and concurrency, which speculative setting
was fastest, by how much over plain, and the flags to start SGLang with; or plain, where no
setting beats it.

On one GPU a speculative round costs more than a plain step (about 1.8x for Qwen2.5-Coder-1.5B
on an H100, issue 49), so a setting pays only where its acceptance outweighs that cost, and the
cost grows with the batch: the best chain length changes with the concurrency, and at a high
one plain can win. The verdict is the measured total tokens/s ratio (`speedup`,
eagle3/bench/compare.py) of each setting at that level, nothing predicted.

results.json (`results_version` 2) gains `settings` (eagle3/bench/settings.py) and `verdict`:
{prompt set: {concurrency: {"serve": "speculative" | "plain" | null, "role", "label",
"speedup" (the fastest setting's, even when below 1), "speedups" {label: x}, "flags" (the
winner's SGLang flags; null when plain), "outputs_beyond_noise" (the winner's outputs differ
from plain's beyond plain's own noise at this level), "text"}}}.
"""

from __future__ import annotations

from eagle3.bench.compare import beyond_noise

RESULTS_VERSION = 2  # 2: several speculative settings, the verdict, plain's own noise


def _ranked(row: dict, settings: list[dict]) -> list[tuple[float, dict]]:
    """(speedup, setting) of the settings that have one at this level, fastest first."""
    ratios = row.get("settings") or {"speculative": row}
    ranked = [(ratios[s["role"]]["speedup"], s) for s in settings
              if (ratios.get(s["role"]) or {}).get("speedup") is not None]
    return sorted(ranked, key=lambda t: -t[0])


def level_verdict(row: dict, settings: list[dict], c: str) -> dict:
    """The verdict of one prompt set at one concurrency (the module docstring)."""
    ranked = _ranked(row, settings)
    if not ranked:
        reasons = sorted({(row.get("settings") or {"speculative": row}).get(s["role"], {})
                          .get("speedup_error") or "not measured" for s in settings})
        return {"serve": None, "role": None, "label": None, "speedup": None, "speedups": {},
                "flags": None, "outputs_beyond_noise": None,
                "text": f"no verdict at concurrency {c}: no setting has a speedup "
                        f"({'; '.join(reasons)})"}
    x, best = ranked[0]
    others = ", ".join(f"{s['label']} {y:.2f}x" for y, s in ranked[1:])
    beyond = beyond_noise(row.get(best["role"]) or {})
    out = {"role": best["role"], "label": best["label"], "speedup": x,
           "speedups": {s["label"]: y for y, s in ranked}, "outputs_beyond_noise": beyond}
    if x > 1:
        text = (f"{best['label']} fastest at concurrency {c}, {x:.2f}x plain"
                + (f" (then {others})" if others else "")
                + (": its outputs differ from plain's beyond plain's own noise, check the "
                   "server before serving it" if beyond else ""))
        return {"serve": "speculative", **out, "flags": best["serve_flags"], "text": text}
    return {"serve": "plain", **out, "flags": None,
            "text": f"serve plain at concurrency {c}: no setting beats it (fastest "
                    f"{best['label']} at {x:.2f}x plain" + (f", then {others}" if others else "")
                    + ")"}


def verdict(prompt_sets: dict, settings: list[dict]) -> dict:
    """{prompt set: {concurrency: level verdict}} of a run."""
    return {name: {c: level_verdict(row, settings, c) for c, row in levels.items()}
            for name, levels in prompt_sets.items()}


def _winners(results: dict) -> dict[str, list[str]]:
    """{role: ["chat c=1", ...]}: where each setting is the one to serve."""
    out: dict[str, list[str]] = {}
    for name, levels in (results.get("verdict") or {}).items():
        for c, v in levels.items():
            if v["serve"] == "speculative":
                out.setdefault(v["role"], []).append(f"{name} c={c}")
    return out


def verdict_rows(results: dict) -> dict:
    """The closing summary's verdict: a line per prompt set and level, then the flags of each
    setting that won somewhere."""
    rows = {f"verdict {name} c={c}": v["text"]
            for name, levels in (results.get("verdict") or {}).items()
            for c, v in levels.items()}
    by_role = {s["role"]: s for s in results.get("settings") or []}
    for role, where in _winners(results).items():
        rows[f"serve {by_role[role]['label']}"] = (f"{by_role[role]['serve_flags']}  (fastest "
                                                   f"at {', '.join(where)})")
    return rows


def verdict_markdown(results: dict) -> list[str]:
    """report.md's verdict: a table of the fastest setting per prompt set and level, then the
    SGLang flags of each setting that won somewhere."""
    if not results.get("verdict"):
        return []
    lines = ["## Verdict: what to serve", "",
             "| prompt set | concurrency | fastest setting | its speedup | all settings | serve |",
             "|---|---|---|---|---|---|"]
    for name, levels in results["verdict"].items():
        for c, v in levels.items():
            speedups = ", ".join(f"{k} {x:.2f}x" for k, x in v["speedups"].items()) or "-"
            serve = {"speculative": f"**{v['label']}**", "plain": "**plain**"}.get(v["serve"],
                                                                                  "-")
            lines.append(f"| {name} | {c} | {v['label'] or '-'} | "
                         f"{'-' if v['speedup'] is None else format(v['speedup'], '.2f') + 'x'}"
                         f" | {speedups} | {serve} |")
    notes = [f"- {v['text']}" for levels in results["verdict"].values()
             for v in levels.values() if v["serve"] is None or v.get("outputs_beyond_noise")]
    lines += [""] + notes if notes else []
    by_role = {s["role"]: s for s in results.get("settings") or []}
    for role, where in _winners(results).items():
        lines += ["", f"{by_role[role]['label']} (fastest at {', '.join(where)}): start SGLang "
                  "with", "", f"    {by_role[role]['serve_flags']}"]
    return lines + [""]
