"""The design bounded replay replaces, for benchmarks only: every-layer LoRA.

With an adapter on every layer, every layer's state depends on the adapter, so each adapter a conversation
visits keeps its own full state, and a switch prefills the whole context again under the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .adapters import AdapterRegistry
from .lora import LoRAMapping, wrap_linears
from .model import CEDForCausalLM
from .state import GlobalKV, LocalWindow


@dataclass
class FullState:
    """One adapter's copy of everything: windows of all layers and the global KV."""

    windows: dict[int, LocalWindow]
    stores: dict[int, GlobalKV]

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.windows.values()) + sum(g.nbytes() for g in self.stores.values())


@dataclass
class BaselineConversation:
    tokens: list[int] = field(default_factory=list)
    states: dict[str | None, FullState] = field(default_factory=dict)  # one per adapter visited

    def nbytes(self) -> int:
        return sum(state.nbytes() for state in self.states.values()) + 8 * len(self.tokens)


class EveryLayerBaseline:
    def __init__(self, model: CEDForCausalLM, max_adapters: int = 8, max_rank: int = 16, prefill_chunk: int = 256):
        self.model, self.config, self.prefill_chunk = model.eval(), model.ced, prefill_chunk
        self.mapping = LoRAMapping()
        modules = wrap_linears(model, lambda name: name.startswith("model.layers."), max_adapters, max_rank,
                               self.mapping)
        self.adapters = AdapterRegistry(modules, self.config, max_adapters, max_rank, placement="every-layer")

    @torch.inference_mode()
    def switch(self, conversation: BaselineConversation, target: str | None) -> Tensor:
        """Prefill the whole context under `target` into a fresh full state; returns next-token logits (V,)."""
        model, E = self.model, self.config.decoder_start
        state = FullState(model.new_windows(range(self.config.n_layers)), model.new_stores())
        self.mapping.row_slots = torch.tensor([self.adapters.slot_of(target)])
        try:
            for start in range(0, len(conversation.tokens), self.prefill_chunk):
                chunk = torch.tensor([conversation.tokens[start: start + self.prefill_chunk]])
                shared = model.run_shared(chunk, start, state.windows, state.stores)
                hidden = model.run_decoder(shared.stream, start, shared.selection, state.windows, state.stores[E])
            logits = model.lm_head(hidden[:, -1])[0]
        finally:
            self.mapping.row_slots = None
        conversation.states[target] = state
        return logits
