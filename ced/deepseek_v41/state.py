"""One conversation's state for the `deepseek_v41` family, split the way docs/architecture.md §1 splits it.

Per layer a window of the last W latents (K = V: one D-wide latent per position, after RoPE); per KV source a
store of global entries (one latent per group of `ratio` positions, after RoPE, plus its indexer key) and the
inputs of the group not yet complete. `V41Cache` is what a stage's layers read and write, with the verbs of
`ced.state.AttentionCache` (extend_window, compress, has_entries, index_keys, gather) adapted to one latent.
Top-k choices and the candidate pool are `ced.state.Selection`s (entry / block numbers and their validity).

The state the server stores is a `V41ConversationState` (shared + bound, as `ced.state.ConversationState`), with
the family's state operations beside it under the `ced` family's names (`ced.families` finds them here):
`empty_state`, `copy_state`, `delta_of`, `apply_delta` (a `ced.state.StateDelta` whose tensors are named
`entries.{layer}.latent`, `window.{layer}`...) and `new_entries` (what a codec checks a delta read back against).
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import Tensor

from .. import kernels
from ..state import DeltaError, Selection, StateDelta, _nbytes, dense

if TYPE_CHECKING:
    from .config import V41Config

# (groups (B, N', r, C), first entry (B,)) -> latents (B, N', D) and indexer keys (B, N', I), both after RoPE
PoolGroups = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class Tail:
    """A tensor (B, n, ...) that grows along dim 1, keeping its last `keep` positions (None: all), appended in place
    into spare room: a decode step writes one position, O(1), where a concatenation copied the whole. A view it
    handed out is never written afterwards (appends write only past the end of every view handed out, and a full
    buffer is replaced, not reused; a tensor it is given is adopted without room, so never written either), so
    copies of a state may share what they hold. `value` is the same tensor object until the tail changes.

    Where its positions lie is `meta` (a ced.kernels.TailMeta: buffer address, start, n, room, stride, keep), which
    a native decode step (ced/deepseek_v41/native.py) reads and advances in place, as `advance` does."""

    def __init__(self, keep: int | None = None, value: Tensor | None = None):
        self.keep = keep
        self.meta = kernels.TailMeta(keep=keep or 0)
        self.set(value)

    def set(self, value: Tensor | None) -> None:
        """Adopt `value` (B, n, ...) as it is, without room (its first append moves it to a buffer of its own)."""
        meta, n = self.meta, 0 if value is None else value.shape[1]
        meta.buf, meta.start, meta.n, meta.room, meta.stride = 0, 0, n, 0, 0
        self._buf, self._view, self._view_at = value, value, (0, n)

    @property
    def value(self) -> Tensor | None:
        meta = self.meta
        if self._buf is not None and self._view_at != (meta.start, meta.n):
            self._view, self._view_at = self._buf[:, meta.start: meta.start + meta.n], (meta.start, meta.n)
        return self._view

    def __len__(self) -> int:
        return self.meta.n

    def reserve(self, k: int, like: Tensor) -> None:
        """Room for k more positions at the end, shaped and typed as `like` (B, k, ...) (a new buffer if needed)."""
        meta = self.meta
        if self._buf is not None and k <= meta.room:
            return
        keep_n = meta.n if self.keep is None else min(meta.n, self.keep)
        capacity = (2 * self.keep + k) if self.keep is not None else max(2 * (keep_n + k), 16)
        buf = like.new_empty(like.shape[0], capacity, *like.shape[2:])
        if keep_n:
            buf[:, :keep_n] = self._buf[:, meta.start + meta.n - keep_n: meta.start + meta.n]
        self._buf, self._view, self._view_at = buf, None, None
        meta.buf, meta.start, meta.n, meta.room = buf.data_ptr(), 0, keep_n, capacity - keep_n
        meta.stride = buf.stride(1) * buf.element_size()

    def place(self, like: Tensor, at_end: bool = False) -> int:
        """The address of the first position held (`at_end`: of position n), with room reserved for one more at
        position n (a native step writes it there, then the caller calls `advance(1)`)."""
        meta = self.meta
        if meta.room < 1 or self._buf is None:
            self.reserve(1, like)
        return meta.buf + (meta.start + (meta.n if at_end else 0)) * meta.stride

    def next_places(self, k: int, like: Tensor) -> list[int]:
        """The addresses of positions n .. n + k - 1, room reserved (a native call writes them, then `advance(k)`)."""
        self.reserve(k, like)
        meta = self.meta
        base = meta.buf + (meta.start + meta.n) * meta.stride
        return [base + i * meta.stride for i in range(k)]

    def advance(self, k: int) -> None:
        """k positions written past the end now belong to the tail (the oldest drop out past `keep`)."""
        meta = self.meta
        meta.n, meta.room = meta.n + k, meta.room - k
        if self.keep is not None and meta.n > self.keep:
            meta.start, meta.n = meta.start + meta.n - self.keep, self.keep

    def drop(self) -> None:
        """Let go of every position held: the tail is empty, and its next positions go past every view handed out
        (a store's pending inputs, once their group completes, without a new buffer for the next group)."""
        meta = self.meta
        meta.start, meta.n = meta.start + meta.n, 0

    def append(self, new: Tensor) -> None:
        k = new.shape[1]
        self.reserve(k, new)
        start = self.meta.start + self.meta.n
        self._buf[:, start: start + k] = new
        self.advance(k)

    def __getstate__(self) -> dict:
        """What a pickle or a shallow copy keeps: its positions, adopted without room by the copy, which holds no
        address of this buffer (its first write moves it to a buffer of its own)."""
        return {"keep": self.keep, "value": self.value}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["keep"], state["value"])

    def __deepcopy__(self, memo: dict) -> "Tail":
        """A copy with its own buffer, its addresses that buffer's (a copied TailMeta would point at this one's)."""
        twin = Tail(self.keep)
        twin._buf = copy.deepcopy(self._buf, memo)
        ctypes.memmove(ctypes.addressof(twin.meta), ctypes.addressof(self.meta), ctypes.sizeof(self.meta))
        if self.meta.buf:  # a buffer of its own (an adopted tensor has no address: its first write reserves)
            twin.meta.buf = twin._buf.data_ptr()
        twin._view, twin._view_at = None, None
        return twin


class LatentWindow:
    """The latents (after RoPE) of one layer for the last `size` positions before the next query: `kv` (B, n, D),
    n <= size, or None."""

    def __init__(self, size: int, kv: Tensor | None = None):
        self.size, self.tail = size, Tail(size, kv)

    kv = property(lambda self: self.tail.value, lambda self, value: self.tail.set(value))

    def __len__(self) -> int:
        return len(self.tail)

    def append(self, kv: Tensor) -> None:
        self.tail.append(kv)

    def tensors(self) -> Iterator[Tensor]:
        yield from () if self.kv is None else (self.kv,)

    def nbytes(self) -> int:
        return _nbytes(self.kv)


class LatentStore:
    """One KV source's global KV: one entry per complete group of `ratio` positions, plus the partial group.
    `latent` (B, N, D) and `index_keys` (B, N, I) are rotated at each group's first position; `pending` (B, p, C),
    p < ratio, holds the normalised inputs of the group not yet complete."""

    def __init__(self, ratio: int, latent: Tensor | None = None, index_keys: Tensor | None = None,
                 pending: Tensor | None = None):
        self.ratio = ratio
        self.latents, self.keys, self.inputs = Tail(None, latent), Tail(None, index_keys), Tail(None, pending)

    latent = property(lambda self: self.latents.value)
    index_keys = property(lambda self: self.keys.value)
    pending = property(lambda self: self.inputs.value, lambda self, value: self.inputs.set(value))

    @property
    def n_entries(self) -> int:
        return len(self.latents)

    def add_entries(self, latent: Tensor, index_keys: Tensor) -> None:
        if latent.shape[1] == 0:
            return
        self.latents.append(latent)
        self.keys.append(index_keys)

    def tensors(self) -> Iterator[Tensor]:
        yield from (t for t in (self.latent, self.index_keys, self.pending) if t is not None)

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
        groups = self.complete_groups(layer, xn)
        if groups is not None:
            store.add_entries(*pool(groups, torch.full((B,), store.n_entries, device=xn.device)))

    def complete_groups(self, layer: int, xn: Tensor) -> Tensor | None:
        """The groups (B, N', r, C) that complete with xn (B, T, C), taken out of the pending inputs (None: no
        group completes); the rest stays pending. The caller pools them and appends the entries."""
        store, B = self.stores[layer], xn.shape[0]
        rows = xn if store.pending is None else torch.cat([store.pending, xn], dim=1)
        n_groups = rows.shape[1] // store.ratio
        store.pending = rows[:, n_groups * store.ratio:].clone()
        if n_groups == 0:
            return None
        return rows[:, : n_groups * store.ratio].reshape(B, n_groups, store.ratio, -1)  # (B, N', r, C)

    def ratio(self, source: int) -> int:
        return self.stores[source].ratio

    def has_entries(self, source: int) -> bool:
        return self.stores[source].n_entries > 0

    def index_keys(self, source: int) -> Tensor:
        return self.stores[source].index_keys

    def gather(self, source: int, idx: Tensor) -> Tensor:
        """The latents (B, T, k, D) of entries idx (B, T, k) of each row."""
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
        return self.stores[source].latent[rows, idx]


class V41SharedState:
    """Adapter-free: windows of layers 0..E, every source's store, and for the last W positions the first decoder
    layer's post-attention streams `stream` (1, n<=W, hc, C), its attention-site pre-mix `pre` (1, n, hc) (which
    its FFN collapses with), its top-k `selection` and candidate `pool` for the same positions (replay starts from
    these)."""

    def __init__(self, windows: dict[int, LatentWindow], stores: dict[int, LatentStore], stream: Tensor | None = None,
                 pre: Tensor | None = None, selection: Selection | None = None, pool: Selection | None = None,
                 tokens: list[int] | None = None, window: int | None = None):
        self.windows, self.stores = windows, stores
        keep = window or next(iter(windows.values())).size
        self.tails = {name: Tail(keep) for name in ("stream", "pre", *_CHOICE_TAILS)}
        self.stream, self.pre, self.selection, self.pool = stream, pre, selection, pool
        self.tokens = [] if tokens is None else tokens

    stream = property(lambda self: self.tails["stream"].value, lambda self, v: self.tails["stream"].set(v))
    pre = property(lambda self: self.tails["pre"].value, lambda self, v: self.tails["pre"].set(v))

    def _choice(self, name: str) -> Selection | None:
        idx = self.tails[f"{name}.idx"].value
        return None if idx is None else Selection(idx, self.tails[f"{name}.valid"].value)

    def _set_choice(self, name: str, choice: Selection | None) -> None:
        self.tails[f"{name}.idx"].set(None if choice is None else choice.idx)
        self.tails[f"{name}.valid"].set(None if choice is None else choice.valid)

    selection = property(lambda self: self._choice("selection"), lambda self, c: self._set_choice("selection", c))
    pool = property(lambda self: self._choice("pool"), lambda self, c: self._set_choice("pool", c))

    @property
    def length(self) -> int:
        return len(self.tokens)

    def keep(self, stream: Tensor, pre: Tensor, selection: Selection | None, pool: Selection | None) -> None:
        """Append one call's layer-E outputs; the tails keep the last W positions."""
        self.tails["stream"].append(stream)
        self.tails["pre"].append(pre)
        for name, new in (("selection", selection), ("pool", pool)):
            if new is None:  # no entries yet at these positions: keep the previous choice, if any
                continue
            old = self._choice(name)
            if old is not None and old.idx.shape[-1] != new.idx.shape[-1]:
                raise ValueError("a choice changed its width between calls")
            self.tails[f"{name}.idx"].append(new.idx)
            self.tails[f"{name}.valid"].append(new.valid)

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor held: windows, stores, then stream, pre and the choices."""
        for part in (*self.windows.values(), *self.stores.values()):
            yield from part.tensors()
        yield from (t for t in (self.stream, self.pre) if t is not None)
        for choice in (self.selection, self.pool):
            yield from () if choice is None else (choice.idx, choice.valid)

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors()) + 8 * len(self.tokens)


_CHOICE_TAILS = ("selection.idx", "selection.valid", "pool.idx", "pool.valid")


@dataclass
class V41AdapterState:
    """Owned by the adapter that last ran the decoder: windows of layers E+1..L-1, at most W positions each."""

    adapter: str | None
    windows: dict[int, LatentWindow]
    length: int = 0
    digest: str | None = None  # of the adapter weights that built them (the registry's digest); None: unknown

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.windows.values())


@dataclass
class V41ConversationState:
    """One conversation: what every adapter shares and what the adapter that last ran the decoder owns."""

    shared: V41SharedState
    bound: V41AdapterState

    @property
    def length(self) -> int:
        return self.shared.length

    def nbytes(self) -> dict[str, int]:
        return {"shared": self.shared.nbytes(), "adapter_bound": self.bound.nbytes()}

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the state holds (what a byte count that counts shared storage once walks): the shared
        state's, then the adapter-bound windows."""
        yield from self.shared.tensors()
        for window in self.bound.windows.values():
            yield from window.tensors()


def empty_state(config: V41Config) -> V41ConversationState:
    """A conversation with no tokens, as V41Engine.new_conversation builds it, from the config alone."""
    windows = lambda layers: {i: LatentWindow(config.sliding_window) for i in layers}  # noqa: E731
    stores = {i: LatentStore(config.compress_ratios[i]) for i in config.kv_source_layer_ids}
    shared = V41SharedState(windows(range(config.decoder_start + 1)), stores)
    return V41ConversationState(shared, V41AdapterState(None, windows(config.adapter_bound_layers)))


def copy_state(state: V41ConversationState) -> V41ConversationState:
    """A second conversation with `state`'s contents. Only the containers are new: the tensors are shared, since
    nothing writes into them (windows, stores and choices grow by concatenation into new tensors)."""
    shared, bound = state.shared, state.bound
    windows = lambda held: {i: LatentWindow(w.size, w.kv) for i, w in held.items()}  # noqa: E731
    stores = {i: LatentStore(s.ratio, s.latent, s.index_keys, s.pending) for i, s in shared.stores.items()}
    return V41ConversationState(
        V41SharedState(windows(shared.windows), stores, shared.stream, shared.pre, shared.selection, shared.pool,
                       list(shared.tokens)),
        V41AdapterState(bound.adapter, windows(bound.windows), bound.length, bound.digest))


# -- deltas: what a turn adds, as named tensors (ced.state.StateDelta) ---------------------------------------------

_CHOICES = ("selection", "pool")  # the W-bounded top-k and candidate pool, each as `.idx` and `.valid`


def entry_tensors(state: V41ConversationState) -> dict[str, Tensor]:
    """Every append-only part as held (no copy), named as in a delta: what a transfer's base is counted and
    fingerprinted by."""
    return {f"entries.{layer}.{name}": tensor for layer, store in state.shared.stores.items()
            if store.latent is not None
            for name, tensor in (("latent", store.latent), ("index_keys", store.index_keys))}


def bound_tensors(state: V41ConversationState) -> dict[str, Tensor]:
    """The adapter-bound windows by name: what a transfer may carry beside a delta (a journal never does)."""
    return {f"bound.window.{layer}": w.kv for layer, w in state.bound.windows.items() if w.kv is not None}


def set_bound(state: V41ConversationState, tensors: dict[str, Tensor], adapter: str | None, length: int,
              digest: str | None) -> None:
    """The adapter-bound windows from `bound_tensors`' names (none: empty windows)."""
    known = {f"bound.window.{layer}" for layer in state.bound.windows}
    if set(tensors) - known:
        raise DeltaError(f"the adapter-bound windows name parts {sorted(set(tensors) - known)} this state does not have")
    windows = {layer: LatentWindow(w.size, tensors.get(f"bound.window.{layer}"))
               for layer, w in state.bound.windows.items()}
    state.bound = V41AdapterState(adapter, windows, length, digest)


def new_entries(config: V41Config, start_length: int, end_length: int) -> dict[str, int]:
    """The global entries a delta from `start_length` to `end_length` adds, per append-only part (`entries.{layer}`,
    one per completed group of that source's ratio): how a codec checks a delta read back before it is applied."""
    ratios = {layer: config.compress_ratios[layer] for layer in config.kv_source_layer_ids}
    return {f"entries.{layer}": end_length // r - start_length // r for layer, r in ratios.items()}


def _entries_at(store: LatentStore, layer: int, length: int) -> int:
    """The entries a store holds after `length` tokens (one per complete group); refuses a store that disagrees."""
    expected = length // store.ratio
    if store.n_entries != expected:
        raise DeltaError(f"the store of layer {layer} holds {store.n_entries} entries after {length} tokens, not "
                         f"{expected} (one per group of {store.ratio})")
    return expected


def delta_of(state: V41ConversationState, since_length: int) -> StateDelta:
    """What `state` holds beyond its first `since_length` tokens (0: the whole state, a snapshot): the global
    entries added since (appended) and the W-bounded parts whole (replaced). O(new tokens + W) bytes; dense copies
    that share no storage with the live state. The adapter-bound windows are never in it."""
    shared = state.shared
    if not 0 <= since_length <= shared.length:
        raise DeltaError(f"cannot take a delta since token {since_length} of a state of {shared.length} tokens")
    appended, replaced = {}, {}
    for layer, store in shared.stores.items():
        _entries_at(store, layer, shared.length)
        if store.latent is not None:
            first = since_length // store.ratio
            appended[f"entries.{layer}.latent"] = dense(store.latent[:, first:])  # (1, n, D)
            appended[f"entries.{layer}.index_keys"] = dense(store.index_keys[:, first:])  # (1, n, I)
        if store.pending is not None:
            replaced[f"pending.{layer}"] = dense(store.pending)  # (1, p < ratio, C)
    for layer, window in shared.windows.items():
        if window.kv is not None:
            replaced[f"window.{layer}"] = dense(window.kv)  # (1, n <= W, D)
    for name, tensor in (("stream", shared.stream), ("pre", shared.pre)):
        if tensor is not None:
            replaced[name] = dense(tensor)  # (1, n <= W, hc, C), (1, n, hc)
    for name in _CHOICES:
        choice = getattr(shared, name)
        if choice is not None:
            replaced[f"{name}.idx"], replaced[f"{name}.valid"] = dense(choice.idx), dense(choice.valid)
    return StateDelta(start_length=since_length, tokens=list(shared.tokens[since_length:]), appended=appended,
                      replaced=replaced, bound_adapter=state.bound.adapter)


def _check_delta(state: V41ConversationState, delta: StateDelta) -> None:
    """Everything apply_delta relies on, checked before the state is touched."""
    shared = state.shared
    if shared.length != delta.start_length:
        raise DeltaError(f"the delta starts at token {delta.start_length}, the state holds {shared.length}")
    known_appended = {f"entries.{layer}.{part}" for layer in shared.stores for part in ("latent", "index_keys")}
    known_replaced = ({f"pending.{layer}" for layer in shared.stores} | {f"window.{layer}" for layer in shared.windows}
                      | {"stream", "pre"} | {f"{name}.{part}" for name in _CHOICES for part in ("idx", "valid")})
    unknown = sorted(set(delta.appended) - known_appended) + sorted(set(delta.replaced) - known_replaced)
    if unknown:
        raise DeltaError(f"the delta holds parts {unknown} that this deepseek_v41 state does not have")
    end = delta.start_length + len(delta.tokens)
    for layer, store in shared.stores.items():
        latent, keys = delta.appended.get(f"entries.{layer}.latent"), delta.appended.get(f"entries.{layer}.index_keys")
        held = 0 if latent is None else latent.shape[1]
        added = end // store.ratio - _entries_at(store, layer, delta.start_length)
        if held != added or (latent is None) != (keys is None) or (keys is not None and keys.shape[1] != held):
            raise DeltaError(f"the delta holds {held} global entries of layer {layer} (and "
                             f"{0 if keys is None else keys.shape[1]} indexer keys); its {len(delta.tokens)} tokens "
                             f"from token {delta.start_length} complete {added}")
        row = lambda t: (t.shape[0], *t.shape[2:], t.dtype)  # noqa: E731  (what joins along dim 1 must match)
        for new, old in ((latent, store.latent), (keys, store.index_keys)):
            if new is not None and old is not None and row(new) != row(old):
                raise DeltaError(f"the delta's entries of layer {layer} are {tuple(new.shape)} {new.dtype}; the "
                                 f"state's are {tuple(old.shape)} {old.dtype}")
    for name in _CHOICES:
        if (f"{name}.idx" in delta.replaced) != (f"{name}.valid" in delta.replaced):
            raise DeltaError(f"the delta holds one of {name}.idx and {name}.valid without the other")


def apply_delta(state: V41ConversationState, delta: StateDelta) -> None:
    """Extend `state` (of exactly delta.start_length tokens) by `delta`; a delta that does not fit raises DeltaError
    and leaves the state as it was. The adapter-bound windows come back empty, for `delta.bound_adapter` at length
    0: the next turn rebuilds them by replay."""
    _check_delta(state, delta)
    shared, replaced = state.shared, delta.replaced
    shared.tokens.extend(delta.tokens)
    for layer, store in shared.stores.items():
        if f"entries.{layer}.latent" in delta.appended:
            store.add_entries(delta.appended[f"entries.{layer}.latent"], delta.appended[f"entries.{layer}.index_keys"])
        store.pending = replaced.get(f"pending.{layer}")
    for layer, window in shared.windows.items():
        window.kv = replaced.get(f"window.{layer}")
    shared.stream, shared.pre = replaced.get("stream"), replaced.get("pre")
    for name in _CHOICES:
        choice = Selection(replaced[f"{name}.idx"], replaced[f"{name}.valid"]) if f"{name}.idx" in replaced else None
        setattr(shared, name, choice)
    empty = {i: LatentWindow(w.size) for i, w in state.bound.windows.items()}
    state.bound = V41AdapterState(delta.bound_adapter, empty)
