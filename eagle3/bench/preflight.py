"""Preflight checks: refuse server and draft configurations that silently produce garbage.

Each check returns a list of Problems (error or warning, each naming the flag or file and the
fix); `raise_on_errors` turns errors into one PreflightError. Server flags are the keys of
SGLang's `/server_info` answer (the `ServerArgs` field names, plus `version`).

- `check_dump_server`: the patched server stage 02b dumps hidden states from.
- `check_draft`: a draft folder as SGLang will load it. Only the safetensors header is read
  (shapes and dtypes), so a multi-GB draft is checked in milliseconds. SGLang loads weights by
  name and silently leaves any name it does not know randomly initialised, so every expected
  name and shape is checked.
- `check_speculative_server` / `check_baseline_server`: the two servers stage 05 compares.
  `--speculative-algorithm EAGLE` with an EAGLE-3 draft starts and serves without a warning, but
  the target captures no aux states, the draft's `fc` is skipped and `d2t` ignored: acceptance
  collapses to about 1 (PIPELINE.md).
- `check_vocab_coverage`: the share of supervised eval tokens the draft vocabulary can propose.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable

from eagle3.draft.export import (CONFIG_KEYS, ExportError, draft_config_from_sglang, expected_tensors,
                           layer_ids_for, sglang_capture_layers)

log = logging.getLogger(__name__)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Below this share of supervised eval tokens inside the draft vocabulary, every miss ends a chain
# early often enough to cost a visible part of the acceptance length.
MIN_VOCAB_COVERAGE = 0.9
# The two SGLang rules for reading eagle_aux_hidden_state_layer_ids (eagle3/draft/export.py).
RULE_VERSIONS = {"0.5.4.post2-0.5.12": "0.5.12", ">= 0.5.13": "0.5.13"}
EXPORT_FIX = ("write the folder with eagle3.draft.export.export_sglang, as 04_train.py does at the "
              "end of training (04_train/final)")


@dataclass
class Problem:
    level: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


class PreflightError(RuntimeError):
    """A configuration that must not be used; the message lists every error and its fix."""


def raise_on_errors(problems: list[Problem], what: str) -> None:
    for p in problems:
        if p.level == "warning":
            log.warning("%s: %s", what, p.message)
    errors = [p for p in problems if p.level == "error"]
    if errors:
        raise PreflightError(f"{what} failed preflight:\n" + "\n".join(f"  - {p}" for p in errors))


def check_dump_server(info: dict) -> list[Problem]:
    """Flags of a patched SGLang server used to dump hidden states (stage 02b)."""
    problems = []

    def err(msg):
        problems.append(Problem("error", msg))

    if not info.get("disable_radix_cache"):
        err("radix cache is on: cached prefixes are not recomputed, so their states would be "
            "missing. Start the server with --disable-radix-cache")
    if info.get("enable_mixed_chunk"):
        err("--enable-mixed-chunk is on: chunks run in MIXED passes are not dumped. Remove it")
    if info.get("speculative_algorithm"):
        err(f"a speculative draft is loaded ({info['speculative_algorithm']}): target-verify "
            "passes would mix with prefill. Start the dump server without --speculative-*")
    if (info.get("pp_size") or 1) > 1:
        err("pipeline parallelism is on: no rank sees the final state of every layer. Use plain "
            "TP (--pp-size 1)")
    if info.get("enable_two_batch_overlap"):
        err("two-batch overlap splits batches. Remove --enable-two-batch-overlap")
    if info.get("allow_auto_truncate"):
        err("--allow-auto-truncate would cut prompts silently. Remove it")
    # Prefill CUDA graph replays rebuild the batch without request ids: nothing gets dumped.
    if "cuda_graph_backend_prefill" in info:
        if info["cuda_graph_backend_prefill"] not in ("disabled", None):
            err("prefill CUDA graphs are on (cuda_graph_backend_prefill="
                f"{info['cuda_graph_backend_prefill']!r}): start the server with "
                "--cuda-graph-backend-prefill disabled")
    elif "disable_piecewise_cuda_graph" in info and not info["disable_piecewise_cuda_graph"]:
        err("piecewise (prefill) CUDA graphs are on: start the server with "
            "--disable-piecewise-cuda-graph")
    if not info.get("skip_server_warmup", True):
        problems.append(Problem("warning", "server warmup is on; its requests are ignored by the "
                                           "dump (rid prefix), --skip-server-warmup saves time"))
    return problems


# ---------------------------------------------------------------- the draft folder


def read_draft_config(draft_dir: Path) -> dict:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise PreflightError(f"{path} not found: --draft must be the folder 04 writes "
                             "(<workdir>/04_train/final)")
    return json.loads(path.read_text())


def read_tensor_shapes(draft_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a draft's safetensors file(s), from the headers only."""
    from safetensors import safe_open

    draft_dir = Path(draft_dir)
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({draft_dir / f for f in weight_map.values()})
    else:
        files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise PreflightError(f"{draft_dir} holds no *.safetensors: SGLang would start the draft "
                             f"with random weights. {EXPORT_FIX}")
    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                shapes[name] = (s.get_dtype(), tuple(s.get_shape()))
    return shapes


def is_eagle3_draft(config: dict) -> bool:
    arch = config.get("architectures") or []
    return EAGLE3_ARCHITECTURE in arch or bool(
        (config.get("eagle_config") or {}).get("use_aux_hidden_state"))


def check_draft(draft_dir: Path, target_hidden_size: int | None = None,
                target_vocab_size: int | None = None,
                expected_captures: list[int] | None = None,
                sglang_version: str | None = None) -> list[Problem]:
    """A draft folder as SGLang loads it: config keys, every weight name and shape, `d2t`,
    and which capture layers its `eagle_aux_hidden_state_layer_ids` name on `sglang_version`
    (both reading rules when None) against `expected_captures` (what it was trained on)."""
    config = read_draft_config(draft_dir)
    problems = _check_config(config, target_hidden_size, target_vocab_size)
    if any(p.level == "error" for p in problems):
        return problems  # shapes cannot be derived from a broken config
    shapes = read_tensor_shapes(draft_dir)
    problems += _check_weights(config, shapes, target_hidden_size)
    problems += _check_layer_ids(config, expected_captures, sglang_version)
    return problems


def _check_config(config: dict, target_hidden: int | None, target_vocab: int | None):
    problems = []
    arch = config.get("architectures") or []
    if EAGLE3_ARCHITECTURE not in arch:
        problems.append(Problem("error", f"config.json architectures={arch}: SGLang picks the "
                                f"draft class from it; an EAGLE-3 draft needs "
                                f"[\"{EAGLE3_ARCHITECTURE}\"]. {EXPORT_FIX}"))
    missing = sorted(CONFIG_KEYS - set(config))
    if missing:
        problems.append(Problem("error", f"config.json lacks {missing}. {EXPORT_FIX}"))
        return problems
    eagle = config["eagle_config"] or {}
    if not eagle.get("use_aux_hidden_state") or len(
            eagle.get("eagle_aux_hidden_state_layer_ids") or []) != 3:
        problems.append(Problem("error", "config.json eagle_config needs use_aux_hidden_state: "
                                "true and three eagle_aux_hidden_state_layer_ids, else SGLang "
                                f"feeds the draft one hidden state. {EXPORT_FIX}"))
    if target_hidden is not None and config["target_hidden_size"] != target_hidden:
        problems.append(Problem("error", f"config.json target_hidden_size="
                                f"{config['target_hidden_size']} but the target's hidden size is "
                                f"{target_hidden}: this draft was trained for another target"))
    if target_vocab is not None and config["vocab_size"] != target_vocab:
        problems.append(Problem("error", f"config.json vocab_size={config['vocab_size']} but the "
                                f"target's vocabulary has {target_vocab} ids: this draft was "
                                "trained for another target (or 03 used the wrong tokenizer)"))
    return problems


def _check_weights(config: dict, shapes: dict, target_hidden: int | None) -> list[Problem]:
    problems = []
    expected = expected_tensors(draft_config_from_sglang(config))
    hidden = target_hidden or config["target_hidden_size"]
    fc = shapes.get("fc.weight")
    fc_width_wrong = fc is not None and fc[1][-1] != 3 * hidden
    if fc_width_wrong:
        why = (" — one hidden state, not three: an EAGLE-1/2 draft or one trained on the final "
               "state only" if fc[1][-1] == hidden else "")
        problems.append(Problem("error", f"fc.weight is {list(fc[1])}: its input is "
                                f"{fc[1][-1]} wide{why}; an EAGLE-3 draft for a {hidden}-wide "
                                "target reads the 3 aux states concatenated, "
                                f"[{config['hidden_size']}, {3 * hidden}]. Retrain on 02b's aux "
                                "states (three capture layers) with 04_train.py"))
    unknown = sorted(set(shapes) - set(expected))
    for name, shape in expected.items():
        if name == "fc.weight" and fc_width_wrong:
            continue  # reported above
        if name not in shapes:
            near = [u for u in unknown if _same_tail(u, name)]
            hint = f" (found {near}: a misnamed copy)" if near else ""
            problems.append(Problem("error", f"weight {name!r} {list(shape)} is missing{hint}: "
                                    "SGLang would leave it randomly initialised without a word. "
                                    + EXPORT_FIX))
        elif shapes[name][1] != shape:
            problems.append(Problem("error", _shape_message(name, shapes[name][1], shape, config)))
    if "d2t" in shapes and shapes["d2t"][0] != "I64":
        problems.append(Problem("error", f"d2t is {shapes['d2t'][0]}, SGLang adds it to draft ids "
                                "as int64 offsets. Rebuild it with 03_build_vocab_mapping.py"))
    if unknown:
        problems.append(Problem("warning", f"tensors {unknown} are not draft weights SGLang "
                                "knows; it skips them silently"))
    return problems


def _same_tail(a: str, b: str) -> bool:
    """Names ending in the same two components ("model.norm.weight" vs "norm.weight")."""
    k = min(2, len(b.split(".")))
    return a.split(".")[-k:] == b.split(".")[-k:]


def _shape_message(name: str, found: tuple, want: tuple, config: dict) -> str:
    if name in ("d2t", "t2d"):
        key = "draft_vocab_size" if name == "d2t" else "vocab_size"
        return (f"{name} has {found[0]} entries but config.json {key} is {config[key]}: the "
                f"vocab mapping does not belong to this draft. Rebuild 03 with --draft-vocab "
                f"{config['draft_vocab_size']} (and retrain), or fix {key}")
    return (f"weight {name!r} is {list(found)}, config.json implies {list(want)}: the config "
            f"and the weights disagree. {EXPORT_FIX}")


def layer_report(layer_ids: list[int], sglang_version: str | None = None) -> str:
    """Which target layers a draft reads, on one SGLang release or under both rules."""
    if sglang_version:
        got = sglang_capture_layers(layer_ids, sglang_version)
        return (f"eagle_aux_hidden_state_layer_ids={layer_ids}: SGLang {sglang_version} captures "
                f"{got} (the residual entering those layers = outputs of layers "
                f"{[i - 1 for i in got]})")
    reads = ", ".join(f"SGLang {rule} captures {sglang_capture_layers(layer_ids, v)}"
                      for rule, v in RULE_VERSIONS.items())
    return f"eagle_aux_hidden_state_layer_ids={layer_ids}: {reads}"


def _check_layer_ids(config: dict, expected: list[int] | None,
                     sglang_version: str | None) -> list[Problem]:
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    rules = ({sglang_version: sglang_version} if sglang_version else RULE_VERSIONS)
    try:
        reads = {rule: sglang_capture_layers(ids, v) for rule, v in rules.items()}
    except ExportError as e:
        return [Problem("error", str(e))]
    if expected is None:
        if len({tuple(r) for r in reads.values()}) > 1:
            return [Problem("warning", f"{layer_report(ids)}: the layers depend on the SGLang "
                                       "release; pass the target (or the release) to check them")]
        return []
    wrong = {rule: got for rule, got in reads.items() if got != list(expected)}
    if not wrong:
        return []
    try:
        fix = f"write {layer_ids_for(list(expected), sglang_version)} (capture index - 1)"
    except ExportError as e:
        fix = str(e)
    detail = "; ".join(f"SGLang {rule} captures {got}" for rule, got in wrong.items())
    return [Problem("error", f"eagle_aux_hidden_state_layer_ids={ids}: {detail}, but the draft "
                             f"was trained on captures {list(expected)}. In config.json {fix} "
                             "(eagle3.draft.export.export_sglang writes ids every release reads alike)")]


# ---------------------------------------------------------------- servers


def check_speculative_server(info: dict, draft_config: dict | None = None,
                             draft_dir: Path | None = None) -> list[Problem]:
    """The speculative server of a benchmark: EAGLE3 for an EAGLE-3 draft, sane chain flags."""
    problems = []
    algo = info.get("speculative_algorithm")
    eagle3 = draft_config is None or is_eagle3_draft(draft_config)
    if eagle3 and algo != "EAGLE3":
        effect = (" — it starts fine, but the target captures no aux states, the draft gets one "
                  "hidden state instead of three, fc is skipped and d2t ignored: acceptance "
                  "collapses to about 1" if algo == "EAGLE" else "")
        problems.append(Problem("error", f"speculative_algorithm={algo!r} with an EAGLE-3 draft"
                                f"{effect}. Restart the server with "
                                "--speculative-algorithm EAGLE3"))
    served = info.get("speculative_draft_model_path")
    if draft_dir is not None and served and Path(served).name != Path(draft_dir).name:
        problems.append(Problem("warning", f"the server serves the draft {served}, the check "
                                f"read {draft_dir}: make sure they are the same files"))
    if info.get("disable_cuda_graph"):
        problems.append(Problem("warning", "CUDA graphs are off (--disable-cuda-graph): every "
                                "draft step pays kernel-launch overhead and speculative decoding "
                                "can end up slower than no draft. Remove the flag"))
    steps, topk = info.get("speculative_num_steps"), info.get("speculative_eagle_topk")
    tokens = info.get("speculative_num_draft_tokens")
    if topk == 1 and steps and tokens and tokens != steps + 1:
        problems.append(Problem("warning", f"a chain (--speculative-eagle-topk 1) of {steps} steps "
                                f"verifies {steps + 1} tokens, the server says "
                                f"--speculative-num-draft-tokens {tokens}: set it to {steps + 1}"))
    return problems


# Server settings that change decoding speed on their own: a benchmark whose two servers differ
# in any of them does not measure the draft alone.
SPEED_KEYS = ("model_path", "tp_size", "dp_size", "ep_size", "quantization", "dtype",
              "kv_cache_dtype", "attention_backend", "disable_cuda_graph", "cuda_graph_max_bs",
              "mem_fraction_static", "max_running_requests", "chunked_prefill_size",
              "context_length", "enable_dp_attention")


def check_server_pair(baseline: dict, speculative: dict) -> list[Problem]:
    """Warnings for settings (other than the draft) in which the two servers differ."""
    diff = {k: (baseline.get(k), speculative.get(k)) for k in SPEED_KEYS
            if baseline.get(k) != speculative.get(k)}
    if not diff:
        return []
    listed = ", ".join(f"{k}: {b!r} vs {s!r}" for k, (b, s) in diff.items())
    return [Problem("warning", f"the baseline and speculative servers differ in more than the "
                               f"draft ({listed}): the speedup does not measure the draft alone. "
                               "Start both with the same flags")]


def check_streaming(info: dict) -> list[Problem]:
    """A benchmark that streams (for TTFT) wants deltas, not the whole output in every chunk."""
    if info.get("incremental_streaming_output"):
        return []
    return [Problem("warning", "the server streams cumulative output ids: every chunk re-sends "
                               "the whole reply (bytes grow with the square of its length), "
                               "which can make the benchmark client the bottleneck for long "
                               "replies at high concurrency. Start it with "
                               "--incremental-streaming-output (05 adds it to servers it "
                               "launches)")]


def check_baseline_server(info: dict) -> list[Problem]:
    """The baseline of a benchmark decodes without a draft."""
    algo = info.get("speculative_algorithm")
    if algo:
        return [Problem("error", f"the baseline server runs speculative decoding ({algo}): "
                                 "start it without --speculative-* flags")]
    return []


def load_t2d(draft_dir: Path):
    """The draft's `t2d` (bool `[target vocab]`: which target ids the draft can propose)."""
    from safetensors import safe_open

    for file in sorted(Path(draft_dir).glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            if "t2d" in f.keys():
                return f.get_tensor("t2d")
    raise PreflightError(f"{draft_dir}: no t2d tensor in its safetensors. {EXPORT_FIX}")


def check_vocab_coverage(t2d, records: Iterable[dict],
                         threshold: float = MIN_VOCAB_COVERAGE) -> tuple[float, list[Problem]]:
    """(share of supervised tokens whose id is in the draft vocabulary, warnings).

    `t2d`: bool array `[target vocab]`; `records`: tokenized records (input_ids, loss_mask).
    """
    import numpy as np

    t2d = np.asarray(t2d, dtype=bool)
    total = inside = 0
    for rec in records:
        ids = np.asarray(rec["input_ids"], dtype=np.int64)[np.asarray(rec["loss_mask"]) == 1]
        total += ids.size
        inside += int(t2d[ids].sum())
    coverage = inside / total if total else 1.0
    if coverage < threshold:
        return coverage, [Problem("warning", f"the draft vocabulary covers {coverage:.1%} of the "
                                  f"supervised eval tokens (< {threshold:.0%}): every other token "
                                  "ends a draft chain. Rebuild 03 with a larger --draft-vocab "
                                  "(03_vocab/report.json lists coverage at 8K-64K) and retrain")]
    return coverage, []


def check_draft_for_run(draft_dir: Path, target_dir: Path | None = None,
                        workdir: Path | None = None,
                        sglang_version: str | None = None) -> tuple[list[Problem], str]:
    """`check_draft` with what a pipeline run knows, and the layer report line.

    The target folder gives the hidden size, the vocabulary and SGLang's default captures
    `[2, N//2, N-3]`; `<workdir>/02b_hidden_states/manifest.json` gives the captures the
    training data really used (preferred); `<workdir>/01c_merged/eval.jsonl` gives the draft
    vocabulary's coverage of held-out supervised tokens.
    """
    from eagle3.core.records import read_jsonl
    from eagle3.core.stage import read_manifest
    from eagle3.core.target import default_capture_layers, read_target_info

    hidden = vocab = expected = None
    if target_dir is not None:
        info = read_target_info(target_dir)
        hidden, vocab = info.hidden_size, info.vocab_size
        expected = default_capture_layers(info.num_hidden_layers)
    if workdir is not None:
        manifest = read_manifest(Path(workdir) / "02b_hidden_states") or {}
        expected = manifest.get("capture_layers") or expected
    problems = check_draft(draft_dir, hidden, vocab, expected, sglang_version)
    eval_path = Path(workdir) / "01c_merged" / "eval.jsonl" if workdir is not None else None
    if eval_path is not None and eval_path.is_file() and not any(
            p.level == "error" for p in problems):
        coverage, warnings = check_vocab_coverage(load_t2d(draft_dir), read_jsonl(eval_path))
        log.info("draft vocabulary covers %.1f%% of supervised eval tokens", 100 * coverage)
        problems += warnings
    ids = (read_draft_config(draft_dir).get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    try:
        return problems, layer_report(ids, sglang_version) if ids else "no layer ids"
    except ExportError as e:
        return problems, str(e)
