"""vLLM's CPU build serves the exported MLA draft on a DeepSeek-V3 target, for real.

Its loader refuses unknown weight names and raises on parameters no checkpoint tensor filled
(`DefaultModelLoader`: "Following weights were not initialized from checkpoint"), so a server that
starts has loaded every tensor of the folder. Greedy speculative output must equal the target's
own greedy output, the aux layers vLLM logs must be the trained captures, and its acceptance is
set beside the offline evaluator's on the same prompts (eagle3.bench.evaluate, the same draft):
the same number of verify rounds and accepted tokens.

The target is the tiny DeepSeek-V3 in the shape vLLM's CPU MLA kernel serves (latent 576:
kv_lora_rank 512 + qk_rope_head_dim 64; noaux_tc/sigmoid routing). `vllm_mla_target` rebuilds
the default tiny target's weights at those sizes; `eagle3.tiny` now has the same variant
(`--arch deepseek_v3_vllm`), to which this helper can switch.

Skipped without a vLLM venv (the `vllm_python` fixture: `make install-vllm` or
EAGLE3_VLLM_PYTHON, e.g. /opt/vllm-venv/bin/python).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import torch
from vllm_helpers import MLA_BACKEND_ARGS, SERVER_ENV, UNIPROC_ARGS

VLLM_FIELDS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "topk_method": "noaux_tc",
               "scoring_func": "sigmoid"}


def vllm_mla_target(out: Path) -> Path:
    """The tiny target (tokenizer, template) with DeepSeek-V3 weights vLLM's CPU MLA serves."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    from eagle3.tiny.target import make_tiny_target

    make_tiny_target(out)
    config = AutoConfig.from_pretrained(out)
    for k, v in VLLM_FIELDS.items():
        setattr(config, k, v)
    config.head_dim = config.qk_rope_head_dim  # derived in DeepseekV3Config.__init__: RoPE width
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # as eagle3/tiny/target.py: a peaked target
    model.eval().save_pretrained(out)
    return out


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _serve(python: str, target: Path, draft: Path, steps: int, port: int, log: Path):
    env = {**os.environ, **SERVER_ENV, "PYTHONPATH": ""}
    # the draft's attention backend is its own setting (vLLM's SpeculativeConfig)
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": steps,
            "attention_backend": MLA_BACKEND_ARGS[1]}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
           "--speculative-config", json.dumps(spec), "--max-num-seqs", "1", *MLA_BACKEND_ARGS,
           *UNIPROC_ARGS.split()]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900  # 35-60 s on an idle machine
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            _get(f"http://127.0.0.1:{port}/v1/models")
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise AssertionError(f"vLLM did not start:\n{log.read_text()[-4000:]}")


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text,
                                                        re.M))


def test_vllm_serves_the_mla_draft_with_target_greedy_output_and_trained_layers(tmp_path,
                                                                               vllm_python):
    from transformers import AutoModelForCausalLM

    from eagle3.bench.evaluate import Eagle3Proposer, greedy_decode, speculative_decode
    from eagle3.core.target import default_capture_layers, read_target_info
    from eagle3.draft.export import export_sglang
    from eagle3.train.loop import TrainConfig, build_draft, build_draft_config

    target = vllm_mla_target(tmp_path / "target")
    info = read_target_info(target)
    captures = default_capture_layers(info.num_hidden_layers)
    vd = 256
    d2t = torch.zeros(vd, dtype=torch.int64)  # draft ids 0..255 are target ids 0..255
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[:vd] = True
    cfg = TrainConfig(target=target, draft_arch="mla", fc_norm=True, norm_output=True)
    dcfg = build_draft_config(cfg, info, vd, captures)
    assert (dcfg.kv_lora_rank, dcfg.qk_rope_head_dim) == (512, 64)  # from the target
    draft = build_draft(dcfg, 0, d2t, t2d)
    export_sglang(draft, tmp_path / "draft")
    steps, prompts = 3, [list(range(5, 25)), list(range(40, 52))]
    log = tmp_path / "vllm.log"
    proc = _serve(vllm_python, target, tmp_path / "draft", steps, 18731, log)
    try:
        served = [_post("http://127.0.0.1:18731/v1/completions",
                        {"model": str(target), "prompt": p, "max_tokens": 24,
                         "temperature": 0.0, "return_token_ids": True,
                         "ignore_eos": True})["choices"][0]
                  for p in prompts]
        metrics = _get("http://127.0.0.1:18731/metrics").decode()
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert re.search(rf"auxiliary layers from (speculative )?config: \(?{captures[0]}, "
                     rf"{captures[1]}, {captures[2]}", text), text[-3000:]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    proposer = Eagle3Proposer(draft.eval(), model.get_input_embeddings().weight.detach())
    offline = []
    for p, s in zip(prompts, served):
        plain = greedy_decode(model, p, 24, set())
        spec = speculative_decode(model, proposer, p, 24, set(), steps, captures)
        assert spec.output_ids == plain.output_ids  # offline speculative = plain greedy
        assert s["token_ids"] == plain.output_ids  # served speculative = plain greedy
        offline += spec.accept_lengths
    drafts = _metric(metrics, "vllm:spec_decode_num_drafts_total")
    accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    served_accept = 1 + accepted / max(drafts, 1)
    offline_accept = sum(offline) / len(offline)
    print(f"served acceptance {served_accept:.3f} ({drafts:.0f} drafts), offline "
          f"{offline_accept:.3f} ({len(offline)} rounds)")
    # the same verify rounds and accepted tokens as the offline evaluator (both greedy, the
    # same draft: an untrained one accepts ~nothing, so this checks the counting, not quality)
    assert drafts == len(offline) > 0
    assert accepted == sum(a - 1 for a in offline)
