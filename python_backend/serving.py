"""Serving settings and the objects each Triton model builds from them in `initialize`.

Every setting comes from the model's config.pbtxt `parameters`. A setting left `auto` is taken from the
environment variable MOL2_<NAME> when set (`mol2 serve` and the tests use this), else from the demo: the trained
demo when it exists (models/demo), the untrained one otherwise; the limits and the idle timeout from
python_backend/limits.py's defaults. Relative paths are relative to the project root.
"""

from __future__ import annotations

import faulthandler
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ced.engine import CEDEngine
from ced.engines import ENGINE_KINDS, make_engine

from .adapter_set import AdapterSetWatcher, sync_registry
from .limits import Limits, from_settings, resolve
from .store import ConversationStore
from ced.tokenization import ChatTokenizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = {"model_dir": "auto", "adapter_set": "auto", "store_dir": "auto", "router_dir": "auto", "threads": "1",
            "idle_timeout_s": "auto", "max_prompt_tokens": "auto", "max_conversations": "auto",
            "max_store_bytes": "auto", "max_adapters": "8", "max_rank": "16", "engine": "auto", "engine_dir": "auto"}


def _resolve(path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else ROOT / path


def demo_model_dir() -> Path:
    from ced.demo import DEFAULT_ROOT, TRAINED_ROOT

    trained = TRAINED_ROOT / "model"
    return trained if (trained / "config.json").is_file() else DEFAULT_ROOT / "model"


def write_demo_adapter_set(model_dir: Path) -> Path:
    """adapter_set.json beside the demo's adapters (their description.txt files give the descriptions)."""
    adapters = model_dir.parent / "adapters"
    path = model_dir.parent / "adapter_set.json"
    from ced.demo import ADAPTERS

    entries = [{"name": name, "path": f"adapters/{name}", "description": (adapters / name / "description.txt").read_text()
                .strip() if (adapters / name / "description.txt").is_file() else description}
               for name, description in ADAPTERS.items() if (adapters / name).is_dir()]
    path.write_text(json.dumps({"adapters": entries}, indent=2) + "\n")   # the router head's own route prompt
    return path


@dataclass(frozen=True)
class ServingSettings:
    model_dir: Path
    adapter_set: Path
    store_dir: Path
    router_dir: Path | None
    threads: int
    idle_timeout_s: float
    max_adapters: int
    max_rank: int
    engine: str = "torch"  # torch | onnxruntime | tensorrt (ced.engines)
    engine_dir: Path | None = None  # None: onnxruntime exports once into artifacts/engines/
    limits: Limits = Limits()  # prompt tokens per request, conversations and bytes the store keeps

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "ServingSettings":
        values = {name: parameters.get(name, default) for name, default in DEFAULTS.items()}
        values = {name: os.environ.get(f"MOL2_{name.upper()}", value) if value == "auto" else value
                  for name, value in values.items()}
        model_dir = demo_model_dir() if values["model_dir"] == "auto" else _resolve(values["model_dir"])
        adapter_set = (model_dir.parent / "adapter_set.json" if values["adapter_set"] == "auto"
                       else _resolve(values["adapter_set"]))
        router_dir = model_dir.parent / "router" if values["router_dir"] == "auto" else _resolve(values["router_dir"])
        store_dir = ROOT / "artifacts/conversations" if values["store_dir"] == "auto" else _resolve(values["store_dir"])
        engine = "torch" if values["engine"] == "auto" else values["engine"]
        if engine not in ENGINE_KINDS:
            raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINE_KINDS)}")
        engine_dir = None if values["engine_dir"] in ("auto", "") else _resolve(values["engine_dir"])
        return cls(model_dir, adapter_set, store_dir,
                   router_dir if router_dir.is_dir() else None, int(values["threads"]),
                   float(resolve("idle_timeout_s", values["idle_timeout_s"])), int(values["max_adapters"]),
                   int(values["max_rank"]), engine, engine_dir, from_settings(values))

    def open_store(self, config) -> ConversationStore:
        """The conversation store with this server's idle timeout and limits."""
        return ConversationStore(self.store_dir, config, self.idle_timeout_s, self.limits)


def triton_parameters(model_config: dict) -> dict[str, str]:
    return {name: value["string_value"] for name, value in model_config.get("parameters", {}).items()}


@dataclass
class Served:
    """What a stage needs: the engine (adapters synced to the set), the store, the tokenizer, the set watcher."""

    settings: ServingSettings
    engine: CEDEngine
    store: ConversationStore
    tokenizer: ChatTokenizer
    watcher: AdapterSetWatcher
    fingerprints: dict
    load_errors: dict  # adapter name -> why it is in the set but not loaded

    @classmethod
    def open(cls, settings: ServingSettings, with_adapters: bool = True) -> "Served":
        faulthandler.enable(all_threads=True)  # a model process that crashes leaves its Python stacks in the log
        torch.set_num_threads(settings.threads)
        engine = make_engine(settings.engine, settings.model_dir, settings.max_adapters, settings.max_rank,
                             settings.engine_dir, settings.threads)
        served = cls(settings, engine, settings.open_store(engine.config),
                     ChatTokenizer(settings.model_dir), AdapterSetWatcher(settings.adapter_set), {}, {})
        if with_adapters:
            sync_registry(engine.adapters, served.watcher.current, served.fingerprints, served.load_errors)
        return served

    def refresh(self) -> list[str]:
        """Take a changed adapter-set file (live configuration): load, replace or unload adapters."""
        if self.watcher.poll():
            return sync_registry(self.engine.adapters, self.watcher.current, self.fingerprints, self.load_errors)
        return []
