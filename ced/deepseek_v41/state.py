"""One conversation's state for the `deepseek_v41` family, split the way docs/architecture.md §1 splits it.

Per layer a window of the last W latents (K = V: one D-wide latent per position, after RoPE); per KV source a
store of global entries (one latent per group of `ratio` positions, after RoPE, plus its indexer key) and the
inputs of the group not yet complete. `V41Cache` is what a stage's layers read and write, with the verbs of
`ced.state.AttentionCache` (extend_window, compress, has_entries, index_keys, gather) adapted to one latent.
Top-k choices and the candidate pool are `ced.state.Selection`s (entry / block numbers and their validity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from ..state import Selection, _cat_keep_last, _nbytes

# (groups (B, N', r, C), first entry (B,)) -> latents (B, N', D) and indexer keys (B, N', I), both after RoPE
PoolGroups = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class LatentWindow:
    """The latents (after RoPE) of one layer for the last `size` positions before the next query."""

    size: int
    kv: Tensor | None = None  # (B, n, D), n <= size

    def __len__(self) -> int:
        return 0 if self.kv is None else self.kv.shape[1]

    def append(self, kv: Tensor) -> None:
        self.kv = _cat_keep_last(self.kv, kv, 1, self.size)

    def nbytes(self) -> int:
        return _nbytes(self.kv)


@dataclass
class LatentStore:
    """One KV source's global KV: one entry per complete group of `ratio` positions, plus the partial group."""

    ratio: int
    latent: Tensor | None = None  # (B, N, D), rotated at each group's first position
    index_keys: Tensor | None = None  # (B, N, I), rotated likewise
    pending: Tensor | None = None  # (B, p, C) normalised inputs of the group not yet complete, p < ratio

    @property
    def n_entries(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def add_entries(self, latent: Tensor, index_keys: Tensor) -> None:
        if latent.shape[1] == 0:
            return
        cat = lambda old, new: new if old is None else torch.cat([old, new], dim=1)  # noqa: E731
        self.latent, self.index_keys = cat(self.latent, latent), cat(self.index_keys, index_keys)

    def nbytes(self) -> int:
        return _nbytes(self.latent, self.index_keys, self.pending)


class V41Cache:
    """A stage's view of one conversation's windows and stores (or of rows that share positions, as in the
    oracle), starting at absolute position `start`."""

    graph = False

    def __init__(self, windows: dict[int, LatentWindow], stores: dict[int, LatentStore], start: int):
        self.windows, self.stores, self.start = windows, stores, start

    def extend_window(self, layer: int, kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keep this call's latents (B, T, D) at positions (1, T) as the newest of the window; returns the latents
        (B, S, D) its queries may attend to and their positions (1, S) (the model masks by distance)."""
        window = self.windows[layer]
        past = len(window)
        keys = kv if past == 0 else torch.cat([window.kv, kv], dim=1)
        window.append(kv)
        if past == 0:
            return keys, positions
        past_pos = torch.arange(self.start - past, self.start, device=kv.device)[None]
        return keys, torch.cat([past_pos, positions], dim=1)

    def compress(self, layer: int, xn: Tensor, pool: PoolGroups) -> None:
        """Append the entries of every group that completes with xn (B, T, C); keep the rest pending."""
        store, B = self.stores[layer], xn.shape[0]
        rows = xn if store.pending is None else torch.cat([store.pending, xn], dim=1)
        n_groups = rows.shape[1] // store.ratio
        store.pending = rows[:, n_groups * store.ratio:].clone()
        if n_groups:
            groups = rows[:, : n_groups * store.ratio].reshape(B, n_groups, store.ratio, -1)  # (B, N', r, C)
            store.add_entries(*pool(groups, torch.full((B,), store.n_entries, device=xn.device)))

    def has_entries(self, source: int) -> bool:
        return self.stores[source].n_entries > 0

    def index_keys(self, source: int) -> Tensor:
        return self.stores[source].index_keys

    def gather(self, source: int, idx: Tensor) -> Tensor:
        """The latents (B, T, k, D) of entries idx (B, T, k) of each row."""
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
        return self.stores[source].latent[rows, idx]


@dataclass
class V41SharedState:
    """Adapter-free: windows of layers 0..E, every source's store, and for the last W positions the first decoder
    layer's post-attention streams, its lagged pre-mix, top-k and candidate pool (replay starts from these)."""

    windows: dict[int, LatentWindow]
    stores: dict[int, LatentStore]
    stream: Tensor | None = None  # (1, n<=W, hc, C)
    pre: Tensor | None = None  # (1, n, hc): layer E's attention-site pre-mix, which its FFN collapses with
    selection: Selection | None = None  # layer E's top-k for the same n positions
    pool: Selection | None = None  # layer E's candidate blocks for the same n positions
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def keep(self, stream: Tensor, pre: Tensor, selection: Selection | None, pool: Selection | None,
             window: int) -> None:
        """Append one call's layer-E outputs, trimmed to the last `window` positions."""
        self.stream = _cat_keep_last(self.stream, stream, 1, window)
        self.pre = _cat_keep_last(self.pre, pre, 1, window)
        self.selection = _keep_choice(self.selection, selection, window)
        self.pool = _keep_choice(self.pool, pool, window)

    def nbytes(self) -> int:
        choices = sum(c.nbytes() for c in (self.selection, self.pool) if c is not None)
        return (sum(w.nbytes() for w in self.windows.values()) + sum(s.nbytes() for s in self.stores.values())
                + _nbytes(self.stream, self.pre) + choices + 8 * len(self.tokens))


def _keep_choice(old: Selection | None, new: Selection | None, window: int) -> Selection | None:
    if new is None:  # no entries yet at these positions: keep the previous choice, if any
        return old
    if old is not None and old.idx.shape[-1] != new.idx.shape[-1]:
        raise ValueError("a choice changed its width between calls")
    return new.keep_last(old, window)


@dataclass
class V41AdapterState:
    """Owned by the adapter that last ran the decoder: windows of layers E+1..L-1, at most W positions each."""

    adapter: str | None
    windows: dict[int, LatentWindow]
    length: int = 0

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.windows.values())
