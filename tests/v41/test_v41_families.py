"""The family registry: a model directory's config.json `model_type` picks its family (`ced` or `deepseek_v41`),
each family reads its own config and builds its own model; an unknown model_type is refused naming the known."""

import json

import pytest

from ced.config import CEDConfig
from ced.families import UnknownFamily, family, family_names, family_of


def test_both_families_are_registered():
    assert family_names()[:2] == ["ced", "deepseek_v41"]
    assert family("deepseek_v41").model_cls().__name__ == "DeepseekV41ForCausalLM"
    assert family("ced").config_cls() is CEDConfig


def test_a_v41_directory_is_recognised_and_built(tmp_path, tiny_v41):
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41.to_hf()))
    entry = family_of(tmp_path)
    assert entry.name == "deepseek_v41"
    config = entry.config_from_json(json.loads((tmp_path / "config.json").read_text()))
    assert config == tiny_v41
    model = entry.new_model(config, seed=0)
    assert "layers.4.attn.compressor.wkv.weight" in model.state_dict()


def test_a_ced_config_is_recognised_and_built():
    tiny = CEDConfig.from_name("tiny")
    config_json = {"architectures": ["CEDForCausalLM"], "model_type": "ced", "transformers_version": "5.25.0",
                   **{k: list(v) if isinstance(v, tuple) else v for k, v in tiny.to_dict().items()}}
    entry = family_of(config_json)
    assert entry.name == "ced" and entry.config_from_json(config_json) == tiny
    assert type(entry.new_model(tiny, seed=0)).__name__ == "CEDForCausalLM"


def test_an_unknown_model_type_is_refused_naming_the_known():
    with pytest.raises(UnknownFamily, match=r"'deepseek_v4'.*'ced' \(ced\), 'deepseek_v41' \(deepseek_v41\)"):
        family_of({"model_type": "deepseek_v4"})
    with pytest.raises(UnknownFamily, match="registered families are ced, deepseek_v41"):
        family("llama")
