"""The config: presets and their sizes, validation with clear errors, the role table, the HF wrapper."""

import re

import pytest

from ced import CEDConfig, CEDForCausalLM, CEDPretrainedConfig, ConfigError


def test_preset_sizes():
    assert CEDConfig.from_name("tiny").num_parameters() < 1_000_000
    assert 5_000_000 <= CEDConfig.from_name("demo").num_parameters() <= 20_000_000
    flash = CEDConfig.from_name("ced-40")
    assert (flash.n_layers, flash.decoder_start, flash.window) == (40, 20, 128)
    assert flash.source_layers == (2, 8, 14, 20)
    assert flash.index_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert flash.num_parameters() > 1_000_000_000


@pytest.mark.parametrize("name", ["tiny", "demo"])
def test_counted_parameters_match_the_model(name):
    config = CEDConfig.from_name(name)
    model = CEDForCausalLM.from_ced(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_roles_are_expanded_once():
    config = CEDConfig.from_name("demo")
    roles = config.roles
    assert [r.is_decoder for r in roles] == [False] * 4 + [True] * 4
    assert roles[0].global_source is None and roles[0].selection_layer is None  # below the first source
    assert roles[2].global_source == 1 and roles[2].selection_layer == 1
    assert roles[5].global_source == 4 and roles[5].selection_layer == 4
    assert roles[7].global_source == 4 and roles[7].selection_layer == 6
    assert list(config.adapter_bound_layers) == [5, 6, 7] and config.h19_layer == 3


@pytest.mark.parametrize("changes, message", [
    (dict(source_layers=(1,)), "first decoder layer (3) must be a global-KV source"),
    (dict(source_layers=(1, 3, 4), index_layers=(1, 3, 4)), "lie above the first decoder layer"),
    (dict(source_layers=(1, 9)), "out of range"),
    (dict(index_layers=(3,)), "must also be index layers"),
    (dict(source_layers=(2, 3), index_layers=(0, 2, 3)), "below the first source"),
    (dict(decoder_start=5), "two decoder layers"),
    (dict(window=2), "at least block_size"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
])
def test_validation_names_the_problem(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        CEDConfig.from_name("tiny", **changes)


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown preset"):
        CEDConfig.from_name("huge")
    with pytest.raises(ConfigError, match="unknown CED config fields"):
        CEDConfig.from_dict({"layers": 3})


def test_config_is_frozen_and_round_trips():
    config = CEDConfig.from_name("demo")
    with pytest.raises(Exception):
        config.window = 3
    assert CEDConfig.from_dict(config.to_dict()) == config
    assert CEDPretrainedConfig.from_ced(config).ced == config
