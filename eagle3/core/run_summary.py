"""The table a pipeline run ends with: one row per stage, read from the stage manifests.

    python -m eagle3.core.run_summary runs/demo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3.core.progress import human_bytes
from eagle3.core.stage import STAGE_DIRS, read_manifest

STAGES = tuple(STAGE_DIRS.values())  # in pipeline order


def _first_eval(metrics: Path) -> dict | None:
    """04's evaluation at step 0 (the draft as initialised), from its metrics log."""
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if row.get("step") == 0 and "eval_sim_accept" in row:
            return row
    return None


def _outputs(stage: str, m: dict, workdir: Path) -> str:
    out = m.get("outputs", {})
    if stage in (STAGE_DIRS["01"], STAGE_DIRS["01b"]):
        return ", ".join(f"{k}: {v['records']}" for k, v in out.get("datasets", {}).items())
    if stage == STAGE_DIRS["merge"]:
        return f"train {out.get('train')}, eval {out.get('eval')}"
    if stage == STAGE_DIRS["02b"]:
        text = ", ".join(f"{k}: {v['samples']}" for k, v in out.items())
        stream = m.get("stream")
        if stream:  # the train split went through the spool, which is empty now
            text += (f"; train streamed to 04: spool peak {human_bytes(stream['peak_bytes'])} "
                     f"of {human_bytes(stream['budget_bytes'])}, prefill "
                     f"{stream['prefill_passes']:.2f} passes for {stream['epochs']} epochs")
        return text
    if stage == STAGE_DIRS["03"]:
        return f"draft vocab {out.get('draft_vocab')}, coverage {out.get('coverage', 0):.3f}"
    if stage == STAGE_DIRS["04"]:
        first = _first_eval(workdir / stage / "metrics.jsonl")
        untrained = ("" if first is None else
                     f"; the untrained draft (step 0): {_num(first.get('eval_sim_accept'))}, "
                     f"loop-free {_num(first.get('eval_sim_accept_loop_free'))}")
        se = out.get("eval_sim_accept_se")
        return (f"{out.get('num_steps')} steps, eval acceptance estimate "
                f"{_num(out.get('eval_sim_accept'))}"
                f"{'' if se is None else f' +- {se:.3f}'} (loop share "
                f"{_num(out.get('eval_loop_share'), '.0%')}, loop-free "
                f"{_num(out.get('eval_sim_accept_loop_free'))}{untrained})")
    if stage == STAGE_DIRS["05"]:
        loops = out.get("loops", {})
        return ", ".join(
            f"acceptance length @{k} steps: {v:.3f}"
            + (f" (loop share {_num(loops[k].get('loop_share'), '.0%')}, loop-free "
               f"{_num(loops[k].get('loop_free_acceptance'))})" if k in loops else "")
            for k, v in out.items() if k != "loops")
    return json.dumps(out)[:60]


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def summary_table(workdir: Path) -> str:
    rows = [("stage", "complete", "seconds", "disk", "outputs")]
    for stage in STAGES:
        m = read_manifest(Path(workdir) / stage)
        if m is None:
            rows.append((stage, "no", "-", "-", "-"))
            continue
        rows.append((stage, "yes" if m.get("complete") else "no", f"{m.get('seconds', 0):.1f}",
                     human_bytes(m.get("disk_bytes", 0)), _outputs(stage, m, Path(workdir))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eagle3.core.run_summary WORKDIR", file=sys.stderr)
        return 2
    print(summary_table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
