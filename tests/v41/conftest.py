"""Fixtures of the deepseek_v41 tests: the v41-tiny model with seeded weights and PEFT adapters on native names."""

from __future__ import annotations

import pytest
import torch

from ced.adapters import write_peft_adapter
from ced.deepseek_v41.adapters import V41AdapterSet
from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.model import DeepseekV41ForCausalLM


@pytest.fixture(scope="session")
def tiny_v41() -> V41Config:
    return V41Config.from_name("v41-tiny")


def random_adapter(path, modules: dict, include, rank: int = 4, seed: int = 0, scale: float = 0.1) -> str:
    """A PEFT adapter with random non-zero A and B on the wrapped modules whose name passes `include`."""
    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(rank, m.in_features, generator=g) * scale,
                      torch.randn(m.out_features, rank, generator=g) * scale)
               for name, m in modules.items() if include(name)}
    return str(write_peft_adapter(path, weights, r=rank, lora_alpha=2 * rank, base_model="v41-tiny"))


@pytest.fixture(name="random_adapter")
def random_adapter_factory():
    """The function that writes a random PEFT adapter (random_adapter)."""
    return random_adapter


@pytest.fixture(scope="session")
def v41_adapters(tmp_path_factory, tiny_v41):
    """The tiny model with LoRA wrappers and three adapters loaded: "all" (every allowed module, routed experts
    included), "experts" (routed experts only), "attn" (decoder attention above layer E only)."""
    model = DeepseekV41ForCausalLM.from_config(tiny_v41, seed=0)
    adapters = V41AdapterSet(model)
    root, E = tmp_path_factory.mktemp("v41_adapters"), tiny_v41.decoder_start
    specs = {"all": (lambda n: True, 1), "experts": (lambda n: ".experts." in n, 2),
             "attn": (lambda n: ".attn." in n and not n.startswith(f"layers.{E}."), 3)}
    for name, (include, seed) in specs.items():
        adapters.load(name, random_adapter(root / name, adapters.modules, include, seed=seed))
    adapters.use(None)
    return adapters
