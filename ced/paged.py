"""The serving engine's conversation state: many conversations resident in one pool, read by batched steps.

Global KV and indexer keys live in fixed-size pages (`page_entries` entries each) appended in place; each
conversation holds a page table. Local windows, the replay stream and layer E's top-k choice are ring buffers of W
positions in a slot of the conversation's own (position p at p % W). Nothing is ever concatenated with the
history: a step writes its new positions and reads by gather. `PagedCache` is the `AttentionCache` of one batch
of rows over the pool, so the model's arithmetic (ced/model.py) is the same as on the reference objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import kernels
from .config import CEDConfig
from .native_decode import NativeDecode
from .state import PoolBlocks, Selection

FAR = -(1 << 30)  # the position given to an empty ring place: farther than any window reaches


@dataclass
class Resident:
    """One conversation in the pool: its slot (rings), its pages (global entries) and its tokens."""

    slot: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    bound_adapter: str | None = None  # whose windows fill the adapter-bound rings
    bound_length: int = -1  # the context length those windows are current for (-1: none)

    @property
    def length(self) -> int:
        return len(self.tokens)


class PagePool:
    """Buffers allocated once for a capacity and doubled when full (amortised: never per turn). What growth adds is
    allocated empty, so the operating system backs only the slots and pages in use (a large capacity costs address
    space, not memory); a slot or page is zeroed when it is handed out. `capacity_bytes`: room for that many bytes of
    conversations whatever their shape (all of it slots, or all of it pages), so that a server whose prefix cache
    fills its budget does not stop every stream to copy the pool (256 -> 512 slots: 0.4 s)."""

    def __init__(self, config: CEDConfig, dtype: torch.dtype, page_entries: int = 64, slots: int = 4,
                 pages: int = 16, capacity_bytes: int = 0):
        self.config, self.dtype, self.page_entries = config, dtype, page_entries
        c, self.W = config, config.window
        self.wk = {layer: self._zeros(slots, c.n_heads, self.W, c.head_dim) for layer in range(c.n_layers)}
        self.wv = {layer: self._zeros(slots, c.n_heads, self.W, c.head_dim) for layer in range(c.n_layers)}
        self.pending = {s: self._zeros(slots, c.block_size, c.hidden_size) for s in c.source_layers}
        self.stream = self._zeros(slots, self.W, c.hidden_size)
        self.sel_idx = torch.zeros(slots, self.W, c.index_top_k, dtype=torch.long)
        self.sel_valid = torch.zeros(slots, self.W, c.index_top_k, dtype=torch.bool)
        self.gk = {s: self._zeros(pages, page_entries, c.n_heads, c.head_dim) for s in c.source_layers}
        self.gv = {s: self._zeros(pages, page_entries, c.n_heads, c.head_dim) for s in c.source_layers}
        self.gi = {s: self._zeros(pages, page_entries, c.index_dim) for s in c.source_layers}
        self.free_slots, self.free_pages = list(range(slots))[::-1], list(range(pages))[::-1]
        self.holders: dict[int, Resident] = {}  # slot -> the conversation in it (settle moves conversations)
        self.page_refs = [0] * pages  # conversations holding each page: forks share their common prefix's pages
        self.native_plans: dict = {}  # the native decode step's arrays over these buffers (ced/native_decode.py)
        if capacity_bytes:
            self._grow_slots(max(0, capacity_bytes // self.slot_nbytes() - slots))
            self._grow_pages(max(0, capacity_bytes // self.page_nbytes() - pages))

    def _zeros(self, *shape) -> Tensor:
        return torch.zeros(*shape, dtype=self.dtype)

    @property
    def n_slots(self) -> int:
        return self.stream.shape[0]

    @property
    def n_pages(self) -> int:
        return next(iter(self.gk.values())).shape[0]

    def _grow(self, buffers: dict, extra: int) -> None:
        for key, buffer in buffers.items():  # not torch.cat: that would write (and so back) the new part too
            buffers[key] = torch.empty(len(buffer) + extra, *buffer.shape[1:], dtype=buffer.dtype)
            buffers[key][: len(buffer)] = buffer

    def _grow_slots(self, extra: int) -> None:
        self._grow(self.wk, extra), self._grow(self.wv, extra), self._grow(self.pending, extra)
        rings = {"stream": self.stream, "sel_idx": self.sel_idx, "sel_valid": self.sel_valid}
        self._grow(rings, extra)
        self.stream, self.sel_idx, self.sel_valid = rings["stream"], rings["sel_idx"], rings["sel_valid"]
        self.free_slots = list(range(self.n_slots - extra, self.n_slots))[::-1] + self.free_slots

    def _grow_pages(self, extra: int) -> None:
        self._grow(self.gk, extra), self._grow(self.gv, extra), self._grow(self.gi, extra)
        self.free_pages = list(range(self.n_pages - extra, self.n_pages))[::-1] + self.free_pages
        self.page_refs.extend([0] * extra)

    def open(self, zero: bool = True) -> Resident:
        """A free slot, zeroed unless the caller writes all of it (`zero=False`)."""
        if not self.free_slots:
            self._grow_slots(self.n_slots)
        conversation = Resident(self.free_slots.pop())
        for buffer in self._slot_buffers() if zero else ():  # a grown slot is uninitialised, a released one holds
            buffer[conversation.slot].zero_()  # its last owner's
        self.holders[conversation.slot] = conversation
        return conversation

    def reserve(self, conversation: Resident, length: int) -> None:
        """Pages for the global entries of a context of `length` tokens."""
        needed = -(-(length // self.config.block_size) // self.page_entries) - len(conversation.pages)
        if needed > len(self.free_pages):
            self._grow_pages(max(self.n_pages, needed - len(self.free_pages)))
        for _ in range(max(0, needed)):
            page = self.free_pages.pop()
            for buffers in (self.gk, self.gv, self.gi):  # a grown page is uninitialised: read past its entries, it
                for buffer in buffers.values():  # must still be finite (masked places get no weight, not NaN)
                    buffer[page].zero_()
            self.page_refs[page] = 1
            conversation.pages.append(page)

    def release(self, conversation: Resident) -> None:
        self.free_slots.append(conversation.slot)
        del self.holders[conversation.slot]
        for page in conversation.pages:
            self.page_refs[page] -= 1
            if not self.page_refs[page]:
                self.free_pages.append(page)
        conversation.pages, conversation.slot = [], -1

    def settle(self, conversations: list[Resident]) -> None:
        """Move these conversations into slots 0..len-1 (any order), so that a decode step reads their rings as
        one slice of each buffer in place rather than copying them out every step (a copy of each layer's window
        of every row: a third of a 16-row step). Only conversations outside that range move, each once: a batch
        that keeps its rows moves nothing; a row that joins moves once."""
        inside = {c.slot for c in conversations if c.slot < len(conversations)}
        targets = iter(sorted(set(range(len(conversations))) - inside))
        for conversation in conversations:
            if conversation.slot >= len(conversations):
                self._swap(conversation.slot, next(targets))

    def _slot_buffers(self) -> list[Tensor]:
        return [*self.wk.values(), *self.wv.values(), *self.pending.values(), self.stream, self.sel_idx,
                self.sel_valid]

    def _swap(self, a: int, b: int) -> None:
        """Exchange the contents and the holders of slots a and b (a free one is not copied)."""
        held_a, held_b = self.holders.pop(a, None), self.holders.pop(b, None)
        if held_a is None and held_b is None:
            return
        for buffer in self._slot_buffers():
            kept = buffer[b].clone() if held_b is not None else None
            if held_a is not None:
                buffer[b] = buffer[a]
            if kept is not None:
                buffer[a] = kept
        for conversation, slot, vacated in ((held_a, b, a), (held_b, a, b)):
            if conversation is not None:
                conversation.slot, self.holders[slot] = slot, conversation
            else:  # `vacated` was free: now `slot` is
                self.free_slots[self.free_slots.index(vacated)] = slot

    def fork(self, conversation: Resident) -> Resident:
        """A second conversation with this one's whole state: its rings copied into a slot of its own, its full
        pages shared (append-only: neither writes them again), its last partial page copied (both append there)."""
        copy = self.open(zero=False)  # every buffer of the slot is copied below
        for rings in (self.wk, self.wv, self.pending):
            for ring in rings.values():
                ring[copy.slot] = ring[conversation.slot]
        for ring in (self.stream, self.sel_idx, self.sel_valid):
            ring[copy.slot] = ring[conversation.slot]
        n_entries = conversation.length // self.config.block_size
        full = n_entries // self.page_entries
        shared = conversation.pages[:full]
        for page in shared:
            self.page_refs[page] += 1
        copy.pages = list(shared)
        copy.tokens = list(conversation.tokens)
        if len(conversation.pages) > full:  # entries of the last page so far, then room for the rest
            self.reserve(copy, (full + 1) * self.page_entries * self.config.block_size)
            last, own = conversation.pages[full], copy.pages[full]
            for buffers in (self.gk, self.gv, self.gi):
                for buffer in buffers.values():
                    buffer[own] = buffer[last]
        self.reserve(copy, copy.length)
        return copy

    def unshared_nbytes(self, conversations: list[Resident]) -> int:
        """Bytes these conversations hold together, a page they share counted once."""
        pages = {page for conversation in conversations for page in conversation.pages}
        return len(conversations) * self.slot_nbytes() + len(pages) * self.page_nbytes()

    def nbytes(self, conversation: Resident) -> int:
        """Bytes this conversation holds (its slot and its pages)."""
        return self.slot_nbytes() + self.page_nbytes() * len(conversation.pages)

    def slot_nbytes(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in self._slot_buffers())

    def page_nbytes(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in (*self.gk.values(), *self.gv.values(), *self.gi.values()))

    # -- reading rings in order ------------------------------------------------------------------------------

    def ring_positions(self, ends: list[int], count: int) -> Tensor:
        """(B, count): the last `count` positions before each row's end, FAR where a row has fewer."""
        positions = torch.tensor(ends)[:, None] - count + torch.arange(count)[None]
        return positions.masked_fill(positions < 0, FAR)

    def read_ring(self, ring: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
        """Rows of `ring` (slots, W, ...) at positions (B, S), in that order: (B, S, ...)."""
        return ring[slots[:, None], positions % self.W]

    def write_ring(self, ring: Tensor, slots: Tensor, starts: list[int], values: Tensor,
                   lengths: list[int] | None = None) -> None:
        """values (B, T, ...) at positions starts..starts+T-1; only the last W can be kept. `lengths`: only each
        row's first n are real (a batch of chunks of different lengths, padded)."""
        if lengths is not None:
            rows, columns, places = self._ragged_places(starts, values.shape[1], lengths)
            ring[slots[rows], places] = values[rows, columns]
            return
        keep = min(values.shape[1], self.W)
        positions = torch.tensor(starts)[:, None] + torch.arange(values.shape[1] - keep, values.shape[1])[None]
        ring[slots[:, None], positions % self.W] = values[:, -keep:]

    def _ragged_places(self, starts: list[int], T: int, lengths: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(row, column, ring place) of each value to keep: each row's last W of its first `lengths` columns."""
        columns, n = torch.arange(T)[None], torch.tensor(lengths)[:, None]
        rows, columns = ((columns < n) & (columns >= n - self.W)).nonzero(as_tuple=True)
        return rows, columns, (torch.tensor(starts)[rows] + columns) % self.W

    def read_window(self, ring: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
        """Window keys or values (slots, H, W, D) at positions (B, S): (B, H, S, D)."""
        return ring[slots[:, None], :, positions % self.W].transpose(1, 2)

    def write_window(self, ring: Tensor, slots: Tensor, starts: list[int], values: Tensor,
                     lengths: list[int] | None = None) -> None:
        """Keys or values (B, H, T, D) at positions starts..starts+T-1; only the last W can be kept (of each row's
        first `lengths`, if given)."""
        if lengths is not None:
            rows, columns, places = self._ragged_places(starts, values.shape[2], lengths)
            ring[slots[rows], :, places] = values[rows, :, columns]
            return
        keep = min(values.shape[2], self.W)
        positions = torch.tensor(starts)[:, None] + torch.arange(values.shape[2] - keep, values.shape[2])[None]
        ring[slots[:, None], :, positions % self.W] = values[:, :, -keep:].transpose(1, 2)

    def page_table(self, rows: list[Resident]) -> Tensor:
        width = max(1, max(len(row.pages) for row in rows))
        return torch.tensor([row.pages + [0] * (width - len(row.pages)) for row in rows])  # pad: finite, masked

    def entry_places(self, table: Tensor, entries: Tensor) -> tuple[Tensor, Tensor]:
        """(page, offset) of entry numbers (B, ...) of each row."""
        flat = entries.reshape(entries.shape[0], -1)
        pages = table.gather(1, flat // self.page_entries).view_as(entries)
        return pages, entries % self.page_entries


class PagedCache:
    """The AttentionCache of rows over the pool, for one call of T positions per row starting at `starts`.

    `fresh` names layers whose past is empty for this call (replay rebuilds the adapter-bound windows)."""

    graph = False

    def __init__(self, pool: PagePool, rows: list[Resident], starts: list[int], length: int,
                 fresh: frozenset[int] = frozenset(), lengths: list[int] | None = None):
        self.pool, self.rows, self.starts, self.length, self.fresh = pool, rows, starts, length, fresh
        self.lengths = lengths  # a padded batch of chunks: each row's real length (None: all `length`)
        self.slots = torch.tensor([row.slot for row in rows])
        first = rows[0].slot
        # rows in consecutive slots (a settled decode batch, in slot order): their rings are one slice, read in place
        self.span = slice(first, first + len(rows)) if all(r.slot == first + i for i, r in enumerate(rows)) else None
        self.ends = [start + n for start, n in zip(starts, lengths or [length] * len(rows))]
        self.table = pool.page_table(rows)
        self.m = pool.config.block_size
        self._past = {}  # ring read positions per window length: shared by every layer of the call

    def extend_window(self, layer: int, k: Tensor, v: Tensor, positions: Tensor):
        pool, ring_k, ring_v = self.pool, self.pool.wk[layer], self.pool.wv[layer]
        if self.length == 1 and layer not in self.fresh:
            # A decode step: write first, then attend over each row's ring (its order does not matter to the
            # softmax): in place where the rows are settled (PagePool.settle), else one contiguous copy of them.
            # Only the filled places: while every row is shorter than W, the places past the longest are empty.
            pool.write_window(ring_k, self.slots, self.starts, k)
            pool.write_window(ring_v, self.slots, self.starts, v)
            key_pos = self.ring_key_positions()
            filled = key_pos.shape[1]
            if self.span is not None:
                return ring_k[self.span, :, :filled], ring_v[self.span, :, :filled], key_pos
            copied = (ring[:, :, :filled].index_select(0, self.slots) for ring in (ring_k, ring_v))
            return *copied, key_pos
        # A chunk (prefill, replay): the window before it in order, then the chunk itself.
        count = 0 if layer in self.fresh else min(pool.W, max(self.starts))
        if count:
            if count not in self._past:
                self._past[count] = pool.ring_positions(self.starts, count)
            past = self._past[count]
            past_k, past_v = pool.read_window(ring_k, self.slots, past), pool.read_window(ring_v, self.slots, past)
        pool.write_window(ring_k, self.slots, self.starts, k, self.lengths)
        pool.write_window(ring_v, self.slots, self.starts, v, self.lengths)
        if not count:
            return k, v, positions
        return (torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2),
                torch.cat([past, positions.expand(past.shape[0], -1)], dim=1))

    def ring_key_positions(self) -> Tensor:
        """A decode step's (B, filled): the position each ring place holds once this step's token is written
        (FAR where empty)."""
        if "ring" not in self._past:
            held = torch.tensor(self.starts)[:, None]
            filled = min(self.pool.W, max(self.ends))
            ring_positions = held - (held - torch.arange(filled)[None]).remainder(self.pool.W)  # (B, filled)
            self._past["ring"] = ring_positions.masked_fill(ring_positions < 0, FAR)
        return self._past["ring"]

    def native_decode(self, positions: Tensor):
        """The native form of this call's step (ced/native_decode.py) where it is a decode step of at most
        kernels.MAX_ROWS rows on float32 rings and the kernels are on; else None."""
        if (self.length != 1 or self.fresh or self.pool.dtype != torch.float32 or len(self.rows) > kernels.MAX_ROWS
                or not kernels.enabled()):
            return None
        if "native" not in self._past:
            self._past["native"] = NativeDecode(self, positions)
        return self._past["native"]

    def compress(self, layer: int, xn: Tensor, pool_blocks: PoolBlocks) -> None:
        pending, m = self.pool.pending[layer], self.m
        if xn.shape[1] == 1:  # a decode step: each row adds one input; rows whose block it completes pool it
            done = [b for b, start in enumerate(self.starts) if start % m == m - 1]
            pending[self.slots, torch.tensor(self.starts) % m] = xn[:, 0]
            if done:
                blocks = pending[self.slots[done]][:, None]  # (R, 1, m, C)
                first = torch.tensor([self.starts[b] // m for b in done])
                self._store_entries(layer, done, first, *pool_blocks(blocks, first))
            return
        for b, (row, start, end) in enumerate(zip(self.rows, self.starts, self.ends)):  # a chunk: rows one at a time
            held, real = start % m, xn[b, : end - start]
            inputs = torch.cat([pending[row.slot, :held], real]) if held else real
            n_blocks = inputs.shape[0] // m
            rest = inputs[n_blocks * m:]
            pending[row.slot, : rest.shape[0]] = rest
            if n_blocks:
                first = torch.tensor([start // m])
                entries = pool_blocks(inputs[: n_blocks * m].reshape(1, n_blocks, m, -1), first)
                self._store_entries(layer, [b], first, *entries)

    def _store_entries(self, layer: int, rows: list[int], first: Tensor, k: Tensor, v: Tensor, keys: Tensor):
        numbers = first[:, None] + torch.arange(k.shape[1])[None]  # (R, N')
        pages, offsets = self.pool.entry_places(self.table[rows], numbers)
        self.pool.gk[layer][pages, offsets] = k
        self.pool.gv[layer][pages, offsets] = v
        self.pool.gi[layer][pages, offsets] = keys

    def has_entries(self, source: int) -> bool:
        return max(self.ends) >= self.m

    def index_keys(self, source: int) -> Tensor:
        n = max(self.ends) // self.m
        keys = self.pool.gi[source][self.table]  # (B, pages, P, I)
        return keys.flatten(1, 2)[:, :n]

    def gather(self, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        pages, offsets = self.pool.entry_places(self.table, idx)
        k, v = self.pool.gk[source], self.pool.gv[source]  # (pages, P, H, D)
        H = k.shape[2]
        entries = pages * self.pool.page_entries + offsets  # (B, T, k) into the pages laid end to end
        heads = torch.arange(H, device=idx.device)[None, :, None, None]
        rows = (entries[:, None] * H + heads).reshape(-1)  # (B, H, T, k): each head's D values are one row
        shape = (idx.shape[0], H, *idx.shape[1:], k.shape[-1])  # (B, H, T, k, D), the order attention reads
        k_sel = k.view(-1, k.shape[-1]).index_select(0, rows).view(shape)
        v_sel = v.view(-1, v.shape[-1]).index_select(0, rows).view(shape)
        return k_sel.permute(0, 2, 3, 1, 4), v_sel.permute(0, 2, 3, 1, 4)  # (B, T, k, H, D) views


def selection_or_none(selection: Selection | None, rows: int, length: int, top_k: int) -> Selection:
    """Layer E's choice for the rings: all-invalid where no block has completed yet (as the serial engine keeps)."""
    if selection is not None:
        return selection
    return Selection(torch.zeros(rows, length, top_k, dtype=torch.long),
                     torch.zeros(rows, length, top_k, dtype=torch.bool))
