"""The serving engine: CEDEngine's verbs over many resident conversations at once.

Conversations live in a `PagePool` (ced/paged.py). `prefill` runs one chunk of a turn through the adapter-free
stage; `replay` rebuilds the adapter-bound windows of several rows in one call; `step` appends one token to every
row of a batch, each row under its own adapter. The arithmetic is the model's own (`shared_stage`,
`decoder_stage`), run over a `PagedCache`; a row run alone gives the serial engine's (CEDEngine) logits bit for
bit, and in a batch within float tolerance (tests/test_batched.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import Tensor

from . import kernels
from .cpu_share import FreeCpus
from .engine import CEDEngine, SamplingParams, StateError, check_tokens, sample
from .model import SharedOutput
from .paged import PagedCache, PagePool, Resident, selection_or_none
from .state import ConversationState, LocalWindow, Selection, StateDelta, apply_delta


# Chunk work (prefill, replay) of at least this many positions runs on `chunk_threads`. Below it a second thread
# cost more than it saved in the server (its time to the first token at one stream of 25-token turns rose from
# 9 to 12 ms with every chunk on 2 threads), above it the work is large enough to split: in-process a 128-position
# replay at 8K took 12.7 ms on one thread, 9.6 on two.
CHUNK_THREADS_MIN_POSITIONS = 128


class BatchedEngine:
    """`chunk_threads`: the most threads of a large prefill or replay call, and of a decode step's larger products
    in the native kernels (ced/kernels: a second thread claims parts of each weight as it comes free), each taking as
    many as other processes leave CPUs free (ced/cpu_share.py); None: the caller's torch setting for chunks, one
    thread for the kernels. A decode step without the kernels runs on the caller's setting (its small operations
    lose more to waking a second thread than they gain).
    `capacity_bytes`: the pool's room before it must grow (PagePool)."""

    def __init__(self, engine: CEDEngine, page_entries: int = 64, chunk_threads: int | None = None,
                 capacity_bytes: int = 0):
        self.engine, self.model, self.config = engine, engine.model, engine.config
        self.chunk_threads = chunk_threads
        self.free_cpus = FreeCpus()
        self.adapters = engine.adapters
        self.pool = PagePool(self.config, next(self.model.parameters()).dtype, page_entries,
                             capacity_bytes=capacity_bytes)
        self.bound_layers = frozenset(self.config.adapter_bound_layers)

    # -- conversations in the pool ----------------------------------------------------------------------------

    @torch.inference_mode()  # the pool's buffers may have been (re)allocated under inference mode: write them so
    def open(self, state: ConversationState | None = None) -> Resident:
        """A resident conversation: empty, or the copy of `state` (a conversation read back from disk)."""
        row = self.pool.open()
        if state is not None and state.length:
            self._import(row, state)
        return row

    def close(self, row: Resident) -> None:
        self.pool.release(row)

    @torch.inference_mode()
    def fork(self, row: Resident, keep_bound: bool = False) -> Resident:
        """A second conversation with `row`'s whole state (the common pages shared). Its adapter-bound windows are
        copied too, but count as current only with `keep_bound` (else its next turn replays, as every turn does)."""
        copy = self.pool.fork(row)
        if keep_bound:
            copy.bound_adapter, copy.bound_length = row.bound_adapter, row.bound_length
        else:
            copy.bound_adapter, copy.bound_length = None, -1
        return copy

    # -- the verbs ----------------------------------------------------------------------------------------------

    def prefill(self, row: Resident, tokens: list[int]) -> Tensor:
        """One chunk of new tokens through the adapter-free stage; returns their H19 (n, C)."""
        return self.prefill_rows([row], [tokens])[0]

    @torch.inference_mode()
    def prefill_rows(self, rows: list[Resident], chunks: list[list[int]]) -> list[Tensor]:
        """A chunk of new tokens for each row, of any lengths, through the adapter-free stage in one call (shorter
        chunks padded; what the padding computes is never written and never read by a real position); returns
        each row's H19 (n, C). Every chunk is checked before any row is touched."""
        chunks = [self._checked(row, tokens) for row, tokens in zip(rows, chunks)]
        lengths, starts = [len(chunk) for chunk in chunks], [row.length for row in rows]
        T = max(lengths)
        for row, start, n in zip(rows, starts, lengths):
            self.pool.reserve(row, start + n)
        ragged = None if min(lengths) == T else lengths
        ids = torch.tensor([chunk + [0] * (T - len(chunk)) for chunk in chunks])
        out = self._run_shared(rows, starts, ids, ragged)
        self._keep_stream(rows, starts, out, ragged)
        for row, chunk in zip(rows, chunks):
            row.tokens.extend(chunk)
            row.bound_length = -1  # the history grew without the decoder: the next turn replays
        self.engine.stats.prefilled_positions += sum(lengths)
        return [out.h19[b, :n] for b, n in enumerate(lengths)]

    @torch.inference_mode()
    def replay(self, rows: list[Resident], adapters: list[str | None]) -> tuple[Tensor, list[int]]:
        """Rebuild each row's adapter-bound windows over its last W positions under its adapter: next-token
        logits (R, V) and the positions replayed per row. Rows of equal window length share one call."""
        for row, adapter in zip(rows, adapters):
            if row.length == 0:
                raise StateError("nothing to replay: the conversation is empty")
            self.adapters.slot_of(adapter)  # an unknown adapter fails before any row is touched
        counts = [min(self.config.window, row.length) for row in rows]
        logits: list[Tensor | None] = [None] * len(rows)
        for n in sorted(set(counts)):
            group = [i for i, count in enumerate(counts) if count == n]
            members, starts = [rows[i] for i in group], [rows[i].length - n for i in group]
            slots, positions = torch.tensor([row.slot for row in members]), _positions(starts, n)
            stream = self.pool.read_ring(self.pool.stream, slots, positions)  # (R, n, C)
            selection = Selection(self.pool.read_ring(self.pool.sel_idx, slots, positions),
                                  self.pool.read_ring(self.pool.sel_valid, slots, positions))
            out = self._run_replay(members, starts, stream, selection, [adapters[i] for i in group])
            for j, i in enumerate(group):
                logits[i] = out[j]
                rows[i].bound_adapter, rows[i].bound_length = adapters[i], rows[i].length
        self.engine.stats.replayed_positions += sum(counts)
        return torch.stack(logits), counts

    @torch.inference_mode()
    def step(self, rows: list[Resident], tokens: list[int], adapters: list[str | None]) -> Tensor:
        """Append one token to every row (both stages), each under the adapter whose windows are current:
        next-token logits (B, V)."""
        for row, token, adapter in zip(rows, tokens, adapters):
            self._checked(row, [token])
            if row.bound_length != row.length or row.bound_adapter != adapter:
                raise StateError(f"the adapter-bound windows are for {row.bound_adapter!r} at length "
                                 f"{row.bound_length}, not {adapter!r} at {row.length}: replay first")
        self.pool.settle(rows)
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)  # slot order: the rings are one slice
        rows, tokens, adapters = [rows[i] for i in order], [tokens[i] for i in order], [adapters[i] for i in order]
        starts = [row.length for row in rows]
        for row in rows:
            self.pool.reserve(row, row.length + 1)
        logits = self._run_step(rows, starts, tokens, adapters)
        for row, token in zip(rows, tokens):
            row.tokens.append(token)
            row.bound_length += 1
        self.engine.stats.decoded_tokens += len(rows)
        if order == sorted(order):
            return logits
        return logits[torch.tensor(order).argsort()]  # back in the caller's order

    def generate(self, row: Resident, adapter: str | None, logits: Tensor, max_tokens: int,
                 sampling: SamplingParams | None = None, stop_tokens: Iterable[int] = ()) -> Iterator[int]:
        """One row alone, as CEDEngine.generate: sample, append, repeat; each yielded token is in the state."""
        sampling = sampling or SamplingParams()
        stop, generated = set(stop_tokens) | set(sampling.stop_token_ids), []
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        for _ in range(max_tokens):
            if row.length >= self.config.max_context:
                return
            token = sample(logits, sampling, generator, row.tokens, generated, stop)
            generated.append(token)
            logits = self.step([row], [token], [adapter])[0]
            yield token
            if token in stop:
                return

    # -- state in and out -------------------------------------------------------------------------------------

    def nbytes(self, row: Resident) -> int:
        return self.pool.nbytes(row)

    def unshared_nbytes(self, rows: list[Resident]) -> int:
        return self.pool.unshared_nbytes(rows)

    def delta(self, row: Resident, since: int) -> StateDelta:
        """What the conversation gained since it held `since` tokens (0: all of it), for the journal: the new
        tokens and global entries, and the W-bounded shared parts whole (named as ced.state.delta_of names them).
        O(new tokens + W)."""
        m, n_from, n_to = self.config.block_size, since // self.config.block_size, row.length // self.config.block_size
        appended, replaced = {}, {}
        if n_to > n_from:
            pages, offsets = self.pool.entry_places(self.pool.page_table([row]), torch.arange(n_from, n_to)[None])
            for s in self.config.source_layers:
                for name, buffer in (("k", self.pool.gk[s]), ("v", self.pool.gv[s]), ("index_keys", self.pool.gi[s])):
                    appended[f"entries.{s}.{name}"] = buffer[pages, offsets]
        held = row.length % m
        if held:
            for s in self.config.source_layers:
                replaced[f"pending.{s}"] = self.pool.pending[s][row.slot: row.slot + 1, :held].clone()
        count, slots = min(self.config.window, row.length), torch.tensor([row.slot])
        positions = _positions([row.length - count], count)
        for layer in range(self.config.decoder_start + 1):
            replaced[f"window.{layer}.k"] = self.pool.read_window(self.pool.wk[layer], slots, positions)
            replaced[f"window.{layer}.v"] = self.pool.read_window(self.pool.wv[layer], slots, positions)
        replaced["stream"] = self.pool.read_ring(self.pool.stream, slots, positions)
        replaced["selection.idx"] = self.pool.read_ring(self.pool.sel_idx, slots, positions)
        replaced["selection.valid"] = self.pool.read_ring(self.pool.sel_valid, slots, positions)
        return StateDelta(since, row.tokens[since:], appended, replaced, row.bound_adapter)

    def export(self, row: Resident) -> ConversationState:
        """The whole conversation as the serial engine's state (tests, transfer to another server)."""
        state = self.engine.new_conversation()
        apply_delta(state, self.delta(row, 0))
        if row.bound_length == row.length:
            slots = torch.tensor([row.slot])
            positions = _positions([row.length - min(self.config.window, row.length)],
                                   min(self.config.window, row.length))
            for layer in self.config.adapter_bound_layers:
                state.bound.windows[layer] = LocalWindow(
                    self.config.window, self.pool.read_window(self.pool.wk[layer], slots, positions),
                    self.pool.read_window(self.pool.wv[layer], slots, positions))
            state.bound.length, state.bound.digest = row.length, self.adapters.digest(row.bound_adapter)
        return state

    def _import(self, row: Resident, state: ConversationState) -> None:
        shared, length = state.shared, state.length
        self.pool.reserve(row, length)
        slots, table = torch.tensor([row.slot]), self.pool.page_table([row])
        for s, store in shared.globals.items():
            if store.n_entries:
                pages, offsets = self.pool.entry_places(table, torch.arange(store.n_entries)[None])
                self.pool.gk[s][pages, offsets], self.pool.gv[s][pages, offsets] = store.k, store.v
                self.pool.gi[s][pages, offsets] = store.index_keys
            if store.pending is not None and store.pending.shape[1]:
                self.pool.pending[s][row.slot, : store.pending.shape[1]] = store.pending[0]
        count = shared.stream.shape[1]
        start = [length - count]
        for layer, window in shared.windows.items():
            self.pool.write_window(self.pool.wk[layer], slots, start, window.k)
            self.pool.write_window(self.pool.wv[layer], slots, start, window.v)
        self.pool.write_ring(self.pool.stream, slots, start, shared.stream)
        self.pool.write_ring(self.pool.sel_idx, slots, start, shared.selection.idx)
        self.pool.write_ring(self.pool.sel_valid, slots, start, shared.selection.valid)
        row.tokens = list(shared.tokens)
        bound = state.bound
        if bound.length == length and all(len(w) for w in bound.windows.values()):
            for layer, window in bound.windows.items():
                self.pool.write_window(self.pool.wk[layer], slots, [length - len(window)], window.k)
                self.pool.write_window(self.pool.wv[layer], slots, [length - len(window)], window.v)
            row.bound_adapter, row.bound_length = bound.adapter, length

    # -- the model's calls over the pool: another runtime (ced/ort_batched.py) overrides only these --------------

    def _run_shared(self, rows: list[Resident], starts: list[int], ids: Tensor,
                    lengths: list[int] | None) -> SharedOutput:
        """The adapter-free stage over chunks ids (B, T) at `starts` (`lengths`: each row's real length, if
        ragged), its windows, entries and open blocks written into the pool."""
        cache = PagedCache(self.pool, rows, starts, ids.shape[1], lengths=lengths)
        with self.engine._rows([None] * len(rows)), self._threads(sum(lengths or [ids.shape[1]] * len(rows))):
            return self.model.shared_stage(ids, _positions(starts, ids.shape[1]), cache)

    def _run_replay(self, rows: list[Resident], starts: list[int], stream: Tensor, selection: Selection,
                    adapters: list[str | None]) -> Tensor:
        """The decoder over kept streams (R, n, C) from `starts`, rebuilding the adapter-bound windows in the pool:
        the last position's logits (R, V)."""
        n = stream.shape[1]
        cache = PagedCache(self.pool, rows, starts, n, fresh=self.bound_layers)
        with self.engine._rows(adapters), self._threads(n * len(rows)):
            hidden = self.model.decoder_stage(stream, _positions(starts, n), selection, cache, last_only=True)
            return self.model.lm_head(hidden[:, -1])

    def _run_step(self, rows: list[Resident], starts: list[int], tokens: list[int],
                  adapters: list[str | None]) -> Tensor:
        """Both stages for one token of each row (settled, in slot order, pages reserved), everything it adds
        written into the pool: logits (B, V)."""
        cache, positions = PagedCache(self.pool, rows, starts, 1), _positions(starts, 1)
        with self.engine._rows(adapters), kernels.step_threads(self.free_cpus, self.chunk_threads or 1):
            native = cache.native_decode(positions)
            logits = native.step(self.model, tokens) if native is not None else None  # one call (ced/kernels)
            if logits is None:
                out = self.model.shared_stage(torch.tensor(tokens)[:, None], positions, cache)
                self._keep_stream(rows, starts, out)
                hidden = self.model.decoder_stage(out.stream, positions, out.selection, cache)
                logits = self.model.lm_head(hidden[:, -1])
        return logits

    # -- helpers ------------------------------------------------------------------------------------------------

    @contextmanager
    def _threads(self, positions: int):
        """Large chunk work on up to `chunk_threads` (as many as are free of other processes), then back to the
        caller's setting."""
        before = torch.get_num_threads()
        if self.chunk_threads in (None, before) or positions < CHUNK_THREADS_MIN_POSITIONS:
            yield
            return
        threads = self.free_cpus.threads(self.chunk_threads)
        if threads == before:
            yield
            return
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @contextmanager
    def check(self, row: Resident, tokens: list[int]) -> None:
        """Raises what prefill would (ids outside the vocabulary, past the context limit), touching nothing."""
        self._checked(row, tokens)

    def _checked(self, row: Resident, tokens: list[int]) -> list[int]:
        return check_tokens(self.config, row.length, tokens)

    def _keep_stream(self, rows: list[Resident], starts: list[int], out: SharedOutput,
                     lengths: list[int] | None = None) -> None:
        """Layer E's post-attention stream and top-k choice of the new positions, into the replay rings."""
        slots, (B, T, _) = torch.tensor([row.slot for row in rows]), out.stream.shape
        selection = selection_or_none(out.selection, B, T, self.config.index_top_k)
        # An invalid place may name an entry of another row (the batch's index keys are padded to the longest
        # row): kept as 0, an entry every row can look up when read alone (it gets no weight either way).
        chosen = selection.idx.masked_fill(~selection.valid, 0)
        self.pool.write_ring(self.pool.stream, slots, starts, out.stream, lengths)
        self.pool.write_ring(self.pool.sel_idx, slots, starts, chosen, lengths)
        self.pool.write_ring(self.pool.sel_valid, slots, starts, selection.valid, lengths)


def _positions(starts: list[int], length: int) -> Tensor:
    return torch.tensor(starts)[:, None] + torch.arange(length)[None]  # (B, T)
