"""The shared stage flags: every stage config has them, with one default each."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from eagle3.core.cli import StageFlags, UpstreamStageFlags, build_parser

STAGE_CONFIGS = {"01_prepare_datasets": "PrepareConfig", "01b_generate_synthetic": "GenerateConfig",
                 "02b_extract_hidden_states_sglang": "ExtractConfig",
                 "03_build_vocab_mapping": "VocabConfig", "05_benchmark": "BenchmarkConfig"}


@pytest.mark.parametrize("script", sorted(STAGE_CONFIGS))
def test_stage_config_inherits_the_shared_flags_with_their_defaults(script):
    cls = getattr(importlib.import_module(script), STAGE_CONFIGS[script])
    base = StageFlags if script == "01_prepare_datasets" else UpstreamStageFlags
    assert issubclass(cls, base)
    help_text = build_parser(cls).format_help()
    for flag in ("--workdir", "--force", "--log-level"):
        assert flag in help_text
    assert ("--allow-partial" in help_text) == (base is UpstreamStageFlags)


def test_stage_flags_parse_to_the_declared_defaults():
    from eagle3.train.config import TrainConfig

    ns = build_parser(TrainConfig).parse_args(["--target", "t"])
    assert (ns.workdir, ns.force, ns.log_level, ns.allow_partial) == (
        Path("runs/default"), False, "INFO", False)
