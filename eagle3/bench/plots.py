"""Stage 05's PNG plots, next to report.md: for the server backends, speedup and acceptance
length against concurrency (a line per prompt set, and per speculative setting when there are
several); offline (hf), acceptance length against the chain length."""

from __future__ import annotations

import io
from pathlib import Path

from eagle3.bench.report import level_settings
from eagle3.core.stage import atomic_write_bytes

SERVED_PANELS = (("speedup", "speedup over no draft", "speedup_vs_concurrency.png", 1.0),
                 ("acceptance_length", "acceptance length", "acceptance_vs_concurrency.png",
                  None))


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """PNG plots next to report.md; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    if results.get("backend") in ("sglang", "vllm"):
        return [_served_plot(results, out_dir, *panel) for panel in SERVED_PANELS]
    return [_offline_plot(results, out_dir)]


def _served_series(results: dict, key: str) -> dict[str, tuple[list[int], list]]:
    """{line label: (concurrencies, values)}: a line per prompt set and setting."""
    series: dict[str, tuple[list[int], list]] = {}
    multi = len(results.get("settings") or []) > 1
    for name, levels in results["prompt_sets"].items():
        for c, row in levels.items():
            for _, label, spec, ratios in level_settings(results, row):
                xs, ys = series.setdefault(f"{name} {label}" if multi else name, ([], []))
                xs.append(int(c))
                ys.append(ratios.get("speedup") if key == "speedup" else spec[key])
    return series


def _served_plot(results: dict, out_dir: Path, key: str, label: str, fname: str,
                 ref: float | None) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plotted = False
    for name, (xs, ys) in _served_series(results, key).items():
        if all(y is None for y in ys):  # every request failed, or no counters
            continue
        ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=name)
        plotted = True
    if ref is not None:
        ax.axhline(ref, color="gray", linestyle="--", linewidth=1)
    if plotted:
        ax.set_xscale("log", base=2)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no level measured (see report.md)", ha="center",
                transform=ax.transAxes)
    ax.set(xlabel="concurrency (requests in flight)", ylabel=label,
           title=f"{label} vs concurrency")
    return _save(fig, out_dir / fname)


def _offline_plot(results: dict, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results["prompt_sets"].items():
        steps = [int(s) for s in r["steps"]]
        ax.plot(steps, [r["steps"][str(s)]["acceptance_length"] for s in steps], marker="o",
                label=name)
    ax.plot(steps, [s + 1 for s in steps], color="gray", linestyle="--", label="ceiling")
    ax.set(xlabel="draft steps (chain length)", ylabel="acceptance length",
           title="acceptance length vs chain length")
    ax.legend()
    return _save(fig, out_dir / "acceptance_vs_steps.png")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
