"""What the engine's pool holds between turns, owned in one place under one byte budget.

Two kinds of rows wait in the pool between turns:
- a conversation's state between its turns (`take` / `keep`, found by conversation id): the journal holds it too,
  so dropping one costs a read of the journal at the conversation's next turn;
- finished prefixes (`prefixes`, ced/prefix_cache.py, found by tokens): dropping one costs a prefill of its tokens
  at the next request that sends them.
They share pages (a conversation's prefix entry is a fork of its row, a stateless request's a fork of its prefix),
so their bytes are counted together, a shared page once, beside the rows of the turns now running, which are never
dropped. When all of them hold more than `byte_budget`, the least recently used row of either kind leaves first;
`max_idle` also bounds how many conversations wait (0: none, as a prefill server keeps). A budget of 0 caches no
prefixes and leaves the conversations bounded by `max_idle` alone.

The decode server's copies of received states (python_backend/core/delta_transfer.py, DecodeTransfers) are host
tensors outside the pool and keep their own limit.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Callable

from torch import Tensor

from ced.batched import BatchedEngine
from ced.paged import Resident
from ced.prefix_cache import CachedPrefix, PrefixCache


class Residency:
    def __init__(self, engine: BatchedEngine, byte_budget: int, max_idle: int,
                 live: Callable[[], list[Resident]] = list):
        """`live`: the rows of the turns now running (counted, never dropped)."""
        self.engine, self.byte_budget, self.max_idle, self.live = engine, byte_budget, max_idle, live
        self.clock = count().__next__
        self.prefixes = PrefixCache(engine, self.clock)
        self.idle: OrderedDict[str, tuple[Resident, object, int]] = OrderedDict()  # id -> (row, written, used)

    @property
    def caches_prefixes(self) -> bool:
        return self.byte_budget > 0

    # -- conversations between turns ------------------------------------------------------------------------------

    def take(self, conversation_id: str) -> tuple[Resident, object] | None:
        """The conversation's row and the journal identity it was kept with, now the caller's; None if not held."""
        held = self.idle.pop(conversation_id, None)
        return None if held is None else held[:2]

    def keep(self, conversation_id: str, row: Resident, written: object) -> None:
        """The conversation's row until its next turn; `written`: what the journal was when the row matched it."""
        self.idle.pop(conversation_id, None)
        self.idle[conversation_id] = (row, written, self.clock())
        self.fit()

    def drop(self, conversation_id: str) -> None:
        held = self.idle.pop(conversation_id, None)
        if held is not None:
            self.engine.close(held[0])

    def has(self, conversation_id: str) -> bool:
        return conversation_id in self.idle

    def row_of(self, conversation_id: str) -> Resident | None:
        held = self.idle.get(conversation_id)
        return None if held is None else held[0]

    # -- prefixes -------------------------------------------------------------------------------------------------

    def lookup(self, tokens: list[int], longest: int | None = None) -> CachedPrefix | None:
        return self.prefixes.lookup(tokens, longest)

    def keep_prefix(self, row: Resident, pooled: Tensor | None = None, logits: Tensor | None = None,
                    digest: str = "") -> None:
        """`row` into the prefix cache (now the cache's), or freed when prefixes are not cached."""
        if not self.caches_prefixes:
            self.engine.close(row)
            return
        self.prefixes.insert(row, pooled, logits, digest)
        self.fit()

    # -- the budget -----------------------------------------------------------------------------------------------

    def fit(self) -> None:
        """Drop the least recently used waiting rows until the pool's rows fit the budget and the idle count."""
        while len(self.idle) > self.max_idle:
            self._drop_oldest_idle()
        if not self.caches_prefixes:
            return
        while self.nbytes() > self.byte_budget and (self.idle or self.prefixes.entries):
            idle_used = next(iter(self.idle.values()))[2] if self.idle else None
            prefix_used = self.prefixes.oldest_use()
            if prefix_used is None or (idle_used is not None and idle_used < prefix_used):
                self._drop_oldest_idle()
            else:
                self.prefixes.drop_oldest()

    def _drop_oldest_idle(self) -> None:
        _, (row, _, _) = self.idle.popitem(last=False)
        self.engine.close(row)

    def nbytes(self) -> int:
        """What the pool's rows hold now, running and waiting (a row or page held twice counted once)."""
        rows = {id(row): row for row in (*self.live(), *(row for row, _, _ in self.idle.values()),
                                         *self.prefixes.rows())}
        return self.engine.unshared_nbytes(list(rows.values())) if rows else 0
