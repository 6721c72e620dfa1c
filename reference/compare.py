"""The comparison of issues 16 and 17 in the reference summary: one row per draft of the run.

Every draft here was trained from the same merged data and draft vocabulary and is evaluated by
the same evaluator on the same held-out prompts (reference/phase3.py); the rows differ in one
thing each: the draft's architecture (MLA), the layout of the states it trained on (fp8, fp8-all,
top-k teacher renormalised or with the tail bucket), or 04's GEMM precision (fp8gemm). Figures:
acceptance (tokens per verify round) at 3 and 7 steps with the loop share of the same outputs
and the loop-free acceptance (eagle3/core/loops.py), the draft's parameters (its exported
model.safetensors), 04's training-loop tokens/s (its manifest's `outputs.tok_s`, the mean over
log windows after the first, which holds compilation), the bytes/token of the 02b files it read
(manifest disk bytes / tokens), and each against main in %.
"""

from __future__ import annotations

# key (work folder and sweep name) -> (label, 04 stage label, 02b stage label of its files)
COMPARE_ROWS = {
    "main": ("Llama-style, bf16 states (main)", "04 main", "02b main (bf16)"),
    "mla": ("MLA, bf16 states", "04 mla", "02b main (bf16)"),
    "fp8": ("Llama, fp8 aux states", "04 fp8", "02b fp8"),
    "fp8_all": ("Llama, fp8-all states", "04 fp8_all", "02b fp8_all"),
    "topk": ("Llama, fp8-topk renormalised", "04 topk", "02b topk"),
    "topk_tail": ("Llama, fp8-topk tail bucket", "04 topk_tail", "02b topk"),
    "fp8gemm": ("Llama, bf16 states, FP8 GEMMs", "04 fp8gemm", "02b main (bf16)"),
    "perstep": ("Llama, bf16 states, per-step TTT unroll", "04 perstep", "02b main (bf16)"),
}
STEPS = ("3", "7")


def main_layout(stages: dict) -> str:
    """The storage layout of main's states in a collected summary's stages ("02b main (fp8)"
    -> "fp8"; bf16 when no main 02b ran): the profile's `main_dtype`."""
    for label in stages or {}:
        if label.startswith("02b main (") and label.endswith(")"):
            return label[len("02b main ("):-1]
    return "bf16"


def compare_rows(stages: dict) -> dict[str, tuple[str, str, str]]:
    """COMPARE_ROWS with main's states named by their layout: the drafts trained on main's
    states read fp8 files where the profile stores main's states in fp8 (`h200-chat`)."""
    layout = main_layout(stages)
    if layout == "bf16":
        return dict(COMPARE_ROWS)
    return {key: (label.replace("bf16 states", f"{layout} states"), train,
                  f"02b main ({layout})" if states == "02b main (bf16)" else states)
            for key, (label, train, states) in COMPARE_ROWS.items()}


def _step(sweep: dict | None, steps: str) -> dict:
    m = ((sweep or {}).get("steps") or {}).get(steps) or {}
    share = m.get("loop_share", (m.get("loop") or {}).get("share"))
    return {"acceptance": m.get("acceptance_length"), "loop_share": share,
            "loop_free_acceptance": m.get("loop_free_acceptance")}


def _delta(x: float | None, ref: float | None) -> float | None:
    """x against ref in %, None when either is missing."""
    return None if x is None or not ref else 100.0 * (x / ref - 1.0)


def comparison_rows(summary: dict) -> list[dict]:
    """The rows of the comparison from a collected summary (reference/report.py `collect`):
    every row of COMPARE_ROWS, with None for what the run did not produce."""
    stages, params = summary.get("stages") or {}, summary.get("draft_params") or {}
    rows = []
    for key, (label, train, extract) in compare_rows(stages).items():
        sweep = (summary.get("sweeps") or {}).get(key)
        outputs = ((stages.get(train) or {}).get("manifest") or {}).get("outputs") or {}
        rows.append({"key": key, "label": label, "evaluated": sweep is not None,
                     "steps": {s: _step(sweep, s) for s in STEPS},
                     "prompts_x_tokens": [sweep.get("num_prompts"), sweep.get("max_new_tokens")]
                     if sweep else None,
                     "parameters": params.get(key),
                     "train_tok_s": outputs.get("tok_s"), "train_stage": train,
                     "bytes_per_token": ((stages.get(extract) or {}).get("throughput")
                                         or {}).get("bytes_per_token"),
                     "states_stage": extract})
    main = rows[0]
    for row in rows:
        row["delta_pct"] = {
            **{f"acceptance_{s}": _delta(row["steps"][s]["acceptance"],
                                         main["steps"][s]["acceptance"]) for s in STEPS},
            "train_tok_s": _delta(row["train_tok_s"], main["train_tok_s"]),
            "bytes_per_token": _delta(row["bytes_per_token"], main["bytes_per_token"])}
    return rows


def _f(x, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def comparison_md(rows: list[dict]) -> list[str]:
    """The comparison table of summary.md (rows not run say so)."""
    lines = ["| draft | acceptance @3 (loop share) | @7 (loop share) | loop-free @3 / @7 | "
             "parameters | 04 train tok/s | bytes/token of its states | "
             "vs main: @3 / @7 / tok/s / bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st, d = r["steps"], r["delta_pct"]
        accept = [f"{_f(st[s]['acceptance'])} ({_f(st[s]['loop_share'], '{:.1%}')})"
                  if r["evaluated"] else "not run" for s in STEPS]
        free = " / ".join(_f(st[s]["loop_free_acceptance"]) for s in STEPS)
        delta = " / ".join(_pct(d[k]) for k in ("acceptance_3", "acceptance_7", "train_tok_s",
                                                "bytes_per_token"))
        lines.append(f"| {r['label']} | {accept[0]} | {accept[1]} | {free} | "
                     f"{_f(r['parameters'], '{:,}')} | {_f(r['train_tok_s'], '{:,.0f}')} | "
                     f"{_f(r['bytes_per_token'], '{:,.0f}')} | {delta} |")
    sizes = {tuple(r["prompts_x_tokens"]) for r in rows if r["prompts_x_tokens"]}
    return lines + ["", "Same merged data, draft vocabulary, seed and held-out prompts ("
                    + ", ".join(f"{p} x {t}" for p, t in sorted(sizes)) + " prompts x tokens); "
                    "tok/s: 04's training loop (manifest outputs.tok_s, log windows after the "
                    "first); bytes/token: the 02b files each draft read (disk / tokens).", ""]
