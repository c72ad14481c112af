"""Adapters made with PEFT itself, with random (non-zero) B, for tests, benchmarks and the untrained demo.

PEFT initialises B to zero, which would make every adapter a no-op and every invariant test vacuous.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from .config import CEDConfig

ATTENTION = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")
FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def decoder_modules_regex(config: CEDConfig, modules: tuple[str, ...], first_decoder_ffn: bool = True,
                          layers: range | None = None) -> str:
    """A PEFT `target_modules` regex for `modules` on the adapter-bound decoder layers (and layer E's FFN)."""
    layers = config.adapter_bound_layers if layers is None else layers
    names = "|".join(re.escape(m) for m in modules)
    pattern = rf"model\.layers\.({'|'.join(map(str, layers))})\.({names})"
    ffn = "|".join(re.escape(m) for m in modules if m.startswith("mlp."))
    if first_decoder_ffn and ffn:
        pattern += rf"|model\.layers\.{config.decoder_start}\.({ffn})"
    return pattern


def make_random_adapter(model: torch.nn.Module, out_dir: str | Path, target_modules: str | list[str], rank: int = 8,
                        alpha: float = 16.0, seed: int = 0, scale: float = 0.02) -> Path:
    """Wrap a copy of `model` with PEFT, draw A and B from N(0, scale), save in PEFT's format."""
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=alpha,
                                                                 target_modules=target_modules, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)
