"""A prefix cache shared across adapters: stored states found by their tokens, whichever adapter served them.

The adapter-free part of a state (global KV, the adapter-free windows, the replay stream) is the same whatever
adapter the decoder ran under, and every turn replays W positions under its own adapter anyway. So, unlike the
peers' caches (keyed per adapter), one stored prefix serves every adapter: a request takes the longest stored
prefix of its tokens, prefills only the rest, then replays W under the adapter it asked for.

Entries are conversations held in the engine's pool (ced/paged.py) and never written again: a request forks one
(its rings copied, its full pages shared, the last partial page copied), so branches of one history share the
pages of their common prefix. Keys are (length, hash chain over blocks of tokens): a lookup hashes the request's
tokens once and probes each length the cache holds, longest first; the tokens are compared before a hit counts.
The cache keeps no budget of its own: its owner (the server's python_backend/core/residency.py) drops its least
recently used entries when the pool's rows together are over budget; each entry says when it was last used
(`used`, on the owner's `clock`).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from itertools import count
from typing import Callable

import numpy as np
from torch import Tensor

from .batched import BatchedEngine
from .paged import Resident

HASH_BLOCK = 64  # tokens per link of the hash chain


@dataclass
class CachedPrefix:
    row: Resident
    pooled: Tensor | None  # the router's pooled H19 of the prefix's last turn, for a request that is all cache
    logits: Tensor | None = None  # next-token logits under the adapter whose windows the row holds (if current)
    digest: str = ""  # that adapter's digest
    used: int = 0  # when it was last inserted or found, on the cache's clock


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted: int = 0
    evicted: int = 0


class PrefixCache:
    def __init__(self, engine: BatchedEngine, clock: Callable[[], int] | None = None):
        self.engine, self.clock = engine, clock or count().__next__
        self.entries: OrderedDict[tuple[int, bytes], CachedPrefix] = OrderedDict()  # least recently used first
        self.lengths: Counter[int] = Counter()  # how many entries hold each length
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self.entries)

    def rows(self) -> list[Resident]:
        return [entry.row for entry in self.entries.values()]

    def lookup(self, tokens: list[int], longest: int | None = None) -> CachedPrefix | None:
        """The entry holding the longest stored prefix of `tokens` (at most `longest` of them), or None."""
        longest = len(tokens) if longest is None else min(longest, len(tokens))
        self.stats.queried_tokens += len(tokens)
        chain = _chain(tokens, longest // HASH_BLOCK)
        for length in sorted((n for n in self.lengths if n <= longest), reverse=True):
            key = _key(chain, tokens, length)
            entry = self.entries.get(key)
            if entry is not None and entry.row.tokens == tokens[:length]:
                self.entries.move_to_end(key)
                entry.used = self.clock()
                self.stats.hit_tokens += length
                return entry
        return None

    def insert(self, row: Resident, pooled: Tensor | None = None, logits: Tensor | None = None,
               digest: str = "") -> None:
        """Keep `row` (the cache owns it from now on: nobody writes it again) unless its tokens are held already.
        With `logits`: the row's adapter-bound windows are current (for the adapter of `digest`), and these are
        the next-token logits they gave, so a request for the same prompt and adapter needs no replay."""
        key = _key(_chain(row.tokens, row.length // HASH_BLOCK), row.tokens, row.length)
        if key in self.entries or row.length == 0:
            if key in self.entries:
                self.entries.move_to_end(key)
                self.entries[key].used = self.clock()
            self.engine.close(row)
            return
        self.entries[key] = CachedPrefix(row, pooled, logits, digest, self.clock())
        self.lengths[row.length] += 1
        self.stats.inserted += 1

    def oldest_use(self) -> int | None:
        """When the least recently used entry was last used (None: the cache is empty)."""
        return next(iter(self.entries.values())).used if self.entries else None

    def drop_oldest(self) -> None:
        (length, _), entry = self.entries.popitem(last=False)
        self.lengths[length] -= 1
        if not self.lengths[length]:
            del self.lengths[length]
        self.stats.evicted += 1
        self.engine.close(entry.row)


def _chain(tokens: list[int], blocks: int) -> list[bytes]:
    """chain[i]: the hash of the first i blocks of HASH_BLOCK tokens."""
    chain, digest = [b""], b""
    ids = np.asarray(tokens[: blocks * HASH_BLOCK], dtype=np.int64)
    for i in range(blocks):
        digest = hashlib.blake2b(digest + ids[i * HASH_BLOCK:(i + 1) * HASH_BLOCK].tobytes(), digest_size=16).digest()
        chain.append(digest)
    return chain


def _key(chain: list[bytes], tokens: list[int], length: int) -> tuple[int, bytes]:
    blocks = length // HASH_BLOCK
    tail = np.asarray(tokens[blocks * HASH_BLOCK: length], dtype=np.int64).tobytes()
    return length, hashlib.blake2b(chain[blocks] + tail, digest_size=16).digest()
