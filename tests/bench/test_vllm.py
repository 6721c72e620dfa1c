"""vLLM's layer rule, its metrics (eagle3/bench/vllm_metrics.py) and the command 05 launches (no
server: see test_vllm_serving.py for the real ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.bench.vllm import logged_capture_layers, speculative_config, vllm_command
from eagle3.bench.vllm_metrics import (
    SpecCounters,
    acceptance_figures,
    check_counters,
    parse_spec_metrics,
)
from eagle3.draft.check_vllm import check_vllm_layers, vllm_capture_layers

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.8e9
"""


def test_parse_spec_metrics_reads_the_counters_per_position():
    c = parse_spec_metrics(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (10, 30, 14)
    assert c.accepted_per_pos == [8, 4, 2]


def test_acceptance_figures_are_one_plus_accepted_over_drafts_per_level():
    before = SpecCounters(4, 12, 2, [2, 0, 0])
    delta = parse_spec_metrics(METRICS).minus(before)

    class R:  # two requests: 1 prefill token each + the committed tokens of 6 rounds
        def __init__(self, n):
            self.completion_tokens = n

    fig = acceptance_figures(delta, [R(1 + 9), R(1 + 9)])
    assert fig["acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert fig["tokens_per_round"] == pytest.approx(18 / 6)
    assert fig["per_position_acceptance"] == pytest.approx([1.0, 4 / 6, 2 / 6])


def test_vllm_capture_layers_reads_ids_as_capture_indices_or_its_silent_default():
    assert vllm_capture_layers({"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}, 8) == (
        [2, 4, 5], "config")  # sorted and deduplicated, as _set_aux_hidden_state_layers does
    assert vllm_capture_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
                               8) == ([1, 3, 4], "config")
    assert vllm_capture_layers({}, 61) == ([2, 30, 58], "default")


def test_check_vllm_layers_refuses_the_sglang_folder_ids_with_the_fix():
    sglang = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    problems, _ = check_vllm_layers(sglang, 61, [2, 30, 58])
    assert [p.level for p in problems] == ["error"]
    assert "final_speculators" in problems[0].message and "[2, 30, 58]" in problems[0].message
    ok, report = check_vllm_layers({"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}, 61,
                                   [2, 30, 58])
    assert ok == [] and "[2, 30, 58]" in report


def test_logged_capture_layers_reads_vllms_own_log_line():
    line = ("(EngineCore pid=1) INFO 12-01 17:08:55 [gpu_model_runner.py:5244] Using auxiliary "
            "layers from speculative config: (2, 4, 5)\n")
    assert logged_capture_layers("noise\n" + line) == [2, 4, 5]
    assert logged_capture_layers("no such line") is None


def test_vllm_command_sets_model_port_and_speculative_config_itself(tmp_path):
    spec = speculative_config(tmp_path / "d", 3)
    cmd = vllm_command("py", tmp_path / "t", "--enforce-eager --dtype float32", 8000, spec)
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model",
                       str(tmp_path / "t")]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str((tmp_path / "d").resolve()),
        "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="--port"):
        vllm_command("py", tmp_path, "--port 1", 8000)


def test_vllm_source_has_the_layer_rule_05_assumes(vllm_python):
    """The rule in eagle3/bench/vllm.py, against the installed vLLM's own source."""
    import subprocess

    site = subprocess.run([vllm_python, "-c", "import importlib.util as u; "  # no vllm import
                           "print(u.find_spec('vllm').submodule_search_locations[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    runner = (Path(site) / "v1/worker/gpu_model_runner.py").read_text()
    assert '"Using auxiliary layers from speculative config: %s"' in runner
    assert 'getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)' in runner
    assert 'eagle_config.get("eagle_aux_hidden_state_layer_ids")' in runner
    interfaces = (Path(site) / "model_executor/models/interfaces.py").read_text()
    assert "return (2, num_layers // 2, num_layers - 3)" in interfaces
    assert "tuple(sorted(set(layers)))" in interfaces
    llama = (Path(site) / "model_executor/models/llama.py").read_text()
    # id i = hidden_states + residual before layer i runs (idx + 1 after layer idx)
    assert "aux_hidden_states, idx + 1, hidden_states, residual" in llama
    deepseek = (Path(site) / "model_executor/models/deepseek_v2.py").read_text()
    # the same before layer idx runs (inside the loop, ahead of `layer(...)`)
    at = deepseek.index("if idx in self.aux_hidden_state_layers:")
    assert deepseek.index("aux_hidden_state = hidden_states + residual", at) < deepseek.index(
        "hidden_states, residual = layer(", at)


# ---------------------------------------------------------------- the default draft folder


def _write_04_manifest(workdir: Path, args: dict) -> None:
    stage = workdir / "04_train"
    stage.mkdir(parents=True)
    (stage / "manifest.json").write_text(json.dumps({"stage": "04_train", "complete": True,
                                                     "args": args}))


@pytest.mark.parametrize("args,folder", [({"draft_arch": "llama"}, "final_speculators"),
                                         ({"draft_arch": "mla"}, "final"),
                                         ({"lr": 1e-3}, "final_speculators")])  # before the flag
def test_default_vllm_draft_is_the_folder_04_wrote_for_its_architecture(tmp_path, args, folder):
    from eagle3.draft.check_vllm import default_vllm_draft

    _write_04_manifest(tmp_path, args)
    assert default_vllm_draft(tmp_path) == tmp_path / "04_train" / folder


def test_default_vllm_draft_without_04s_manifest_asks_for_draft(tmp_path):
    from eagle3.core.stage import StageError
    from eagle3.draft.check_vllm import default_vllm_draft

    with pytest.raises(StageError, match="--draft"):
        default_vllm_draft(tmp_path)


def test_05_vllm_check_only_serves_an_mla_run_from_final(tmp_path, monkeypatch, capsys):
    import importlib

    from eagle3.bench import vllm

    bench = importlib.import_module("05_benchmark")
    _write_04_manifest(tmp_path, {"draft_arch": "mla"})
    (tmp_path / "target").mkdir()
    (tmp_path / "04_train" / "final").mkdir()  # its files: checked first, none to damage
    seen = []
    monkeypatch.setattr(vllm, "check_vllm_draft",
                        lambda draft, target, workdir: seen.append(draft) or ([], "-", None))
    assert bench.main(["--workdir", str(tmp_path), "--target", str(tmp_path / "target"),
                       "--backend", "vllm", "--steps", "3", "--check-only"]) == 0
    assert seen == [tmp_path / "04_train" / "final"]


def test_check_counters_refuses_deltas_that_cannot_be_the_levels():
    class R:
        def __init__(self, n):
            self.completion_tokens = n

    records = [R(10), R(10)]  # 20 output tokens
    assert check_counters(SpecCounters(6, 18, 12, [6, 4, 2]), records, 3) is None
    for delta, k, words in (
            (SpecCounters(6, 18, -1, [6, 4, 2]), 3, "went backwards"),
            (SpecCounters(6, 18, 19, [6, 6, 6]), 3, "19 accepted of 18 drafted tokens"),
            (SpecCounters(6, 18, 12, [6, 4, 2]), 2, "more than K = 2 a round"),
            (SpecCounters(6, 18, 12, [7, 3, 2]), 3, "a position accepted in more than the 6"),
            (SpecCounters(21, 63, 12, [6, 4, 2]), 3, "21 rounds for 20 output tokens"),
            (SpecCounters(0, 0, 0, []), 3, "no verify rounds counted over 2 answers")):
        assert words in check_counters(delta, records, k)
    assert "every answer holds one token" in check_counters(SpecCounters(), [R(1)], 3)
