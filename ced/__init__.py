"""A PyTorch engine for causal encoder-decoder models serving many LoRA adapters over one shared history."""

from .adapters import AdapterError, PlacementError, UnknownAdapterError, read_peft_adapter, write_peft_adapter
from .config import PRESETS, CEDConfig, ConfigError
from .engine import CEDEngine, ContextTooLongError, SamplingParams, StateError
from .model import CEDForCausalLM, CEDPretrainedConfig

__all__ = ["AdapterError", "PlacementError", "UnknownAdapterError", "read_peft_adapter", "write_peft_adapter",
           "PRESETS", "CEDConfig", "ConfigError", "CEDEngine", "ContextTooLongError", "SamplingParams", "StateError",
           "CEDForCausalLM", "CEDPretrainedConfig"]
