"""Serving settings: what each Triton model reads from its config.pbtxt `parameters`, without importing torch
(the `tokenize` and `route` models and `mol2 serve` itself need the settings but never run the model).

A setting left `auto` is taken from the environment variable MOL2_<NAME> when set (`mol2 serve` and the tests use
this), else from the demo every command uses (ced.demo.find_demo: a fresh artifacts/demo, else models/demo, else
the untrained one); the limits and the idle timeout from python_backend/core/limits.py's defaults. Relative paths are
relative to the project root.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ced.engines import ENGINE_KINDS

from .limits import Limits, from_settings, resolve

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"model_dir": "auto", "adapter_set": "auto", "store_dir": "auto", "router_dir": "auto", "threads": "1",
            "idle_timeout_s": "auto", "max_prompt_tokens": "auto", "max_conversations": "auto",
            "max_store_bytes": "auto", "max_adapters": "8", "max_rank": "16", "engine": "auto", "engine_dir": "auto"}


def _resolve(path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else ROOT / path


def demo_model_dir() -> Path:
    from ced.demo import find_demo  # builds nothing: `mol2 serve` built the untrained demo before the models start

    return find_demo().model_dir


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

    def open_store(self, config):
        """The conversation store (python_backend/core/store.py) with this server's idle timeout and limits."""
        from .store import ConversationStore  # the store holds torch tensors: imported by the models that keep one

        return ConversationStore(self.store_dir, config, self.idle_timeout_s, self.limits)


def triton_parameters(model_config: dict) -> dict[str, str]:
    return {name: value["string_value"] for name, value in model_config.get("parameters", {}).items()}


def number_setting(name: str, value: str, default: str, unit: str) -> float:
    """A model's numeric config parameter `name`: `value`, or where that is "auto" (or empty) MOL2_<NAME>, else
    `default`; refused unless a finite number >= 0 (of `unit`, as the message says)."""
    if value in ("auto", ""):
        value = os.environ.get(f"MOL2_{name.upper()}", default)
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {value!r}") from None
    if not 0 <= number < float("inf"):  # NaN fails this too
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def stream_interval_s(value: str = "auto") -> float:
    """The least time between two streamed responses of a turn: the `stream_interval_ms` config parameter, else
    MOL2_STREAM_INTERVAL_MS (`mol2 serve --stream-interval-ms`), else 0 (each token as soon as the responder can)."""
    return number_setting("stream_interval_ms", value, "0", "milliseconds") / 1e3
