"""LoRA adapters in PEFT's on-disk format, the placement rule, and the registry that puts them into slots.

A directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), exactly as PEFT writes them.
Everything is validated before any slot is touched, so a refused adapter leaves nothing half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .config import CEDConfig
from .lora import MultiLoRALinear

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded: the message says which file or module is wrong."""


class PlacementError(AdapterError):
    """An adapter that touches a module the placement rule keeps adapter-free."""


class UnknownAdapterError(AdapterError, LookupError):
    pass


# -- the placement rule ------------------------------------------------------------------------------------

PLACEMENTS = ("decoder", "decoder+first-attention", "every-layer")


def placement_violation(module: str, config: CEDConfig, placement: str = "decoder") -> str | None:
    """Why `module` may not carry an adapter under `placement`, or None if it may.

    decoder: the FFN of the first decoder layer and any module of the later decoder layers (docs/architecture.md §1).
    decoder+first-attention: also the first decoder layer's attention (unsafe; tests show what it breaks).
    every-layer: any layer (the baseline of benchmarks).
    """
    match = _LAYER.match(module)
    if match is None and _LAYER.match(f"model.{module}"):
        return (f"module {module!r} lacks the 'model.' prefix: the adapter was made on the inner CEDModel; make it "
                "on CEDForCausalLM, whose modules are 'model.layers.<i>...'")
    if match is None:
        return f"module {module!r} is not inside a transformer layer (embeddings, final norm and LM head are shared)"
    layer, rest = int(match["layer"]), match["rest"]
    E = config.decoder_start
    if placement == "every-layer" or layer > E:
        return None
    if layer < E:
        return f"module {module!r} is in encoder layer {layer} (layers 0..{E - 1} are shared by every adapter)"
    if rest.startswith("mlp."):
        return None
    if placement == "decoder+first-attention" and rest.startswith("attn."):
        return None
    return (f"module {module!r} is the first decoder layer's attention (layer {E}): it writes the global KV "
            "every adapter shares; only that layer's FFN may carry an adapter")


# -- reading PEFT's format ---------------------------------------------------------------------------------

# adapter_config.json fields that do not change what a loaded adapter computes (metadata, training-time options,
# which modules were targeted: the weights file says that) or that `AdapterConfig` reads.
_HARMLESS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules", "target_parameters", "layers_to_transform",
    "layers_pattern", "lora_dropout", "init_lora_weights", "megatron_config", "megatron_core", "qalora_group_size",
    "runtime_config", "eva_config", "ensure_weight_tying",
})
# Initialisations that also rewrite the base model's weights: the saved adapter only works on that rewritten base
# (PEFT converts such an adapter to plain LoRA when saved with `path_initial_model_for_weight_conversion`).
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "lora-ga")


def unsupported_settings(values: dict) -> list[str]:
    """Settings in adapter_config.json this engine cannot reproduce: any field outside _HARMLESS that is set (a
    PEFT variant this engine does not know is refused, not silently computed as plain LoRA), a bias other than
    'none', or an initialisation that rewrote the base."""
    defaults = (None, False, {}, [], "", "none")
    bad = [name for name, value in values.items()
           if name not in _HARMLESS and not any(value is d or value == d for d in defaults)]
    if values.get("peft_type", "LORA") != "LORA":
        bad.append("peft_type")
    init = values.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        bad.append(f"init_lora_weights={init!r}")
    return sorted(bad)


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json this engine uses (`unsupported_settings` has checked the others)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    @classmethod
    def from_json(cls, values: dict, path: Path) -> "AdapterConfig":
        missing = [name for name in ("r", "lora_alpha") if name not in values]
        if missing:
            raise AdapterError(f"{path}: adapter_config.json lacks required field(s) {missing}")
        bad = unsupported_settings(values)
        if bad:
            raise AdapterError(f"{path}: unsupported adapter_config.json settings {bad} (plain LoRA with "
                               "bias='none' on the base as it is only: these change what the adapter computes)")
        r = values["r"]
        if not isinstance(r, int) or r <= 0:
            raise AdapterError(f"{path}: adapter_config.json has r={r!r}; it must be a positive integer")
        targets = values.get("target_modules")
        return cls(r, float(values["lora_alpha"]), bool(values.get("use_rslora", False)),
                   tuple(targets) if isinstance(targets, list) else targets)


@dataclass
class PeftAdapter:
    path: Path
    config: AdapterConfig
    weights: dict[str, tuple[Tensor, Tensor]] = field(repr=False)  # module -> (A (r, in), B scaled (out, r))

    @property
    def digest(self) -> str:
        """Of what the slots would hold (modules, A, scaled B): equal for the same weights whatever the path."""
        h = hashlib.sha256()
        for module in sorted(self.weights):
            h.update(module.encode())
            for tensor in self.weights[module]:
                h.update(tensor.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / needed).is_file():
            raise AdapterError(f"{path}: missing {needed} (expected PEFT's on-disk format)")
    try:
        config = AdapterConfig.from_json(json.loads((path / CONFIG_FILE).read_text()), path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{path}: corrupt {CONFIG_FILE}: {error}") from None
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, RuntimeError) as error:
        raise AdapterError(f"{path}: corrupt {WEIGHTS_FILE}: {error}") from None

    parts: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{path}: unexpected tensor {key!r} (only lora_A/lora_B weights are supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")

    weights = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                               "ranks do not match")
        if a.shape[0] != config.r:
            raise AdapterError(f"{path}: module {module!r} has rank {a.shape[0]}, adapter_config.json says r={config.r}")
        weights[module] = (a.float(), b.float() * config.scaling)
    return PeftAdapter(path, config, weights)


def write_peft_adapter(path: str | Path, weights: dict[str, tuple[Tensor, Tensor]], r: int, lora_alpha: float,
                       base_model: str = "ced") -> Path:
    """Write unscaled (A, B) pairs in PEFT's format (used for synthetic adapters; PEFT itself writes trained ones)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    targets = sorted({module.rsplit(".", 1)[-1] for module in weights})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "target_modules": targets, "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": base_model,
              "task_type": None, "inference_mode": True}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


# -- the registry --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterRecord:
    name: str
    path: str
    version: int
    slot: int
    rank: int
    modules: tuple[str, ...]
    digest: str  # of its weights (PeftAdapter.digest): windows built under other weights of this name are stale


class AdapterRegistry:
    """name -> slot. Load, replace and unload validate the whole adapter before any slot is written."""

    def __init__(self, modules: dict[str, MultiLoRALinear], config: CEDConfig, n_slots: int, max_rank: int,
                 placement: str = "decoder"):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.modules, self.config, self.n_slots, self.max_rank = modules, config, n_slots, max_rank
        self.placement = placement
        self._records: dict[str, AdapterRecord] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[AdapterRecord]:
        return sorted(self._records.values(), key=lambda record: record.name)

    def get(self, name: str) -> AdapterRecord:
        if name not in self._records:
            known = ", ".join(sorted(self._records)) or "none loaded"
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {known})")
        return self._records[name]

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.get(name).slot

    def digest(self, name: str | None) -> str:
        """The digest of the weights in `name`'s slot now ("base" for the base, which never changes)."""
        return "base" if name is None else self.get(name).digest

    def load(self, name: str, path: str | Path) -> AdapterRecord:
        if not name or not isinstance(name, str):
            raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
        if name in self._records:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self._records[name].path}); use replace")
        free = sorted(set(range(self.n_slots)) - {record.slot for record in self._records.values()})
        if not self.n_slots:
            raise AdapterError(f"cannot load {name!r}: this engine was built with no adapter slots (max_adapters=0)")
        if not free:
            raise AdapterError(f"all {self.n_slots} adapter slots are in use; unload one first")
        adapter = self._validated(path)
        return self._install(name, adapter, free[0], version=1)

    def replace(self, name: str, path: str | Path) -> AdapterRecord:
        old = self.get(name)
        adapter = self._validated(path)
        return self._install(name, adapter, old.slot, version=old.version + 1)

    def unload(self, name: str) -> None:
        record = self.get(name)
        for module in self.modules.values():
            module.reset_lora(record.slot)
        del self._records[name]

    def check(self, path: str | Path) -> PeftAdapter:
        """Everything `load` checks (format, placement, module shapes, rank), touching no slot: a front end's
        pre-flight before it offers the adapter (python_backend/server/openai_api/adapters.py)."""
        return self._validated(path)

    def _validated(self, path: str | Path) -> PeftAdapter:
        adapter = read_peft_adapter(path)
        for module, (a, b) in adapter.weights.items():
            reason = placement_violation(module, self.config, self.placement)
            if reason is not None:
                raise PlacementError(f"{adapter.path}: refused: {reason}")
            target = self.modules.get(module)
            if target is None:
                raise AdapterError(f"{adapter.path}: module {module!r} does not exist in this model")
            if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
                raise AdapterError(f"{adapter.path}: module {module!r} expects A (r, {target.in_features}) and "
                                   f"B ({target.out_features}, r), got {tuple(a.shape)} and {tuple(b.shape)}")
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: rank {adapter.rank} exceeds the engine's max_rank {self.max_rank}")
        return adapter

    def _install(self, name: str, adapter: PeftAdapter, slot: int, version: int) -> AdapterRecord:
        with torch.no_grad():
            for module in self.modules.values():
                module.reset_lora(slot)
            for module, (a, b) in adapter.weights.items():
                self.modules[module].set_lora(slot, a, b)
        record = AdapterRecord(name, str(adapter.path), version, slot, adapter.rank, tuple(sorted(adapter.weights)),
                               adapter.digest)
        self._records[name] = record
        return record
