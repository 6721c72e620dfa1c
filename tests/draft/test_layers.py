"""The SGLang layer-id rule: which captures each release reads from a draft config's ids."""

from __future__ import annotations

import pytest

from eagle3.draft.layers import (
    SGLANG_LAYER_RULES,
    LayerIdError,
    describe_layers,
    layer_ids_for,
    rule_for,
    sglang_capture_layers,
)


def test_layer_ids_name_the_capture_layers_on_every_sglang_release():
    ids = layer_ids_for([2, 30, 58])
    assert ids == [1, 29, 57]
    for version in ("0.5.4.post2", "0.5.10", "0.5.12", "0.5.13", "0.5.23"):
        assert sglang_capture_layers(ids, version) == [2, 30, 58], version
    # the tempting mistake: writing the capture indices themselves
    assert sglang_capture_layers([2, 30, 58], "0.5.12") == [3, 31, 59]


def test_layer_ids_refused_when_no_id_list_works_on_all_releases():
    with pytest.raises(LayerIdError, match="--sglang-version"):
        layer_ids_for([3, 30, 58])
    assert layer_ids_for([3, 30, 58], "0.5.13") == [3, 30, 58]
    assert layer_ids_for([3, 30, 58], "0.5.12") == [2, 29, 57]


def test_rule_for_refuses_a_release_when_it_predates_aux_layer_ids():
    with pytest.raises(LayerIdError, match="0.5.4.post2"):
        rule_for("0.5.3")
    assert rule_for("0.5.4.post2") is SGLANG_LAYER_RULES[0]
    assert rule_for("0.6.0") is SGLANG_LAYER_RULES[-1]


def test_describe_layers_names_both_rules_when_no_release_is_given():
    assert describe_layers([1, 29, 57]) == (
        "eagle_aux_hidden_state_layer_ids=[1, 29, 57]: SGLang 0.5.4.post2-0.5.12 captures "
        "[2, 30, 58], SGLang >= 0.5.13 captures [2, 30, 58]")
    assert "SGLang 0.5.23 captures [2, 30, 58]" in describe_layers([1, 29, 57], "0.5.23")
