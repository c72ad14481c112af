"""A conversation's state, split the way docs/architecture.md §1 splits it: what every adapter shares, and what one
adapter owns.

The model owns no conversation state: each stage reads and appends to these small objects. Everything is a
tensor with batch dimension 1 (one conversation); byte counts are the tensors' own sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .config import CEDConfig


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cat_keep_last(old: Tensor | None, new: Tensor, dim: int, keep: int) -> Tensor:
    joined = new if old is None else torch.cat([old, new], dim=dim)
    return joined.narrow(dim, max(0, joined.shape[dim] - keep), min(keep, joined.shape[dim])).clone()


@dataclass
class LocalWindow:
    """Keys (after RoPE) and values of one layer for the last `size` positions that precede the next query."""

    size: int
    k: Tensor | None = None  # (B, H, n, D), n <= size
    v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> None:
        self.k = _cat_keep_last(self.k, k, 2, self.size)
        self.v = _cat_keep_last(self.v, v, 2, self.size)

    def nbytes(self) -> int:
        return _nbytes(self.k, self.v)


@dataclass
class GlobalKV:
    """One source layer's compressed global KV: one entry per completed block of m tokens, plus the partial block."""

    k: Tensor | None = None  # (B, N, H, D), RoPE'd at each block's last position
    v: Tensor | None = None  # (B, N, H, D)
    index_keys: Tensor | None = None  # (B, N, I)
    pending: Tensor | None = None  # (B, p, C) normalized inputs of the block not yet complete, p < m

    @property
    def n_entries(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def add_entries(self, k: Tensor, v: Tensor, index_keys: Tensor) -> None:
        if k.shape[1] == 0:
            return
        cat = lambda old, new: new if old is None else torch.cat([old, new], dim=1)  # noqa: E731
        self.k, self.v, self.index_keys = cat(self.k, k), cat(self.v, v), cat(self.index_keys, index_keys)

    def nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.index_keys, self.pending)


@dataclass
class Selection:
    """The top-k global entries chosen for each query position: indices into a GlobalKV and their validity."""

    idx: Tensor  # (B, T, k) long
    valid: Tensor  # (B, T, k) bool: False where fewer than k completed blocks precede the query

    def keep_last(self, previous: "Selection | None", keep: int) -> "Selection":
        """This selection appended to `previous`, trimmed to the last `keep` positions."""
        prev_idx, prev_valid = (None, None) if previous is None else (previous.idx, previous.valid)
        return Selection(_cat_keep_last(prev_idx, self.idx, 1, keep), _cat_keep_last(prev_valid, self.valid, 1, keep))

    def nbytes(self) -> int:
        return _nbytes(self.idx, self.valid)


@dataclass
class SharedState:
    """Adapter-free: encoder windows, the first decoder layer's window and post-attention stream, the global KV."""

    windows: dict[int, LocalWindow]  # layers 0..E (the first decoder layer's attention is adapter-free)
    globals: dict[int, GlobalKV]  # per source layer
    stream: Tensor | None = None  # (B, n<=W, C): residual stream after layer E's attention; replay starts here
    selection: Selection | None = None  # layer E's top-k choice for the same n positions
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        windows = sum(w.nbytes() for w in self.windows.values())
        globals_ = sum(g.nbytes() for g in self.globals.values())
        selection = self.selection.nbytes() if self.selection is not None else 0
        return windows + globals_ + _nbytes(self.stream) + selection + 8 * len(self.tokens)


@dataclass
class AdapterState:
    """Owned by the adapter that last ran the decoder: local windows of layers E+1..L-1, at most W positions each."""

    adapter: str | None
    windows: dict[int, LocalWindow]
    length: int = 0  # the context length these windows are current for
    digest: str | None = None  # of the adapter weights that built them (AdapterRegistry.digest); None: unknown

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.windows.values())


@dataclass
class ConversationState:
    shared: SharedState
    bound: AdapterState

    @property
    def length(self) -> int:
        return self.shared.length

    def nbytes(self) -> dict[str, int]:
        return {"shared": self.shared.nbytes(), "adapter_bound": self.bound.nbytes()}


@dataclass
class StateDelta:
    """What one turn adds to a conversation's state, in any model family: its tensors by name. A journal's records,
    replayed in order, rebuild the state; a transfer sends one. The adapter-bound windows are never kept: every turn
    replays them. The family's `delta_of` / `apply_delta` name the tensors (here: `entries.{layer}.k`, `.v`,
    `.index_keys`; `pending.{layer}`, `window.{layer}.k`, `.v`, `stream`, `selection.idx`, `selection.valid`)."""

    start_length: int  # tokens before this delta; 0 = a snapshot (the whole state)
    tokens: list[int]  # tokens appended by this turn
    appended: dict[str, Tensor] = field(default_factory=dict)  # `entries.*`: rows added (dim 1) to append-only parts
    replaced: dict[str, Tensor] = field(default_factory=dict)  # the W-bounded parts after the turn, whole
    bound_adapter: str | None = None  # metadata only: the adapter that answered the turn

    @property
    def end_length(self) -> int:
        return self.start_length + len(self.tokens)

    def added_nbytes(self) -> int:
        """Bytes this delta adds for good: its tokens and append-only rows."""
        return 8 * len(self.tokens) + sum(t.nbytes for t in self.appended.values())

    def replaced_nbytes(self) -> int:
        """Bytes of the W-bounded parts, which the next delta replaces."""
        return sum(t.nbytes for t in self.replaced.values())


APPENDED = "entries."  # the prefix of every append-only tensor's name, whatever the family


def split_delta(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A delta's tensors by name into (appended, replaced): how a codec reads them back."""
    appended = {name: t for name, t in tensors.items() if name.startswith(APPENDED)}
    return appended, {name: t for name, t in tensors.items() if not name.startswith(APPENDED)}


class DeltaError(ValueError):
    """A delta that does not fit the state it is taken from or applied to."""


def dense(tensor: Tensor) -> Tensor:
    """A dense copy: a size-1 dim may carry stride 0 (ONNX Runtime outputs do), and a delta must not share storage
    with the live state it was taken from."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def copy_state(state: ConversationState) -> ConversationState:
    """A second conversation with `state`'s contents. The tensors are shared: every engine replaces a state's tensors
    and never writes into them (windows and stores grow by concatenation), so only the containers are new."""
    shared, bound = state.shared, state.bound
    windows = lambda held: {i: LocalWindow(w.size, w.k, w.v) for i, w in held.items()}  # noqa: E731
    stores = {i: GlobalKV(g.k, g.v, g.index_keys, g.pending) for i, g in shared.globals.items()}
    return ConversationState(SharedState(windows(shared.windows), stores, shared.stream, shared.selection,
                                         list(shared.tokens)),
                             AdapterState(bound.adapter, windows(bound.windows), bound.length, bound.digest))


def empty_state(config: CEDConfig) -> ConversationState:
    """A conversation with no tokens, as CEDEngine.new_conversation builds it, from the config alone."""
    windows = lambda layers: {i: LocalWindow(config.window) for i in layers}  # noqa: E731
    shared = SharedState(windows(range(config.decoder_start + 1)), {i: GlobalKV() for i in config.source_layers})
    return ConversationState(shared, AdapterState(None, windows(config.adapter_bound_layers)))


def entry_tensors(state: ConversationState) -> dict[str, Tensor]:
    """Every append-only part as held (no copy), named as in a delta: what a transfer's base is counted and
    fingerprinted by."""
    return {f"entries.{layer}.{name}": tensor for layer, g in state.shared.globals.items() if g.k is not None
            for name, tensor in (("k", g.k), ("v", g.v), ("index_keys", g.index_keys))}


def bound_tensors(state: ConversationState) -> dict[str, Tensor]:
    """The adapter-bound windows by name: what a transfer may carry beside a delta (a journal never does)."""
    return {f"bound.window.{layer}.{name}": tensor for layer, w in state.bound.windows.items() if w.k is not None
            for name, tensor in (("k", w.k), ("v", w.v))}


def set_bound(state: ConversationState, tensors: dict[str, Tensor], adapter: str | None, length: int,
              digest: str | None) -> None:
    """The adapter-bound windows from `bound_tensors`' names (none: empty windows)."""
    known = {f"bound.window.{layer}.{name}" for layer in state.bound.windows for name in ("k", "v")}
    if set(tensors) - known:
        raise DeltaError(f"the adapter-bound windows name parts {sorted(set(tensors) - known)} this state does not have")
    windows = {layer: LocalWindow(w.size, tensors.get(f"bound.window.{layer}.k"), tensors.get(f"bound.window.{layer}.v"))
               for layer, w in state.bound.windows.items()}
    state.bound = AdapterState(adapter, windows, length, digest)


def new_entries(config: CEDConfig, start_length: int, end_length: int) -> dict[str, int]:
    """The global entries a delta from `start_length` to `end_length` adds, per append-only part (`entries.{layer}`):
    how a codec checks a delta read back before it is applied (one entry per completed block of m tokens)."""
    m = config.block_size
    return {f"entries.{layer}": end_length // m - start_length // m for layer in config.source_layers}


def _first_new_entry(globals_: dict[int, GlobalKV], length: int, since_length: int) -> int:
    """since_length // m, with m read off the state (a source holds length // m entries and length % m pending
    rows), so that a delta is taken without the config."""
    store = next(iter(globals_.values()), None)
    if store is None or store.n_entries == 0:
        return 0
    pending = 0 if store.pending is None else store.pending.shape[1]
    return since_length // ((length - pending) // store.n_entries)


def delta_of(state: ConversationState, since_length: int) -> StateDelta:
    """What `state` holds beyond its first `since_length` tokens (0: the whole state, a snapshot)."""
    shared = state.shared
    if not 0 <= since_length <= shared.length:
        raise DeltaError(f"cannot take a delta since token {since_length} of a state of {shared.length} tokens")
    first = _first_new_entry(shared.globals, shared.length, since_length)
    appended = {f"entries.{layer}.{name}": dense(tensor[:, first:]) for layer, g in shared.globals.items()
                if g.k is not None for name, tensor in (("k", g.k), ("v", g.v), ("index_keys", g.index_keys))}
    replaced = {f"pending.{layer}": dense(g.pending) for layer, g in shared.globals.items()
                if g.pending is not None and g.pending.shape[1]}
    for layer, w in shared.windows.items():
        if w.k is not None:
            replaced[f"window.{layer}.k"], replaced[f"window.{layer}.v"] = dense(w.k), dense(w.v)
    if shared.stream is not None:
        replaced["stream"] = dense(shared.stream)
    if shared.selection is not None:
        replaced["selection.idx"], replaced["selection.valid"] = (dense(shared.selection.idx),
                                                                  dense(shared.selection.valid))
    return StateDelta(since_length, list(shared.tokens[since_length:]), appended, replaced, state.bound.adapter)


def apply_delta(state: ConversationState, delta: StateDelta) -> None:
    """Extend `state` (of exactly delta.start_length tokens) by `delta`. The adapter-bound windows come back empty,
    for `delta.bound_adapter` at length 0: the next turn rebuilds them by replay."""
    shared = state.shared
    if shared.length != delta.start_length:
        raise DeltaError(f"the delta starts at token {delta.start_length}, the state holds {shared.length}")
    known = {"stream", "selection.idx", "selection.valid"}
    known |= {f"entries.{layer}.{name}" for layer in shared.globals for name in ("k", "v", "index_keys")}
    known |= {f"pending.{layer}" for layer in shared.globals}
    known |= {f"window.{layer}.{name}" for layer in shared.windows for name in ("k", "v")}
    unknown = sorted(set(delta.appended) - known) + sorted(set(delta.replaced) - known)
    if unknown:
        raise DeltaError(f"the delta names parts {unknown} this state does not have")
    shared.tokens.extend(delta.tokens)
    for layer, store in shared.globals.items():
        if f"entries.{layer}.k" in delta.appended:
            store.add_entries(*(delta.appended[f"entries.{layer}.{name}"] for name in ("k", "v", "index_keys")))
        store.pending = delta.replaced.get(f"pending.{layer}")
    for layer, window in shared.windows.items():
        window.k, window.v = delta.replaced.get(f"window.{layer}.k"), delta.replaced.get(f"window.{layer}.v")
    shared.stream = delta.replaced.get("stream")
    selection = delta.replaced.get("selection.idx"), delta.replaced.get("selection.valid")
    shared.selection = None if selection[0] is None else Selection(*selection)
    state.bound = AdapterState(delta.bound_adapter, {i: LocalWindow(w.size) for i, w in state.bound.windows.items()})


# -- what the model's attention reads and writes ---------------------------------------------------------------

PoolBlocks = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]  # (blocks, first entry) -> k, v, index keys


class AttentionCache(Protocol):
    """A layer's view of the conversation state of the rows it runs: the model does the arithmetic, the cache the
    bookkeeping. Layers are named by index; `source` is a global-KV source layer."""

    # True where the calls are traced into a graph (ExportCache): lengths are unknown until the graph runs, so
    # the model takes the graph form of its data-dependent choices (Indexer.select, top_k_recent) and skips
    # nothing; False on the eager caches, whose lengths are known and whose Python branches are fast paths.
    graph: bool

    def extend_window(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Keep this call's keys and values (B, H, T, D) at positions (B or 1, T) as the newest of the window;
        returns the keys and values (B, H, S, D) its queries may attend to, in any order, with their positions
        (B or 1, S) (the model masks by distance)."""

    def compress(self, layer: int, xn: Tensor, pool: PoolBlocks) -> None:
        """Append the global entries of every block that completes with xn (B, T, C); keep the rest pending."""

    def has_entries(self, source: int) -> bool: ...

    def index_keys(self, source: int) -> Tensor:
        """(B, N, I); a row with fewer entries is padded with finite values past its own."""

    def gather(self, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        """The global K and V (B, T, k, H, D) of the entries idx (B, T, k) of each row."""

    def native_decode(self, positions: Tensor):
        """This call as one native decode step (ced/native_decode.NativeDecode), or None where the cache has no
        native form: only the paged pool's decode steps have one."""


class ListCache:
    """The cache over one conversation's LocalWindow / GlobalKV objects (or rows that share positions, as in
    training): the reference path of training, the oracle and the serial engine."""

    graph = False

    def __init__(self, windows: dict[int, LocalWindow], stores: dict[int, GlobalKV], start: int, block_size: int):
        self.windows, self.stores, self.start, self.block_size = windows, stores, start, block_size

    def extend_window(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        window = self.windows[layer]
        past = len(window)
        keys = k if past == 0 else torch.cat([window.k, k], dim=2)  # (B, H, S, D)
        values = v if past == 0 else torch.cat([window.v, v], dim=2)
        window.append(k, v)
        if past == 0:
            return keys, values, positions
        past_pos = torch.arange(self.start - past, self.start, device=k.device)[None]
        rows = max(past_pos.shape[0], positions.shape[0])
        return keys, values, torch.cat([past_pos.expand(rows, -1), positions.expand(rows, -1)], dim=1)

    def compress(self, layer: int, xn: Tensor, pool: PoolBlocks) -> None:
        store, m, B = self.stores[layer], self.block_size, xn.shape[0]
        rows = xn if store.pending is None else torch.cat([store.pending, xn], dim=1)
        n_blocks = rows.shape[1] // m
        store.pending = rows[:, n_blocks * m:].clone()
        if n_blocks:
            blocks = rows[:, : n_blocks * m].reshape(B, n_blocks, m, -1)  # (B, N', m, C)
            store.add_entries(*pool(blocks, torch.full((B,), store.n_entries, device=xn.device)))

    def has_entries(self, source: int) -> bool:
        return self.stores[source].n_entries > 0

    def index_keys(self, source: int) -> Tensor:
        return self.stores[source].index_keys

    def gather(self, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        store = self.stores[source]
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
        return store.k[rows, idx], store.v[rows, idx]

    def native_decode(self, positions: Tensor) -> None:
        return None


class ExportCache:
    """The cache over explicit state tensors, for an exported stage: its graph inputs in, the updated state read
    back as its outputs. Every length (a window, the global entries, the partial block) is a dimension that may be
    zero when the graph runs, so nothing here branches on one: windows are joined and cut to the last W, blocks
    are split by integer division (maybe none), and an all-zero entry after each row's global ones is what a
    selection points at before any block exists (such slots are invalid: they get no weight)."""

    graph = True

    def __init__(self, windows: dict[int, tuple[Tensor, Tensor]], stores: dict[int, tuple[Tensor, Tensor, Tensor]],
                 pending: dict[int, Tensor], block_size: int, window: int):
        self.windows = dict(windows)  # layer -> keys, values (B, H, n, D); after the call: the last W positions
        self.stores = dict(stores)  # source -> k, v (B, N, H, D), index keys (B, N, I); compress appends
        self.pending = dict(pending)  # source -> (B, p, C); after the call: the block not yet complete
        self.added: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # source -> the entries this call added
        self.block_size, self.window = block_size, window

    def extend_window(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        past_k, past_v = self.windows[layer]
        keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # (B, H, S, D)
        self.windows[layer] = keys[:, :, -self.window:], values[:, :, -self.window:]
        key_pos = torch.arange(keys.shape[2], device=k.device)[None] + (positions[:, :1] - past_k.shape[2])
        return keys, values, key_pos  # key_pos (B or 1, S): the past, then this call's positions

    def compress(self, layer: int, xn: Tensor, pool: PoolBlocks) -> None:
        (B, _, C), m = xn.shape, self.block_size
        rows = torch.cat([self.pending[layer], xn], dim=1)  # (B, p + T, C)
        n_blocks = rows.shape[1] // m
        first = torch.zeros(B, dtype=torch.long, device=xn.device) + self.stores[layer][0].shape[1]
        self.added[layer] = pool(rows[:, : n_blocks * m].reshape(B, n_blocks, m, C), first)  # (B, N', m, C) in
        self.stores[layer] = tuple(torch.cat(pair, dim=1) for pair in zip(self.stores[layer], self.added[layer]))
        self.pending[layer] = rows[:, n_blocks * m:]

    def has_entries(self, source: int) -> bool:
        return True  # maybe none when the graph runs: the selection's validity masks them

    def index_keys(self, source: int) -> Tensor:
        return self.stores[source][2]

    def gather(self, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        k, v, _ = self.stores[source]
        B, N = k.shape[:2]
        zero = k.new_zeros(B, 1, *k.shape[2:])
        picks = idx + (torch.arange(B, device=idx.device) * (N + 1))[:, None, None]  # into the rows laid end to end
        flat = lambda t: torch.cat([t, zero], dim=1).reshape(-1, *t.shape[2:])  # noqa: E731  (B * (N + 1), H, D)
        return flat(k)[picks], flat(v)[picks]

    def native_decode(self, positions: Tensor) -> None:
        return None
