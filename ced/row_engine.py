"""The serving engine's verbs (BatchedEngine's) over an engine that runs one conversation per call and has
CEDEngine's interface: TensorRT's plans, the deepseek_v41 family's V41Engine and OrtV41Engine (the ced family on
ONNX Runtime has a batched engine of its own, ced/ort_batched.py). The
scheduler drives either kind, so a turn runs in one loop whatever runs the model: admission, the prefix cache,
streaming, cancellation, the journal.

A batch's rows run one after another, each its own call (prefill and replay always; decode steps too unless the
engine steps many conversations in one pass, as V41Engine.step_rows does): every active turn moves on each step,
where one turn at a time used to hold every other turn back until it ended.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import count
from typing import Any, Iterator

import torch
from torch import Tensor

from .engine import CEDEngine, check_tokens
from .families import family_of_config
from .state import ConversationState, StateDelta


@dataclass(eq=False)
class StateRow:
    """One resident conversation: its state objects and a number that orders a batch (the pool's slot)."""

    state: ConversationState
    slot: int
    storages: tuple | None = dataclasses.field(default=None, repr=False)  # (what they were read at, {address: bytes})

    @property
    def length(self) -> int:
        return self.state.length

    @property
    def tokens(self) -> list[int]:
        return self.state.shared.tokens

    @property
    def bound_adapter(self) -> str | None:
        return self.state.bound.adapter

    @property
    def bound_length(self) -> int:
        """The length the adapter-bound windows are current for; -1 when there are none (as PagePool's rows)."""
        bound = self.state.bound
        return bound.length if any(len(window) for window in bound.windows.values()) else -1


class RowEngine:
    """Over any engine with CEDEngine's interface, of any model family (its state verbs: ced.families). An engine
    with `step_rows(states, tokens, adapters)` (V41Engine) runs a step of several rows in one call."""

    def __init__(self, engine: CEDEngine):
        self.engine, self.model, self.config, self.adapters = engine, engine.model, engine.config, engine.adapters
        self.states = family_of_config(engine.config).state_verbs()
        self._slots = count()

    # -- conversations --------------------------------------------------------------------------------------------

    def open(self, state: ConversationState | None = None) -> StateRow:
        state = self.engine.new_conversation() if state is None else self.states.copy_state(state)
        return StateRow(state, next(self._slots))

    def close(self, row: StateRow) -> None:
        pass  # nothing pooled: the row's tensors go with the last reference to it

    def fork(self, row: StateRow, keep_bound: bool = False) -> StateRow:
        copy = self.open(row.state)
        if not keep_bound:
            copy.state.bound = self.engine.new_conversation().bound
        return copy

    # -- the verbs ------------------------------------------------------------------------------------------------

    def check(self, row: StateRow, tokens: list[int]) -> None:
        check_tokens(self.config, row.length, tokens)

    def prefill_rows(self, rows: list[StateRow], chunks: list[list[int]]) -> list[Tensor]:
        for row, chunk in zip(rows, chunks):  # every chunk checked before any row is touched
            self.check(row, chunk)
        return [self.engine.prefill(row.state, chunk) for row, chunk in zip(rows, chunks)]

    def replay(self, rows: list[StateRow], adapters: list[str | None]) -> tuple[Tensor, list[int]]:
        for adapter in adapters:
            self.adapters.slot_of(adapter)  # an unknown adapter fails before any row is touched
        done = [self.engine.replay(row.state, adapter) for row, adapter in zip(rows, adapters)]
        return torch.stack([logits for logits, _ in done]), [replayed for _, replayed in done]

    def step(self, rows: list[StateRow], tokens: list[int], adapters: list[str | None]) -> Tensor:
        step_rows = getattr(self.engine, "step_rows", None)  # one pass over the batch, where the engine has it
        if step_rows is not None and len(rows) > 1:
            return step_rows([row.state for row in rows], tokens, adapters)
        if len(rows) == 1:  # a view, not a copy
            return self.engine.step(rows[0].state, tokens[0], adapters[0])[None]
        return torch.stack([self.engine.step(row.state, token, adapter)
                            for row, token, adapter in zip(rows, tokens, adapters)])

    # -- state in and out -----------------------------------------------------------------------------------------

    def nbytes(self, row: StateRow) -> int:
        return sum(row.state.nbytes().values())

    def unshared_nbytes(self, rows: list[StateRow]) -> int:
        """Bytes these rows hold together, a tensor they share counted once (a fork shares its source's)."""
        seen: dict[int, int] = {}
        for row in rows:
            seen.update(self._storages(row))
        return sum(seen.values()) + sum(8 * row.length for row in rows)

    @staticmethod
    def _storages(row: StateRow) -> dict[int, int]:
        """The storages a row's tensors lie in, {address: bytes}, read again only once the row has changed: the
        budget counts every waiting row at each turn's end, and a V4.1 row has ~40 tensors (4 ms a count of the
        pool at 16 streams, a tenth of the serving loop)."""
        state = row.state
        read_at = (row.length, id(state.shared), id(state.bound), state.bound.length, state.bound.adapter)
        if row.storages is None or row.storages[0] != read_at:
            row.storages = (read_at, {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                                      for tensor in _tensors(state.shared, state.bound)})
        return row.storages[1]

    def delta(self, row: StateRow, since: int) -> StateDelta:
        return self.states.delta_of(row.state, since)

    def export(self, row: StateRow) -> ConversationState:
        return self.states.copy_state(row.state)


def _tensors(*parts: Any) -> Iterator[Tensor]:
    """Every tensor a state's parts hold (dataclasses, dicts and lists of them, objects that list their own with
    `tensors()`), whatever the family."""
    for part in parts:
        if isinstance(part, Tensor):
            yield part
        elif callable(getattr(part, "tensors", None)):  # what holds its tensors in tails (the deepseek_v41 family)
            yield from part.tensors()
        elif dataclasses.is_dataclass(part):
            yield from _tensors(*(getattr(part, f.name) for f in dataclasses.fields(part)))
        elif isinstance(part, dict):
            yield from _tensors(*part.values())
        elif isinstance(part, (list, tuple)) and part and not isinstance(part[0], int):
            yield from _tensors(*part)
