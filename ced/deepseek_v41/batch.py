"""A decode step of many `deepseek_v41` conversations in one pass of the model: B rows, each its own length and
its own state objects, one token each, as a batch (B, 1).

Every projection, the MoE, the mHC mixing, the norms and each row's own adapter (`V41AdapterSet.use_rows`) run
for all rows together. Only what reads a row's own history runs per row, through `RowsCache`, which gives the
model's layers `V41Cache`'s verbs over the rows' own `V41Cache`s and pads their results to the batch:

- `extend_window`: each row's window of the last W latents, padded to the longest (a padded key sits at a
  future position, so the distance mask gives it no weight);
- `gather`: each row's top-k entries of its global KV, read from its own store (O(k) per row, no copy of the
  store);
- `index_keys`: each row's indexer keys, padded to the longest store (padded entries lie past the row's visible
  groups, so the indexer's visibility mask drops them): the one O(context) read, which the indexer makes anyway;
- `compress`: each row's pending group, and the groups that complete this step pooled in one call.

Per row a step costs O(W + top-k) beyond the indexer's read of its keys. The result of a row equals its serial
`V41Engine.step` within float tolerance (tests/v41/test_batched_step.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..state import Selection
from .model import DeepseekV41ForCausalLM
from .state import PoolGroups, V41Cache, V41ConversationState


class RowsCache:
    """V41Cache's verbs over B rows of one token each, row b read and written through caches[b]."""

    graph = False

    def __init__(self, caches: list[V41Cache]):
        self.caches = caches
        self._index_keys: dict[int, Tensor] = {}  # source -> (B, N, I) padded, for this step (until it grows)

    def ratio(self, source: int) -> int:
        return self.caches[0].ratio(source)

    def extend_window(self, layer: int, kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's latent (B, 1, D) into its window; returns the keys (B, S, D) and their positions (B, S): row
        b's n_b window latents and its new one, then zeros at future positions (the distance mask drops them)."""
        windows = [cache.windows[layer] for cache in self.caches]
        held = torch.tensor([len(window) for window in windows], device=kv.device)  # (B,)
        S = int(held.max()) + 1
        keys = kv.new_zeros(len(windows), S, kv.shape[-1])  # (B, S, D)
        for b, window in enumerate(windows):
            if window.kv is not None:
                keys[b, : window.kv.shape[1]] = window.kv[0]
            window.append(kv[b: b + 1])
        keys[torch.arange(len(windows), device=kv.device), held] = kv[:, 0]
        key_pos = positions - held[:, None] + torch.arange(S, device=kv.device)  # (B, S): start_b - n_b ...
        return keys, key_pos

    def compress(self, layer: int, xn: Tensor, pool: PoolGroups) -> None:
        """Each row's input (B, 1, C) joins its pending group; the groups that complete (at most one per row) are
        pooled in one call and appended to their rows' stores."""
        done = [(b, groups) for b, cache in enumerate(self.caches)
                if (groups := cache.complete_groups(layer, xn[b: b + 1])) is not None]  # (1, 1, r, C) each
        if not done:
            return
        stores = [self.caches[b].stores[layer] for b, _ in done]
        first = torch.tensor([store.n_entries for store in stores], device=xn.device)
        latents, keys = pool(torch.cat([groups for _, groups in done]), first)  # (R, 1, D), (R, 1, I)
        for i, store in enumerate(stores):
            store.add_entries(latents[i: i + 1], keys[i: i + 1])
        self._index_keys.pop(layer, None)

    def has_entries(self, source: int) -> bool:
        return any(cache.has_entries(source) for cache in self.caches)

    def index_keys(self, source: int) -> Tensor:
        if source not in self._index_keys:
            held = [cache.stores[source].index_keys for cache in self.caches]
            N = max(0 if keys is None else keys.shape[1] for keys in held)
            like = next(keys for keys in held if keys is not None)
            self._index_keys[source] = torch.cat([
                like.new_zeros(1, N, like.shape[2]) if keys is None else F.pad(keys, (0, 0, 0, N - keys.shape[1]))
                for keys in held])  # (B, N, I)
        return self._index_keys[source]

    def gather(self, source: int, idx: Tensor) -> Tensor:
        """The latents (B, T, k, D) of entries idx (B, T, k), each row read from its own store (a row with none
        yet has only invalid choices: zeros)."""
        held = [cache.stores[source].latent for cache in self.caches]  # (1, N_b, D) each, or None
        like = next(latent for latent in held if latent is not None)
        return torch.stack([like.new_zeros(*idx.shape[1:], like.shape[2]) if latent is None else latent[0, idx[b]]
                            for b, latent in enumerate(held)])


def _row(choice: Selection | None, b: int) -> Selection | None:
    return None if choice is None else Selection(choice.idx[b: b + 1], choice.valid[b: b + 1])


def step_rows(model: DeepseekV41ForCausalLM, states: list[V41ConversationState], tokens: list[int]) -> Tensor:
    """Append tokens[b] to conversation states[b], both stages, every row in one pass under whatever adapters
    are applied (`V41AdapterSet.use_rows`); returns the final hidden (B, 1, C). The caller has checked every row
    (tokens in range, adapter-bound windows current)."""
    config, E = model.config, model.config.decoder_start
    starts = [state.length for state in states]
    positions = torch.tensor(starts, device=model.embed.weight.device)[:, None]  # (B, 1): each row's own
    ids = torch.tensor(tokens, device=positions.device)[:, None]  # (B, 1)
    shared = RowsCache([V41Cache(s.shared.windows, s.shared.stores, start) for s, start in zip(states, starts)])
    out = model.shared_stage(ids, positions, shared)
    source = config.roles[E].kv_source
    for b, (state, token) in enumerate(zip(states, tokens)):
        # a row whose source has no entries yet kept no choice, as a step alone would not have made one
        has = source is not None and state.shared.stores[source].n_entries > 0
        state.shared.keep(out.stream[b: b + 1], out.pre[b: b + 1], _row(out.selection, b) if has else None,
                          _row(out.pool, b) if has else None)
        state.shared.tokens.append(token)
    decoder = RowsCache([V41Cache(s.bound.windows, {E: s.shared.stores[E]}, start)
                         for s, start in zip(states, starts)])
    return model.decoder_stage(out.stream, out.pre, positions, out.selection, out.pool, decoder)
