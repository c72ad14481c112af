"""One conversation on a `deepseek_v41` model, served the way `ced.engine` serves the `ced` family: prefill
through the adapter-free shared stage, bounded replay of the last W positions under the target adapter, then
token-by-token steps. The reference the invariant tests run; no batching, no paging.

The adapter itself is applied from outside (`V41AdapterSet.use`); `adapter` arguments here only record whose
decoder windows the state holds, so a step under another adapter than the windows' is refused.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..state import Selection
from .model import DeepseekV41ForCausalLM, SharedOutput
from .state import V41AdapterState, V41SharedState


class StateMismatch(RuntimeError):
    """A step asked of windows built under another adapter or at another length."""


class V41Conversation:
    def __init__(self, model: DeepseekV41ForCausalLM):
        self.model, config = model, model.config
        E = config.decoder_start
        self.shared = V41SharedState(model.new_windows(range(E + 1)), model.new_stores())
        self.bound = V41AdapterState(None, model.new_windows(config.adapter_bound_layers))

    @property
    def length(self) -> int:
        return self.shared.length

    def fork(self) -> "V41Conversation":
        """A copy of the state on the same model (a deepcopy would copy the model too)."""
        twin = V41Conversation.__new__(V41Conversation)
        twin.model, twin.shared, twin.bound = self.model, copy.deepcopy(self.shared), copy.deepcopy(self.bound)
        return twin

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> SharedOutput:
        """The shared stage over new tokens: encoder windows, global KV, layer E's streams for the last W."""
        ids = torch.tensor([tokens], dtype=torch.long)
        out = self.model.run_shared(ids, self.length, self.shared.windows, self.shared.stores)
        self.shared.keep(out.stream, out.pre, out.selection, out.pool)
        self.shared.tokens.extend(tokens)
        return out

    @torch.no_grad()
    def replay(self, adapter: str | None) -> Tensor:
        """Rebuild the adapter-bound windows over the last min(W, length) positions under the adapter in use;
        returns the next-token logits (V,)."""
        shared, n = self.shared, min(self.model.config.sliding_window, self.length)
        self.bound = V41AdapterState(adapter, self.model.new_windows(self.model.config.adapter_bound_layers))
        last = lambda c: None if c is None else Selection(c.idx[:, -n:], c.valid[:, -n:])  # noqa: E731
        out = SharedOutput(None, shared.stream[:, -n:], shared.pre[:, -n:], last(shared.selection), last(shared.pool))
        hidden = self.model.run_decoder(out, self.length - n, self.bound.windows, shared.stores, last_only=True)
        self.bound.length = self.length
        return self.model.logits(hidden)[0, -1]

    @torch.no_grad()
    def step(self, token: int, adapter: str | None) -> Tensor:
        """One token through both stages under the adapter whose windows are current; logits (V,)."""
        if self.bound.adapter != adapter or self.bound.length != self.length:
            raise StateMismatch(f"the decoder windows are {self.bound.adapter!r}'s at length {self.bound.length}, "
                                f"not {adapter!r}'s at {self.length}: replay first")
        out = self.prefill([token])
        hidden = self.model.run_decoder(out, self.length - 1, self.bound.windows, self.shared.stores)
        self.bound.length = self.length
        return self.model.logits(hidden)[0, -1]

    def global_kv(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Every source's entries and indexer keys (what the shared history holds)."""
        return {i: (s.latent, s.index_keys) for i, s in self.shared.stores.items()}


def full_recompute(model: DeepseekV41ForCausalLM, tokens: list[int]) -> Tensor:
    """The oracle: the whole context in one pass under the adapter in use; the last position's logits (V,)."""
    return model(torch.tensor([tokens], dtype=torch.long), chunk_size=len(tokens))[0, -1]


__all__ = ["V41Conversation", "StateMismatch", "full_recompute"]
