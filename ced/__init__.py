"""A PyTorch engine for causal encoder-decoder models serving many LoRA adapters over one shared history.

The names below load on first use, so a process that needs only the tokenizer or the config (the Triton
`tokenize` model, `mol2 serve`, `--help`) never imports torch.
"""

from importlib import import_module

_HOME = {"AdapterError": "adapters", "PlacementError": "adapters", "UnknownAdapterError": "adapters",
         "read_peft_adapter": "adapters", "write_peft_adapter": "adapters",
         "PRESETS": "config", "CEDConfig": "config", "ConfigError": "config",
         "CEDEngine": "engine", "ContextTooLongError": "engine", "SamplingParams": "engine", "StateError": "engine",
         "CEDForCausalLM": "model", "CEDPretrainedConfig": "model"}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'ced' has no attribute {name!r}")
    return getattr(import_module(f".{_HOME[name]}", __name__), name)
