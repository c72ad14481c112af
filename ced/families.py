"""The CED model families the engine knows, registered in one place (as HeteroFold's are): each is its name, the
`model_type` its `config.json` declares, its config class, its model class, and how to read the one from the other.

Everything that needs a family goes through here: `family(name)` and `family_of(path_or_config_json)` (an unknown
one is refused, naming the known ones). Classes are named by import path and loaded on first use, so reading a
directory's family imports no torch. Adding a family is one `register(...)` call below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any


class UnknownFamily(ValueError):
    """A family name or model_type that is not registered."""


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


@dataclass(frozen=True)
class Family:
    name: str  # registry key
    model_type: str  # what config.json's "model_type" says for this family
    config_class: str  # "module:Class" of the frozen config dataclass
    model_class: str  # "module:Class" of the model
    read_config: str  # "module:function" config.json dict -> config
    build: str  # "module:function" (config, seed) -> model with random weights
    states: str  # the module of its conversation state's verbs: empty_state, copy_state, delta_of, apply_delta,
    #              new_entries, entry_tensors, bound_tensors, set_bound (what the store, the journal, the transfers
    #              and the row engine call, whatever the family)
    engines: str  # "module:function" (kind, model_dir, max_adapters, max_rank, engine_dir, threads) -> an engine
    #               with CEDEngine's interface (what ced.engines.make_engine calls for this family)
    onnx_build: str  # "module:function" (model_dir, model=None) -> the folder of its cached ONNX build, exported
    #                  if missing (what ced.engines.ensure_onnx_engine calls)
    onnx_export: str  # the module whose export_engine(model_dir, out_dir, opset=, exporter=, progress=) writes its
    #                   graphs and manifest (what `python -m engine_build onnx` calls)

    def config_cls(self) -> type:
        return _load(self.config_class)

    def model_cls(self) -> type:
        return _load(self.model_class)

    def config_from_json(self, config_json: dict):
        return _load(self.read_config)(config_json)

    def new_model(self, config, seed: int | None = None):
        return _load(self.build)(config, seed)

    def state_verbs(self):
        return import_module(self.states)

    def make_engine(self, kind: str, model_dir, max_adapters: int, max_rank: int, engine_dir=None, threads=None):
        return _load(self.engines)(kind, model_dir, max_adapters, max_rank, engine_dir, threads)

    def ensure_onnx_engine(self, model_dir, model=None):
        return _load(self.onnx_build)(model_dir, model)

    def export_onnx(self, model_dir, out_dir, **options) -> dict:
        return import_module(self.onnx_export).export_engine(model_dir, out_dir, **options)


_FAMILIES: dict[str, Family] = {}


def register(entry: Family) -> Family:
    """Add a family; its name and model_type must both be new."""
    if entry.name in _FAMILIES:
        raise ValueError(f"model family {entry.name!r} is already registered")
    if any(f.model_type == entry.model_type for f in _FAMILIES.values()):
        raise ValueError(f"model_type {entry.model_type!r} is already claimed by another family")
    _FAMILIES[entry.name] = entry
    return entry


def family(name: str) -> Family:
    if name not in _FAMILIES:
        raise UnknownFamily(f"unknown model family {name!r}: the registered families are "
                            f"{', '.join(sorted(_FAMILIES))} (ced/families.py)")
    return _FAMILIES[name]


def family_names() -> list[str]:
    return list(_FAMILIES)


def read_config(model_dir: str | Path):
    """The config of the model in `model_dir`, of whichever family its config.json declares."""
    path = Path(model_dir) / "config.json"
    return family_of(path).config_from_json(json.loads(path.read_text()))


def family_of_config(config) -> Family:
    """The family whose config class `config` is an instance of."""
    name = f"{type(config).__module__}:{type(config).__qualname__}"
    for entry in _FAMILIES.values():
        if entry.config_class == name:
            return entry
    raise UnknownFamily(f"{name} is the config class of no registered family (ced/families.py)")


def family_of(source: str | Path | dict) -> Family:
    """The family of a model directory (its config.json), a config.json path, or a config.json dict."""
    if isinstance(source, dict):
        config_json, where = source, "the config"
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise UnknownFamily(f"{path} does not exist: a model directory holds a config.json")
        config_json, where = json.loads(path.read_text()), str(path)
    model_type = config_json.get("model_type")
    for entry in _FAMILIES.values():
        if entry.model_type == model_type:
            return entry
    known = ", ".join(f"{f.model_type!r} ({f.name})" for f in _FAMILIES.values())
    raise UnknownFamily(f"{where} declares model_type {model_type!r}; the registered families read {known}")


# -- how the `ced` family reads its config.json (a transformers save_pretrained of CEDForCausalLM) ---------------

def _ced_config(config_json: dict):
    from .config import CEDConfig

    names = {name for name, spec in CEDConfig.__dataclass_fields__.items() if spec.init}
    return CEDConfig.from_dict({k: tuple(v) if isinstance(v, list) else v
                                for k, v in config_json.items() if k in names})


def _ced_build(config, seed: int | None = None):
    from .model import CEDForCausalLM

    return CEDForCausalLM.from_ced(config, seed=seed)


def _v41_config(config_json: dict):
    from .deepseek_v41.config import V41Config

    return V41Config.from_hf(config_json)


def _v41_build(config, seed: int | None = None):
    from .deepseek_v41.model import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_config(config, seed=seed)


register(Family("ced", "ced", "ced.config:CEDConfig", "ced.model:CEDForCausalLM",
                "ced.families:_ced_config", "ced.families:_ced_build", "ced.state", "ced.engines:make_ced_engine",
                "ced.engines:ensure_ced_onnx_engine", "ced.onnx_export"))
register(Family("deepseek_v41", "deepseek_v41", "ced.deepseek_v41.config:V41Config",
                "ced.deepseek_v41.model:DeepseekV41ForCausalLM", "ced.families:_v41_config",
                "ced.families:_v41_build", "ced.deepseek_v41.state", "ced.deepseek_v41.engines:make_v41_engine",
                "ced.deepseek_v41.engines:ensure_onnx_engine", "ced.deepseek_v41.onnx_export"))
