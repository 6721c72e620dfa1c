"""Training logs: one fixed-format line per N steps, JSONL (always), TensorBoard (when the
`tensorboard` package is installed) and PNG plots of the curves at the end. Rank 0 only.

A resumed run first cuts `metrics.jsonl` back to the resumed step (a killed run may have logged
steps past its last checkpoint; the eval at that step is kept and not run again), and a run
started afresh (`resume_step=-1`) empties it (a run killed before its first checkpoint logged
rows from step 0), so the file holds one curve, as an uninterrupted run would.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.core.progress import human_seconds
from eagle3.core.stage import atomic_write_bytes

log = logging.getLogger(__name__)


def metrics_line(m: dict, num_steps: int, eta_s: float) -> str:
    """`step 00120/05000 (2.4%) | loss 3.21 | acc 0.61/0.48/... | ...`"""
    step = m["step"]
    accs = "/".join(f"{a:.2f}" for a in m["acc"])
    return (f"step {step:05d}/{num_steps:05d} ({100 * step / max(num_steps, 1):.1f}%) | "
            f"loss {m['loss']:.4f} | acc {accs} | "
            f"lr {m['lr']:.1e} | gnorm {m['grad_norm']:.2f} | dt {m['dt_ms']:.0f}ms | "
            f"tok/s {m['tok_s']:,.0f} | data-wait {100 * m['data_wait']:.0f}% | "
            f"pad {100 * m['padding']:.0f}% | eta {human_seconds(eta_s)}")


class MetricsLog:
    """Appends records to `metrics.jsonl` and, if available, TensorBoard scalars."""

    def __init__(self, out_dir: Path, enabled: bool, resume_step: int, tensorboard: bool = True):
        """`resume_step`: the checkpoint's step, or -1 for a fresh start (nothing kept)."""
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        cut_after(self.path, resume_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed: metrics go to %s only "
                         "(pip install tensorboard to get TensorBoard logs)", self.path)
            else:
                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"),
                                        purge_step=resume_step if resume_step > 0 else None)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = "eval" if any(k.startswith("eval_") for k in record) else "train"
            for key, value in record.items():
                if key == "step":
                    continue
                if isinstance(value, list):
                    for i, v in enumerate(value):
                        self.tb.add_scalar(f"{prefix}/{key}_{i}", v, record["step"])
                elif isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cut_after(path: Path, step: int) -> None:
    """Drop records past `step` (and a torn last line) from a metrics file."""
    path = Path(path)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())


def plot_metrics(path: Path, out_dir: Path) -> list[Path]:
    """PNG plots of loss, per-step accuracy, the eval acceptance estimate, lr and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_acc" in r]
    if not train:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in train]
    panels = [
        ("loss.png", "loss (EMA, weighted over TTT steps)",
         [("train", [r["loss"] for r in train])]),
        ("accuracy.png", "top-1 accuracy per TTT step",
         [(f"train step {k}", [r["acc"][k] for r in train]) for k in range(len(train[0]["acc"]))]),
        ("sim_accept.png", "acceptance estimate (eval: verify rounds, full-vocab argmax)", []),
        ("lr.png", "learning rate", [("lr", [r["lr"] for r in train])]),
        ("throughput.png", "tokens/s (all ranks)", [("tok/s", [r["tok_s"] for r in train])]),
    ]
    written = []
    for name, title, series in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, ys in series:
            ax.plot(steps, ys, label=label)
        if name == "accuracy.png" and evals:
            for k in range(len(evals[0]["eval_acc"])):
                ax.plot([r["step"] for r in evals], [r["eval_acc"][k] for r in evals], "o--",
                        label=f"eval step {k}")
        if name == "sim_accept.png" and evals:
            for key, style, label in (("eval_sim_accept", "o--", "eval"),
                                      ("eval_sim_accept_loop_free", "x:",
                                       "eval, rounds before the first loop")):
                ys = [float("nan") if r.get(key) is None else r[key] for r in evals]
                ax.plot([r["step"] for r in evals], ys, style, label=label)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written
