"""The pool's rows between turns (idle conversations, cached prefixes) under one owner and one byte budget."""

from __future__ import annotations

import torch

from ced.batched import BatchedEngine
from python_backend.core.residency import Residency


def row_of(engine: BatchedEngine, length: int, seed: int):
    row = engine.open()
    engine.prefill(row, torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist())
    return row


def test_the_least_recently_used_row_of_either_kind_leaves_first(engine):
    batched = BatchedEngine(engine)
    one = batched.pool.nbytes(row_of(batched, 20, 99))  # the bytes of one short conversation
    residency = Residency(batched, byte_budget=3 * one, max_idle=8)
    residency.keep("a", row_of(batched, 20, 1), "written-a")
    residency.keep_prefix(row_of(batched, 20, 2))
    residency.keep("b", row_of(batched, 20, 3), "written-b")
    assert residency.nbytes() == 3 * one and residency.has("a") and len(residency.prefixes) == 1
    residency.keep_prefix(row_of(batched, 20, 4))  # over budget: "a" was used longest ago
    assert not residency.has("a") and residency.has("b") and len(residency.prefixes) == 2
    assert residency.take("b")[1] == "written-b" and not residency.has("b")  # taken: the caller's now
    residency.keep("c", row_of(batched, 20, 5), "written-c")
    assert residency.nbytes() <= 3 * one


def test_running_rows_count_and_are_never_dropped(engine):
    batched = BatchedEngine(engine)
    running = [row_of(batched, 20, seed) for seed in range(3)]
    one = batched.pool.nbytes(running[0])
    residency = Residency(batched, byte_budget=3 * one, max_idle=8, live=lambda: running)
    residency.keep("a", row_of(batched, 20, 9), "written")
    assert not residency.has("a") and residency.nbytes() == 3 * one  # the running rows fill the budget


def test_a_fork_and_its_conversation_share_pages_counted_once(engine):
    batched = BatchedEngine(engine)
    row = row_of(batched, 300, 1)  # several pages of global entries
    alone = batched.pool.nbytes(row)
    residency = Residency(batched, byte_budget=1 << 30, max_idle=8)
    residency.keep("a", row, "written")
    residency.keep_prefix(batched.fork(row))
    assert residency.nbytes() < 2 * alone


def test_without_a_budget_no_prefix_is_kept_and_conversations_are_bounded_by_count(engine):
    batched = BatchedEngine(engine)
    residency = Residency(batched, byte_budget=0, max_idle=2)
    residency.keep_prefix(row_of(batched, 20, 1))
    assert len(residency.prefixes) == 0 and not residency.caches_prefixes
    for cid in "abc":
        residency.keep(cid, row_of(batched, 20, ord(cid)), "written")
    assert not residency.has("a") and residency.has("b") and residency.has("c")
    residency.drop("b")
    assert not residency.has("b")
