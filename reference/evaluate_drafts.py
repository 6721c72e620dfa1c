"""Many drafts against one target on the same held-out prompts, with the production evaluator.

Stage 05 measures one draft per run and decodes the plain baseline every time; the sweeps of the
reference benchmark (data sizes, epochs, bf16 vs fp8 states, the controls) compare a dozen drafts
on the same prompts, so this module loads the target once, decodes each baseline once (cached on
disk) and runs `eagle3.bench.evaluate.speculative_decode` -- the code 05 runs -- for every draft.
Every result is one JSON file under the cache folder, so an interrupted sweep resumes.

Results per draft and step count: acceptance length (committed tokens / verify passes),
per-position acceptance, speculative tok/s and speedup over the plain decoding of the same
prompts, lossless mismatches (temperature 0) and the loop share of the outputs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3.bench.evaluate import (
    Eagle3Proposer,
    TargetRunner,
    autoregressive_decode,
    speculative_decode,
)
from eagle3.bench.hf import offline_summary, sampling_generator
from eagle3.core.chat import ChatRenderer
from eagle3.core.loops import loop_stats
from eagle3.core.progress import progress
from eagle3.core.stage import atomic_write_json
from eagle3.core.target import load_embedding, load_hf_model, load_tokenizer
from eagle3.draft.export import load_draft
from reference.controls import (
    FinalStateProposer,
    final_state_layers,
    layer_similarity,
    shifted_layers,
)

log = logging.getLogger(__name__)


@dataclass
class EvalSpec:
    """One draft evaluation."""

    name: str
    draft: Path
    steps: list[int] = field(default_factory=lambda: [3])
    temperature: float = 0.0
    num_prompts: int = 16
    max_new_tokens: int = 160
    control: str = ""  # "" | "final_state" | "shifted_layers" (reference.controls)


class DraftEvaluator:
    """One target in memory; drafts evaluated against it on the first N of `prompts`."""

    def __init__(self, target: Path, prompts: list[list[int]], cache_dir: Path,
                 device: str = "cpu", dtype: str = "float32", seed: int = 0):
        self.target, self.prompts, self.cache_dir = Path(target), prompts, Path(cache_dir)
        self.device, self.dtype, self.seed = device, getattr(torch, dtype), seed
        self.model = load_hf_model(target, dtype, device)
        self.embed = load_embedding(target).to(device, self.dtype)
        self.eos = {ChatRenderer(load_tokenizer(target)).end_of_turn_id}
        self.num_layers = self.model.config.num_hidden_layers

    def baseline(self, num_prompts: int, max_new: int, temperature: float) -> dict:
        """Plain decoding of the first `num_prompts` prompts (cached): outputs, tok/s, loops."""
        path = self.cache_dir / f"baseline_p{num_prompts}_n{max_new}_t{temperature:g}.json"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Workers side by side (reference/parallel.py) share a baseline: the first decodes it,
        # the others wait on the lock and read the file.
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return json.loads(path.read_text())
            return self._decode_baseline(path, num_prompts, max_new, temperature)

    def _decode_baseline(self, path: Path, num_prompts: int, max_new: int,
                         temperature: float) -> dict:
        outputs, seconds = [], 0.0
        bar = progress(total=num_prompts, desc=f"plain decoding t={temperature:g}", unit="prompt")
        for k, prompt in enumerate(self.prompts[:num_prompts]):
            res = autoregressive_decode(TargetRunner(self.model, [0]), prompt, max_new, self.eos,
                                        temperature, sampling_generator(self.seed, k))
            outputs.append(res.output_ids)
            seconds += res.seconds
            bar.update(1)
        bar.close()
        tokens = sum(len(o) for o in outputs)
        out = {"prompts": num_prompts, "max_new_tokens": max_new, "temperature": temperature,
               "tokens": tokens, "seconds": seconds, "tok_s": tokens / max(seconds, 1e-9),
               "seconds_per_token": seconds / max(tokens, 1),
               "loop": loop_stats(outputs, self.eos).to_dict(), "output_ids": outputs}
        atomic_write_json(path, out)
        return out

    def _proposer(self, spec: EvalSpec):
        """(proposer, capture layers the target hands it) for a spec's draft and control."""
        draft = load_draft(spec.draft, self.device, self.dtype)
        if spec.control == "final_state":
            return FinalStateProposer(draft, self.embed), final_state_layers(self.num_layers)
        proposer = Eagle3Proposer(draft, self.embed)
        if spec.control == "shifted_layers":
            return proposer, shifted_layers(draft.cfg.capture_layers)
        if spec.control:
            raise ValueError(f"unknown control {spec.control!r}")
        return proposer, list(draft.cfg.capture_layers)

    def run(self, spec: EvalSpec) -> dict:
        """Evaluate one spec (cached by name); returns its result."""
        path = self.cache_dir / f"eval_{spec.name}.json"
        if path.exists():
            return json.loads(path.read_text())
        base = self.baseline(spec.num_prompts, spec.max_new_tokens, spec.temperature)
        proposer, capture = self._proposer(spec)
        out = {**asdict(spec), "draft": str(spec.draft), "capture_layers": capture,
               "baseline_tok_s": base["tok_s"], "baseline_loop_share": base["loop"]["share"],
               "steps": {}}
        if spec.control == "shifted_layers":
            trained = list(proposer.draft.cfg.capture_layers)
            out["layer_similarity"] = layer_similarity(
                self.model, self.prompts[: spec.num_prompts], trained,
                capture[0] - trained[0])
        for steps in spec.steps:
            out["steps"][str(steps)] = self._run_steps(spec, proposer, capture, steps, base)
        atomic_write_json(path, out)
        return out

    def _run_steps(self, spec: EvalSpec, proposer, capture, steps: int, base: dict) -> dict:
        results, t0 = [], time.perf_counter()
        bar = progress(total=spec.num_prompts, desc=f"{spec.name} steps {steps}", unit="prompt")
        for k, prompt in enumerate(self.prompts[: spec.num_prompts]):
            results.append(speculative_decode(
                self.model, proposer, prompt, spec.max_new_tokens, self.eos, steps, capture,
                spec.temperature, sampling_generator(self.seed, k)))
            bar.update(1)
        bar.close()
        outputs = [r.output_ids for r in results]
        return {**offline_summary(results, base["output_ids"], steps, base["tok_s"],
                                  spec.temperature, self.eos),
                "tokens": sum(len(o) for o in outputs),
                "loop": loop_stats(outputs, self.eos).to_dict(),
                "wall_s": time.perf_counter() - t0, "output_ids": outputs}


def probe_seconds_per_token(target: Path, prompts_jsonl: Path, workdir: Path, device: str,
                            dtype: str, tokens: int = 24, warmup: int = 4) -> float:
    """Seconds per token of plain batch-1 decoding of the target (the first held-out prompt)."""
    from eagle3.bench.prompts import load_prompt_set

    model = load_hf_model(target, dtype, device)
    renderer = ChatRenderer(load_tokenizer(target))
    prompt = load_prompt_set(str(prompts_jsonl), workdir, renderer, 1).prompts[0]
    autoregressive_decode(TargetRunner(model, [0]), prompt, warmup, set())  # warm up kernels
    res = autoregressive_decode(TargetRunner(model, [0]), prompt, tokens, set())
    del model
    return res.seconds / max(len(res.output_ids), 1)


def estimate_seconds(spec: EvalSpec, seconds_per_token: float, acceptance: float = 2.0) -> float:
    """Rough time of a spec from the plain decoding cost of one token (for the time budget):
    each verify pass costs about one target pass plus `steps` draft passes at ~1/4 of one."""
    tokens = spec.num_prompts * spec.max_new_tokens
    passes = sum(tokens / acceptance * (1 + 0.25 * s) for s in spec.steps)
    return passes * seconds_per_token
