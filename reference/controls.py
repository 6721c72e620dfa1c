"""Negative controls of the reference benchmark: two serving mistakes meant to collapse
acceptance, and the project checks that must catch each before any GPU time is spent. On the
H200 reference target (BENCHMARKS.md) the first collapsed it to 1.00; the second, a shift by one
layer, cost almost nothing (1.613 against 1.618), presumably because adjacent residual
states are that alike (not measured).

1. The `EAGLE` vs `EAGLE3` mistake (docs/PIPELINE.md): a server started with
   `--speculative-algorithm EAGLE` and an EAGLE-3 draft captures no aux states; the draft gets
   the target's final hidden state (H wide instead of 3H), SGLang's `LlamaForCausalLMEagle3`
   skips `fc` because the width already matches, and `d2t` is not applied, so draft-vocabulary
   ids are taken for target ids. `FinalStateProposer` does exactly that against the offline
   evaluator (the target is asked for its final, post-norm state as the "aux" state).
   Caught by: `eagle3.bench.preflight.check_speculative_server` (algorithm EAGLE with an EAGLE-3
   draft). `check_draft`'s fc-width check catches the related mistake of a draft *trained* on
   the final state only (fc `[H, H]`), not this one: the draft folder itself is correct.
2. Aux layers shifted by one: the draft is served the captures one layer deeper than those it
   was trained on, which is what SGLang 0.5.4.post2-0.5.12 does with a config that writes the
   capture indices themselves (`[2, N//2, N-3]`) as `eagle_aux_hidden_state_layer_ids`.
   Evaluated with the trained draft on captures `[l + 1 for l in capture_layers]`.
   Caught by: `eagle3.bench.preflight.check_draft(..., expected_captures=<02b capture layers>)` on a
   draft folder whose config names the shifted layers.

Shapes: N positions, H target hidden (= draft hidden here), K aux width.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from eagle3.bench.evaluate import Eagle3Proposer
from eagle3.bench.preflight import check_speculative_server
from eagle3.core.preflight import PreflightError, raise_on_errors
from eagle3.draft.check import check_draft, read_draft_config

CONTROLS = ("final_state", "shifted_layers")


class _EagleModeDraft(nn.Module):
    """An EAGLE-3 draft as SGLang runs it under `--speculative-algorithm EAGLE`: `fc` applied
    only when the incoming state is not already the draft's width, and no `d2t` mapping."""

    def __init__(self, draft):
        super().__init__()
        self.inner = draft
        self.cfg = draft.cfg
        self.fc_calls = 0  # how often fc really ran (the tests check it never does here)
        self.register_buffer("d2t", torch.zeros_like(draft.d2t))  # ignored: ids map to themselves

    def project_aux(self, hidden_NK: torch.Tensor) -> torch.Tensor:
        # sglang/srt/models/llama_eagle3.py: `if hidden_states.shape[-1] != embeds.shape[-1]:
        # hidden_states = self.fc(hidden_states)` -- a final state of width H passes straight on.
        if hidden_NK.shape[-1] == self.cfg.hidden_size:
            return hidden_NK
        self.fc_calls += 1
        return self.inner.project_aux(hidden_NK)

    def step(self, *args, **kwargs):
        return self.inner.step(*args, **kwargs)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # d2t not applied: a draft-vocabulary id is taken for a target id


class FinalStateProposer(Eagle3Proposer):
    """The `EAGLE` mistake: proposes from the target's final hidden state instead of fc(aux).

    Use with a target that captures the final state (`final_state_layers`) in place of the aux
    layers; everything else is the production proposer.
    """

    def __init__(self, draft, embed_VH: torch.Tensor):
        super().__init__(_EagleModeDraft(draft), embed_VH)


def final_state_layers(num_hidden_layers: int) -> list[int]:
    """Capture index of the final state: transformers' last `hidden_states` entry (post-norm)."""
    return [num_hidden_layers]


def shifted_layers(capture_layers: list[int], shift: int = 1) -> list[int]:
    """The captures a draft is served when its layer ids are off by `shift`."""
    return [layer + shift for layer in capture_layers]


@torch.no_grad()
def layer_similarity(model, prompts: list[list[int]], capture_layers: list[int],
                     shift: int = 1) -> dict:
    """How alike the states a draft was trained on and the shifted ones it is served are.

    Over every position of `prompts` (one forward each), per capture layer l of transformers'
    `hidden_states`: mean cosine similarity of h[l] and h[l + shift], and the relative change
    ||h[l + shift] - h[l]|| / ||h[l]||. Explains how much the shifted-layers control can cost.
    """
    cos = {layer: [] for layer in capture_layers}
    rel = {layer: [] for layer in capture_layers}
    for prompt in prompts:
        x = torch.tensor([prompt], device=model.device)
        hs = model(input_ids=x, output_hidden_states=True).hidden_states
        for layer in capture_layers:
            a, b = hs[layer][0].float(), hs[layer + shift][0].float()
            cos[layer] += torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()
            rel[layer] += ((b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)).tolist()
    return {str(layer): {"served": layer + shift, "mean_cosine": sum(cos[layer]) / len(cos[layer]),
                         "mean_relative_change": sum(rel[layer]) / len(rel[layer]),
                         "positions": len(cos[layer])} for layer in capture_layers}


# ---------------------------------------------------------------- detection


def _outcome(problems) -> dict:
    """{"detected", "errors"} from a check's problems, through the project's own gate."""
    try:
        raise_on_errors(problems, "control")
    except PreflightError as e:
        return {"detected": True, "errors": [str(p) for p in problems if p.level == "error"],
                "message": str(e)}
    return {"detected": False, "errors": []}


def detect_eagle_mistake(draft_dir: Path) -> dict:
    """Run the speculative-server preflight on the flags of an `EAGLE` server serving the draft.

    Also runs it on the correct `EAGLE3` flags, which must pass (a check that refuses both
    detects nothing).
    """
    config = read_draft_config(draft_dir)
    flags = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(draft_dir),
             "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4}
    wrong = _outcome(check_speculative_server(flags, config, draft_dir))
    right = _outcome(check_speculative_server({**flags, "speculative_algorithm": "EAGLE3"},
                                              config, draft_dir))
    return {"check": "eagle3.bench.preflight.check_speculative_server", "wrong": wrong,
            "correct_passes": not right["detected"],
            "detected": wrong["detected"] and not right["detected"]}


def write_shifted_draft(draft_dir: Path, out_dir: Path, shift: int = 1) -> Path:
    """A copy of the draft folder whose config names the aux layers shifted by `shift`."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(draft_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    eagle = config["eagle_config"]
    eagle["eagle_aux_hidden_state_layer_ids"] = shifted_layers(
        eagle["eagle_aux_hidden_state_layer_ids"], shift)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def detect_shifted_layers(draft_dir: Path, capture_layers: list[int], target_hidden: int,
                          target_vocab: int, scratch: Path) -> dict:
    """Run the draft-folder preflight against the captures the draft was trained on (from the
    02b manifest): on the draft as exported (must pass) and on a copy naming shifted layers."""
    shifted = write_shifted_draft(draft_dir, Path(scratch) / "shifted_layer_ids")
    kwargs = {"target_hidden_size": target_hidden, "target_vocab_size": target_vocab,
              "expected_captures": list(capture_layers)}
    wrong = _outcome(check_draft(shifted, **kwargs))
    right = _outcome(check_draft(draft_dir, **kwargs))
    return {"check": "eagle3.bench.preflight.check_draft(expected_captures=02b capture layers)",
            "wrong": wrong, "correct_passes": not right["detected"],
            "correct_errors": right["errors"],
            "detected": wrong["detected"] and not right["detected"]}
