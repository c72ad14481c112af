"""Shared fixtures: the tiny preset, seeded weights, and real PEFT adapters with non-zero B."""

from __future__ import annotations

import pytest
import torch

from ced import CEDConfig, CEDEngine, CEDForCausalLM
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

torch.set_num_threads(1)  # tiny tensors: threads only add synchronisation


@pytest.fixture(scope="session")
def tiny_config() -> CEDConfig:
    return CEDConfig.from_name("tiny")


def tiny_model(seed: int = 0) -> CEDForCausalLM:
    return CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=seed)


@pytest.fixture(name="tiny_model")
def tiny_model_factory():
    """A function that builds the tiny model with seeded weights."""
    return tiny_model


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory, tiny_config) -> dict[str, str]:
    """Seven trained-shape adapters (attention + FFN of the decoder), one "L0" on another module set, and one
    that breaks the placement rule (the first decoder layer's attention)."""
    root, base = tmp_path_factory.mktemp("adapters"), tiny_model()
    full = decoder_modules_regex(tiny_config, ATTENTION + FFN)
    other = decoder_modules_regex(tiny_config, ("attn.o_proj", "mlp.up_proj", "mlp.down_proj"))
    E = tiny_config.decoder_start
    unsafe = rf"model\.layers\.{E}\.attn\.(q_proj|k_proj|v_proj)|" + full
    specs = {f"A{i}": (full, 8 if i == 3 else 4, i) for i in range(1, 8)}
    specs.update({"L0": (other, 2, 10), "unsafe": (unsafe, 4, 11)})
    dirs = {}
    for name, (targets, rank, seed) in specs.items():
        scale = 0.3 if name == "L0" else 0.1
        dirs[name] = str(make_random_adapter(base, root / name, targets, rank=rank, alpha=2 * rank, seed=seed,
                                             scale=scale))
    return dirs


@pytest.fixture()
def engine(adapter_dirs) -> CEDEngine:
    engine = CEDEngine(tiny_model(), max_adapters=8, max_rank=8)
    for name in ("A1", "A2", "A3", "L0"):
        engine.adapters.load(name, adapter_dirs[name])
    return engine
