"""The reference benchmark's results: one `summary.json` (every figure, raw) and `summary.md`
(the tables of BENCHMARKS.md, "GPU reference: ..."), assembled from the work folder.

Everything is read back from files the run left (stage manifests, the runner's stage records,
the 05 results, the sweep results), so the report can be rebuilt at any time:

    python -m reference.report /tmp/ref        # rewrites /tmp/ref/results/summary.{json,md}
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

from eagle3.core.progress import human_bytes
from eagle3.core.records import read_jsonl
from eagle3.core.stage import STAGE_DIRS, atomic_write_bytes, atomic_write_json
from reference.compare import COMPARE_ROWS, comparison_md, comparison_rows, main_layout

GiB = 2**30


def _read(path: Path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


def _strip_ids(obj):
    """A copy without per-token lists (output ids, accept lengths): the summary stays small."""
    if isinstance(obj, dict):
        return {k: _strip_ids(v) for k, v in obj.items()
                if k not in ("output_ids", "outputs", "baseline_outputs", "accept_lengths")}
    if isinstance(obj, list):
        return [_strip_ids(v) for v in obj]
    return obj


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": "cpu"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def split_tokens(workdir: Path) -> dict:
    """Tokens of a merged folder: all, and supervised (the target's own reply tokens)."""
    out = {"samples": 0, "tokens": 0, "response_tokens": 0}
    for split in ("train", "eval"):
        path = Path(workdir) / STAGE_DIRS["merge"] / f"{split}.jsonl"
        if path.exists():
            for r in read_jsonl(path):
                out["samples"] += 1
                out["tokens"] += r["seq_len"]
                out["response_tokens"] += r["n_response_tokens"]
    return out


def stage_throughput(record: dict, workdir: Path) -> dict:
    """Rate of one stage from its record and the data it processed."""
    stage, wall = record["stage"], max(record.get("wall_s") or 0.0, 1e-9)
    m = record.get("manifest") or {}
    out = {}
    if stage in ("01b", "02b", "04"):
        tok = split_tokens(workdir)
        if stage == "01b":
            gen = sum(r["n_response_tokens"] for p in
                      (Path(workdir) / STAGE_DIRS["01b"]).glob("*/tokenized.jsonl")
                      for r in read_jsonl(p))
            sets = ((m.get("outputs") or {}).get("datasets") or {}).values()
            out = {"generated_tokens": gen, "generated_tok_s": gen / wall,
                   "replies_closed": sum(d.get("stop", 0) for d in sets),  # ended by <|im_end|>
                   "replies_cut": sum(d.get("length", 0) for d in sets)}
        elif stage == "02b":
            out = {"tokens": tok["tokens"], "tok_s": tok["tokens"] / wall,
                   "bytes_per_token": (m.get("disk_bytes") or 0) / max(tok["tokens"], 1)}
        else:
            trained = (m.get("outputs") or {}).get("tokens")
            out = {"tokens_trained": trained, "tok_s": (trained or 0) / wall,
                   "loop_tok_s": (m.get("outputs") or {}).get("tok_s")}
    return out


def bench_summary(results: dict | None) -> dict | None:
    """The 05 figures (hf backend) with the loop share of its outputs."""
    from eagle3.core.loops import loop_stats

    if not results:
        return None
    out = {"temperature": results.get("temperature"), "layers": results.get("layers"),
           "preflight": results.get("preflight"), "sets": {}}
    for name, r in (results.get("prompt_sets") or {}).items():
        base = r.get("baseline_outputs")
        entry = {"prompts": r.get("prompts"), "baseline_tok_s": r.get("baseline_tok_s"),
                 "baseline_tokens": r.get("baseline_tokens"),
                 "baseline_loop": loop_stats(base).to_dict() if base else None, "steps": {}}
        for s, m in (r.get("steps") or {}).items():
            entry["steps"][s] = {**_strip_ids(m),
                                 "loop": loop_stats(m["outputs"]).to_dict()
                                 if m.get("outputs") else None}
        out["sets"][name] = entry
    return out


def collect(workdir: Path, profile: str) -> dict:
    """Every figure of the run, from the files in `workdir`."""
    w = Path(workdir)
    res = w / "results"
    stages = _read(res / "stages.json") or {}
    for record in stages.values():
        record["throughput"] = stage_throughput(record, Path(record["workdir"]))
        if record.get("side_by_side") and record["stage"] == "05":
            # the runner cannot see a subprocess's GPU memory; 05 (hf backend) reports its own
            results = _read(Path(record["workdir"]) / STAGE_DIRS["05"] / "results.json") or {}
            record["peak_gpu_bytes"] = results.get("peak_gpu_bytes")
    target = (_read(w / "target" / "reference_target.json") or {}).get("summary")
    converted = _read(w / "target" / "manifest.json")  # eagle3/targets/gguf.py writes it
    if target is None and converted is not None:
        config = _read(w / "target" / "config.json") or {}
        target = {"converted": converted, "architectures": config.get("architectures"),
                  "num_hidden_layers": config.get("num_hidden_layers"),
                  "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}
    sweeps = {p.stem[len("eval_"):]: _strip_ids(_read(p))
              for p in sorted((res / "evals").glob("eval_*.json"))}
    baselines = {p.stem: _strip_ids(_read(p)) for p in sorted((res / "evals").glob("baseline_*.json"))}
    out = {"profile": profile, "environment": environment(),
            "corpus": _read(w / "corpus" / "corpus.json"), "target": target,
            "data": {"main": split_tokens(w / "main")}, "stages": stages,
            "bench": {t: bench_summary(_read(w / f"bench_{t}" / STAGE_DIRS["05"] / "results.json"))
                      for t in ("t0", "t1")},
            "sweeps": sweeps, "baselines": baselines, "controls": _read(res / "controls.json"),
            "epoch_metrics": _epoch_metrics(w / "main" / STAGE_DIRS["04"] / "metrics.jsonl"),
            "draft_params": {k: draft_params(w / k / STAGE_DIRS["04"] / "final")
                             for k in COMPARE_ROWS},
            "state": _read(res / "state.json")}
    out["comparison"] = comparison_rows(out)
    return out


def _epoch_metrics(path: Path) -> list[dict]:
    """04's own evaluations (eval loss, per-step accuracy, simulated acceptance) by step."""
    if not path.exists():
        return []
    return [{k: r[k] for k in ("step", "eval_acc", "eval_sim_accept", "eval_loop_share") if k in r}
            for r in read_jsonl(path) if "eval_sim_accept" in r]


# ---------------------------------------------------------------- markdown


def _f(x, fmt="{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def _rates(rates) -> str:
    return " / ".join(f"{r:.2f}" for r in rates or [])


def _target_md(s: dict) -> list[str]:
    t = s.get("target") or {}
    p = t.get("parameters") or {}
    c = s.get("corpus") or {}
    env = s["environment"]
    head = [f"Environment: {env['device']}, python {env['python']}, torch {env['torch']}, "
            f"transformers {env['transformers']} (profile `{s['profile']}`).", "",
            f"Corpus: {c.get('files_train')} train / {c.get('files_heldout')} held-out stdlib "
            f"files (python {c.get('python')}), {c.get('samples_train')} train samples, "
            f"{c.get('samples_pipeline')} handed to 01, {c.get('samples_heldout')} held-out "
            "prompts.", ""]
    if "converted" in t:  # a pretrained model, not trained here
        m = t["converted"]
        return head + [f"Target: {m.get('model')} ({', '.join(t.get('architectures') or [])}, "
                       f"{t.get('num_hidden_layers')} layers, hidden {t.get('hidden_size')}, "
                       f"vocab {t.get('vocab_size')}), pretrained: converted from "
                       f"{m.get('gguf')} of {m.get('package')} (sha256 "
                       f"{m.get('gguf_sha256', '')[:16]}...), not trained here.", ""]
    return head + [
            f"Target: DeepseekV3ForCausalLM, {t.get('shape', {}).get('num_hidden_layers')} "
            f"layers, {_f(p.get('total'), '{:,}')} parameters "
            f"({_f(p.get('active_per_token'), '{:,}')} active per token without the embedding), "
            f"vocab {t.get('vocab_size')}; trained "
            f"{_f(t.get('train_seconds'), '{:.0f}')} s, {_f(t.get('tokens'), '{:,}')} tokens "
            f"({t.get('epochs')} epochs of {_f(t.get('corpus_tokens'), '{:,}')}), "
            f"{_f(t.get('tokens_per_s'), '{:,.0f}')} tok/s, peak "
            f"{_f((t.get('peak_gpu_bytes') or 0) / GiB, '{:.1f}')} GiB; final train loss (EMA) "
            f"{_f(t.get('final_train_loss_ema'))}, held-out loss {_f(t.get('heldout_loss'))}.", ""]


def _side_by_side(record: dict) -> bool:
    """A stage run as a subprocess beside the phase-3 evaluations (older summaries say so only
    by a peak GPU memory the runner could not measure)."""
    return bool(record.get("side_by_side")) or ("peak_gpu_bytes" in record
                                                and record["peak_gpu_bytes"] is None)


def _stages_md(s: dict) -> list[str]:
    lines = ["| step | wall s | rate | disk | bytes/token | peak GPU GiB |",
             "|---|---|---|---|---|---|"]
    for label, r in s["stages"].items():
        th = r.get("throughput") or {}
        rate = ("{:,.0f} gen tok/s ({} replies closed, {} cut at the limit)".format(
                    th["generated_tok_s"], th["replies_closed"], th["replies_cut"])
                if "generated_tok_s" in th
                else "{:,.0f} tok/s".format(th["tok_s"]) if th.get("tok_s") else "–")
        if th.get("loop_tok_s"):
            rate += " (training loop {:,.0f})".format(th["loop_tok_s"])
        disk = (r.get("manifest") or {}).get("disk_bytes")
        peak = r.get("peak_gpu_bytes")
        if _side_by_side(r):
            label += " (side by side)"
        lines.append(f"| {label} | {r['wall_s']:.1f} | {rate} | "
                     f"{human_bytes(disk) if disk else '–'} | "
                     f"{_f(th.get('bytes_per_token'), '{:,.0f}')} | "
                     f"{_f(peak if peak is None else peak / GiB, '{:.2f}')} |")
    return lines + [""]


def _bench_md(s: dict) -> list[str]:
    lines = ["| temperature | steps | acceptance length (ceiling) | per-position acceptance | "
             "spec tok/s | target tok/s | speedup | loop share (target / spec) | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t, b in s["bench"].items():
        for name, r in ((b or {}).get("sets") or {}).items():
            base_loop = (r.get("baseline_loop") or {}).get("share")
            for st, m in r["steps"].items():
                mism = m.get("lossless_mismatches")
                lines.append(
                    f"| {b.get('temperature')} | {st} | {m['acceptance_length']:.3f} "
                    f"({int(st) + 1}) | {_rates(m.get('per_position_acceptance'))} | "
                    f"{m['tok_s']:.1f} | {_f(r.get('baseline_tok_s'), '{:.1f}')} | "
                    f"{m['speedup']:.2f} | {_f(base_loop, '{:.3f}')} / "
                    f"{_f((m.get('loop') or {}).get('share'), '{:.3f}')} | "
                    f"{'n/a' if mism is None else ('yes' if mism == 0 else f'{mism} differ')} |")
    if s["bench"].get("t1") and _side_by_side(s["stages"].get("05 t1") or {}):
        lines += ["", "05 at temperature 1 ran in phase 3 beside the other evaluations: its tok/s "
                  "and speedup are slowed by them. The speed figures are those at temperature 0."]
    return lines + [""]


def _parallel_md(state: dict) -> list[str]:
    """How phase 3's side-by-side evaluations went: wall time against the processes' own."""
    par = state.get("parallel") or {}
    runs = par.get("phase3_runs") or []
    jobs = {n: w for d in (state.get("done") or {}).values() if d.get("side_by_side")
            for n, w in (d.get("jobs") or {}).items()}
    if not runs or not jobs:
        return []
    walls = " + ".join(f"{r['wall_s']:.0f} s ({r['jobs']} processes, {r['eval_workers']} at a "
                       "time)" for r in runs)
    return [f"Phase 3 ({len(runs)} run{'s' if len(runs) > 1 else ''}): {walls}, the fp8, "
            f"compact-layout and data-size drafts trained meanwhile; the {len(jobs)} evaluation "
            f"processes' own wall times add up to {sum(jobs.values()):.0f} s.", ""]


def _sweep_md(s: dict, names: list[tuple[str, str]]) -> list[str]:
    lines = ["| draft | steps | acceptance length | per-position acceptance | loop share | "
             "prompts x tokens |", "|---|---|---|---|---|---|"]
    for label, key in names:
        r = s["sweeps"].get(key)
        if not r:
            lines.append(f"| {label} | – | not run | | | |")
            continue
        for st, m in r["steps"].items():
            lines.append(f"| {label} | {st} | {m['acceptance_length']:.3f} | "
                         f"{_rates(m.get('per_position_acceptance'))} | "
                         f"{(m.get('loop') or {}).get('share', 0):.3f} | "
                         f"{r['num_prompts']} x {r['max_new_tokens']} |")
    return lines + [""]


# (label, sweep name, 02b stage label of its files) of the storage-layout comparison (issue 17)
LAYOUT_SWEEPS = [("bf16 states", "main"), ("fp8 states", "fp8"),
                 ("fp8-all states", "fp8_all"), ("fp8-topk, renormalised", "topk"),
                 ("fp8-topk, tail bucket", "topk_tail")]
LAYOUT_STAGES = {"main": "02b main (bf16)", "fp8": "02b fp8", "fp8_all": "02b fp8_all",
                 "topk": "02b topk", "topk_tail": "02b topk"}


def layout_sweeps(s: dict) -> list[tuple[str, str]]:
    """LAYOUT_SWEEPS with main's row named by the layout its states were stored in."""
    layout = main_layout(s["stages"])
    return [(f"{layout} states (main)" if key == "main" and layout != "bf16" else label, key)
            for label, key in LAYOUT_SWEEPS]


def _layout_bytes_md(s: dict) -> list[str]:
    """Measured bytes/token of each layout's files here, and the same layouts at Kimi size."""
    from eagle3.core.hidden_states import bytes_per_token

    parts = []
    for label, key in layout_sweeps(s):
        stage = f"02b main ({main_layout(s['stages'])})" if key == "main" else LAYOUT_STAGES[key]
        th = (s["stages"].get(stage) or {}).get("throughput") or {}
        parts.append(f"{label} {_f(th.get('bytes_per_token'), '{:,.0f}')}")
    kimi = {d: bytes_per_token(7168, d, 64) for d in ("bf16", "fp8", "fp8-all", "fp8-topk")}
    return ["Bytes per token of the files (02b manifest disk bytes / tokens, file overhead "
            "included): " + "; ".join(parts) + ". At Kimi-K2.5 size (H = 7168, K = 64; "
            "eagle3/core/hidden_states.py): " + ", ".join(f"{d} {b:,}" for d, b in kimi.items())
            + " bytes/token.", ""]


def draft_params(folder: Path) -> int | None:
    """Parameters of an exported draft (every floating tensor of model.safetensors)."""
    from safetensors import safe_open

    path = Path(folder) / "model.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                   if f.get_slice(k).get_dtype() not in ("I64", "BOOL"))


def _controls_md(s: dict) -> list[str]:
    c = s.get("controls") or {}
    lines = ["| control | acceptance length @3 | same prompts, correct draft | collapsed | "
             "detected by | detected |", "|---|---|---|---|---|---|"]
    ref = (s["sweeps"].get("control_reference") or {}).get("steps", {}).get("3", {})
    for name in ("final_state", "shifted_layers"):
        ev = (s["sweeps"].get(f"control_{name}") or {}).get("steps", {}).get("3", {})
        det = c.get(name) or {}
        lines.append(f"| {name} | {_f(ev.get('acceptance_length'))} | "
                     f"{_f(ref.get('acceptance_length'))} | {det.get('collapsed', '–')} | "
                     f"{det.get('check', '–')} | {det.get('detected', '–')} |")
    sim = (s["sweeps"].get("control_shifted_layers") or {}).get("layer_similarity")
    if sim:
        lines += ["", "Trained-on against served states of the shifted control (held-out prompts): "
                  + "; ".join(f"layer {k} -> {v['served']}: cosine {v['mean_cosine']:.3f}, "
                              f"relative change {v['mean_relative_change']:.3f}"
                              for k, v in sim.items())]
    return lines + [""]


def markdown(s: dict) -> str:
    sizes = sorted((k for k in s["sweeps"] if k.startswith("size_")),
                   key=lambda k: int(k.split("_")[1]))
    ckpts = sorted((k for k in s["sweeps"] if k.startswith("ckpt_")),
                   key=lambda k: int(k.split("_")[1]))
    train = (s["stages"].get("04 main") or {}).get("manifest") or {}
    num_steps = (train.get("outputs") or {}).get("num_steps")
    epochs = (train.get("args") or {}).get("epochs")

    def ckpt_label(key: str) -> str:
        step = int(key.split("_")[1])
        if num_steps and epochs:
            return f"step {step} (epoch {step * epochs / num_steps:.2f})"
        return f"step {step}"

    out = ["### Reference target", "", *_target_md(s),
           "### Stages (time, throughput, disk, peak GPU memory)", "", *_stages_md(s),
           "### Acceptance on held-out prompts (05, offline hf evaluator)", "", *_bench_md(s),
           "### bf16 vs fp8 and compact storage layouts (same run, same prompts)", "",
           *_sweep_md(s, layout_sweeps(s)), *_layout_bytes_md(s),
           "### Acceptance vs training data size", "",
           *_sweep_md(s, [(k.replace("_", " ") + " samples", k) for k in sizes]
                      + [("all samples", "main")]),
           "### Acceptance vs epochs", "",
           *_sweep_md(s, [(ckpt_label(k), k) for k in ckpts]
                      + [(f"final (step {num_steps}, epoch {epochs})", "main")]),
           "04's own per-epoch evaluation (acceptance estimate: verify rounds, full-vocabulary "
           "argmax): "
           + ", ".join(f"step {m['step']}: {_f(m.get('eval_sim_accept'), '{:.2f}')} (loop share "
                       f"{_f(m.get('eval_loop_share'), '{:.0%}')})"
                       for m in s.get("epoch_metrics") or []), "",
           "### Drafts compared: architecture, storage layout, GEMM precision (same data, same "
           "prompts)", "", *comparison_md(s["comparison"]),
           "### Controls (meant to collapse; must be detected)", "", *_controls_md(s)]
    state = s.get("state") or {}
    notes = list(state.get("notes") or []) + [state[k] for k in ("eval_dtype_note",) if k in state]
    out += _parallel_md(state)
    out += [f"Evaluation dtype: {state.get('eval_dtype', '–')}; target decoding cost "
            f"{_f(state.get('seconds_per_token'), '{:.4f}')} s/token at batch 1.", ""]
    if notes:
        out += ["Notes: " + "; ".join(notes), ""]
    failed = state.get("failed") or {}
    if failed:
        out += ["Failed (optional work; see run.log): "
                + "; ".join(f"{k}: {v}" for k, v in failed.items()), ""]
    skipped = state.get("skipped") or {}
    if skipped:
        out += ["Skipped (time budget): " + "; ".join(f"{k}: {v}" for k, v in skipped.items()),
                ""]
    return "\n".join(out)


def write_report(workdir: Path, profile: str) -> dict:
    summary = collect(workdir, profile)
    res = Path(workdir) / "results"
    atomic_write_json(res / "summary.json", summary)
    atomic_write_bytes(res / "summary.md", markdown(summary).encode())
    return summary


if __name__ == "__main__":
    state = _read(Path(sys.argv[1]) / "results" / "state.json") or {}
    write_report(Path(sys.argv[1]), state.get("profile", "?"))
