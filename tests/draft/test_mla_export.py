"""The exported draft folders load completely in each engine's loader, with the EAGLE-3.1 options.

SGLang is not installed: its `load_weights` (0.5.23: kimi_k25_eagle3.py for the MLA draft,
llama_eagle3.py for the Llama one) is simulated from its source below, over the parameter names
its modules create. It skips unknown names (a log line for MLA, nothing for Llama) and leaves
parameters it never sees random, so the test counts both. The real vLLM loads the MLA folder in
tests/bench/test_vllm_mla.py (its loader refuses unknown and missing weights).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from draft_helpers import HEADS, INTER, KVL, NOPE, QL, ROPE, VD, VT, H, V, llama_draft, mla_draft
from safetensors.torch import load_file

from eagle3.draft.check import check_draft
from eagle3.draft.check_mla import check_mla_against_target
from eagle3.draft.export import export_sglang, load_draft
from eagle3.draft.model import Eagle3Draft
from eagle3.draft.speculators import speculators_config


def sglang_mla_params(fc_norm: bool) -> dict[str, tuple]:
    """Parameters of SGLang's Eagle3DeepseekV2ForCausalLM (prefix `model.`, the embedding set
    from the target), shapes as its modules create them."""
    m, a = "model.midlayer.", "model.midlayer.self_attn."
    params = {"model.fc.weight": (H, 3 * H), "model.norm.weight": (H,), "lm_head.weight": (VD, H),
              m + "input_layernorm.weight": (H,), m + "hidden_norm.weight": (H,),
              m + "post_attention_layernorm.weight": (H,),
              a + "fused_qkv_a_proj_with_mqa.weight": (QL + KVL + ROPE, 2 * H),
              a + "q_a_layernorm.weight": (QL,), a + "q_b_proj.weight": (HEADS * (NOPE + ROPE), QL),
              a + "kv_a_layernorm.weight": (KVL,), a + "kv_b_proj.weight": (HEADS * (NOPE + V), KVL),
              a + "o_proj.weight": (H, HEADS * V),
              m + "mlp.gate_up_proj.weight": (2 * INTER, H), m + "mlp.down_proj.weight": (H, INTER)}
    if fc_norm:
        params.update({f"model.fc_norm.{i}.weight": (H,) for i in range(3)})
    return params


def sglang_mla_load(tensors: dict, params: dict) -> tuple[dict, list, object]:
    """kimi_k25_eagle3.py `load_weights`: (loaded param -> shards, skipped names, hot_token_id)."""
    loaded, skipped, hot, cached = {}, [], None, {}
    for name, w in tensors.items():
        if name == "d2t" or name.endswith(".d2t"):
            hot = w + torch.arange(w.shape[0])
            continue
        if name == "t2d" or name.endswith(".t2d"):
            continue
        mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
        if not mapped.startswith("lm_head."):
            mapped = f"model.{mapped}"
        stacked = [(p, s, i) for p, s, i in ((".gate_up_proj", ".gate_proj", 0),
                                             (".gate_up_proj", ".up_proj", 1)) if s in mapped]
        if stacked and mapped.replace(stacked[0][1], stacked[0][0]) in params:
            target = mapped.replace(stacked[0][1], stacked[0][0])
            loaded.setdefault(target, {})[stacked[0][2]] = tuple(w.shape)
            continue
        if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            cached[mapped] = w
            q = mapped if "q_a_proj" in mapped else mapped.replace("kv_a_proj_with_mqa", "q_a_proj")
            kv = mapped if "kv_a_proj_with_mqa" in mapped else mapped.replace("q_a_proj",
                                                                              "kv_a_proj_with_mqa")
            if q in cached and kv in cached:
                fused = q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                if fused in params:
                    loaded[fused] = {0: tuple(torch.cat([cached.pop(q), cached.pop(kv)]).shape)}
            continue
        if mapped not in params:
            skipped.append(name)  # "Eagle3 MLA: skipping unexpected weight"
            continue
        loaded[mapped] = {0: tuple(w.shape)}
    skipped += list(cached)  # a q_a_proj without its kv_a_proj_with_mqa is never loaded
    return loaded, skipped, hot


def sglang_llama_load(tensors: dict, params: dict) -> tuple[dict, list]:
    """llama_eagle3.py `load_weights` (legacy names: midlayer -> layers.0; unknown: skipped)."""
    legacy = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
              "aux_norm_high": "fc_norm.2"}
    stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
               (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
               (".gate_up_proj", ".up_proj", 1)]
    loaded, skipped = {}, []
    for name, w in tensors.items():
        for old, new in legacy.items():
            name = name.replace(old, new) if old in name else name
        if "d2t" in name or "t2d" in name:
            continue
        for param, shard_name, shard in stacked:
            if shard_name in name:
                name = name.replace(shard_name, param)
                full = name if name in params else f"model.{name}"
                (loaded.setdefault(full, {}).__setitem__(shard, tuple(w.shape))
                 if full in params else skipped.append(name))
                break
        else:
            full = name if name in params else f"model.{name}"
            (loaded.setdefault(full, {}).__setitem__(0, tuple(w.shape)) if full in params
             else skipped.append(name))
    return loaded, skipped


def sglang_llama_params(cfg, fc_norm: bool) -> set[str]:
    m = "model.layers.0."
    names = {"model.fc.weight", "model.norm.weight", "lm_head.weight",
             m + "input_layernorm.weight", m + "hidden_norm.weight",
             m + "post_attention_layernorm.weight", m + "self_attn.qkv_proj.weight",
             m + "self_attn.o_proj.weight", m + "mlp.gate_up_proj.weight", m + "mlp.down_proj.weight"}
    return names | ({f"model.fc_norm.{i}.weight" for i in range(3)} if fc_norm else set())


@pytest.mark.parametrize("options", [False, True])
def test_sglang_loads_every_mla_tensor_when_the_draft_is_exported(tmp_path, options):
    draft = mla_draft(fc_norm=options, norm_output=options)
    export_sglang(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2" and config["num_hidden_layers"] == 1
    assert (config["fc_norm"], config["norm_output"]) == (options, options)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    params = sglang_mla_params(options)
    loaded, skipped, hot = sglang_mla_load(tensors, params)
    assert skipped == []
    assert set(loaded) == set(params)  # nothing left random
    for name, shards in loaded.items():
        if "gate_up_proj" in name:
            assert sorted(shards) == [0, 1] and 2 * shards[0][0] == params[name][0]
        else:
            assert shards[0] == params[name], name
    assert torch.equal(hot, draft.d2t + torch.arange(VD))
    # and our own loader round-trips the folder (the offline evaluator reads it)
    again = load_draft(tmp_path)
    assert again.cfg == draft.cfg
    for name, t in draft.state_dict().items():
        want = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        torch.testing.assert_close(again.state_dict()[name], want)


def test_sglang_mla_loader_simulation_reports_a_misnamed_tensor():
    tensors = {"midlayer.self_attn.q_a_proj.weight": torch.zeros(QL, 2 * H),
               "midlayer.self_attn.kv_a_proj.weight": torch.zeros(KVL + ROPE, 2 * H)}
    loaded, skipped, _ = sglang_mla_load(tensors, sglang_mla_params(False))
    assert "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight" not in loaded
    assert set(skipped) == {"midlayer.self_attn.kv_a_proj.weight",
                            "model.midlayer.self_attn.q_a_proj.weight"}


def test_sglang_loads_every_llama_tensor_with_the_eagle31_options(tmp_path):
    draft = llama_draft(fc_norm=True, norm_output=True)
    export_sglang(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    loaded, skipped = sglang_llama_load(load_file(str(tmp_path / "model.safetensors")),
                                        sglang_llama_params(draft.cfg, True))
    assert skipped == [] and set(loaded) == sglang_llama_params(draft.cfg, True)
    assert sorted(loaded["model.layers.0.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    spec = speculators_config(draft.cfg, None, 3)  # vLLM's update_eagle3 copies both
    assert (spec["fc_norm"], spec["norm_output"]) == (True, True)
    assert load_draft(tmp_path).cfg == draft.cfg


def test_speculators_format_refuses_the_mla_draft():
    with pytest.raises(ValueError, match="serves the MLA draft's SGLang folder"):
        speculators_config(mla_draft().cfg, None, 3)


def _export_and_edit(tmp_path, **changes):
    export_sglang(mla_draft(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k)
        else:
            config[k] = v
    (tmp_path / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("change,message", [
    ({"model_type": "deepseek_v3"}, "MTP draft"),
    ({"q_lora_rank": None}, "requires q_lora_rank"),
    ({"num_hidden_layers": 2}, "exactly 1 layer"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "vLLM captures those"),
])
def test_preflight_refuses_an_mla_draft_folder_when(tmp_path, change, message):
    _export_and_edit(tmp_path, **change)
    errors = [p.message for p in check_draft(tmp_path, H, VT, [2, 4, 5]) if p.level == "error"]
    assert any(message in e for e in errors), errors


def test_preflight_accepts_the_exported_mla_draft_and_checks_the_target_latent(tmp_path):
    config = _export_and_edit(tmp_path / "draft")
    assert check_draft(tmp_path / "draft", H, VT, [2, 4, 5]) == []
    target = tmp_path / "target"
    target.mkdir()
    dims = {"q_lora_rank": QL, "kv_lora_rank": KVL, "qk_nope_head_dim": NOPE,
            "qk_rope_head_dim": ROPE, "v_head_dim": V}
    (target / "config.json").write_text(json.dumps(dims))
    assert check_mla_against_target(config, target) == []
    (target / "config.json").write_text(json.dumps({**dims, "kv_lora_rank": 512}))
    [(level, message)] = check_mla_against_target(config, target)
    assert level == "error" and "KV page size" in message
    (target / "config.json").write_text(json.dumps({"hidden_size": 8}))
    [(level, message)] = check_mla_against_target(config, target)
    assert "--draft-arch llama" in message


def test_llama_draft_export_is_unchanged_without_the_options(tmp_path):
    from eagle3.draft.export import CONFIG_KEYS

    export_sglang(llama_draft(), tmp_path)
    assert set(json.loads((tmp_path / "config.json").read_text())) == CONFIG_KEYS
    assert isinstance(load_draft(tmp_path), Eagle3Draft)
