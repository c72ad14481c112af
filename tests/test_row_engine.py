"""The batched engine's verbs over an engine that takes one conversation per call (ced/row_engine.py): a row gives
the serial engine's logits bit for bit, and a fork is a conversation of its own."""

from __future__ import annotations

import torch

from ced.row_engine import RowEngine
from ced.state import delta_of


def test_rows_in_a_batch_are_each_the_serial_engine(engine):
    rows_engine = RowEngine(engine)
    histories = {"A1": list(range(1, 40)), None: list(range(50, 70)), "L0": list(range(5, 140))}
    rows = {adapter: rows_engine.open() for adapter in histories}
    h19 = rows_engine.prefill_rows(list(rows.values()), list(histories.values()))
    logits, counts = rows_engine.replay(list(rows.values()), list(rows))
    assert counts == [min(engine.config.window, len(h)) for h in histories.values()]
    steps = [rows_engine.step(list(rows.values()), [7, 8, 9], list(rows))]
    for (adapter, tokens), h, first, step in zip(histories.items(), h19, logits, steps[0]):
        state = engine.new_conversation()
        assert torch.equal(engine.prefill(state, tokens), h)
        assert torch.equal(engine.replay(state, adapter)[0], first)
        token = [7, 8, 9][list(histories).index(adapter)]
        assert torch.equal(engine.step(state, token, adapter), step)


def test_a_fork_is_a_conversation_of_its_own(engine):
    rows_engine = RowEngine(engine)
    row = rows_engine.open()
    rows_engine.prefill_rows([row], [list(range(1, 30))])
    rows_engine.replay([row], ["A1"])
    fork = rows_engine.fork(row, keep_bound=True)
    # shared until one of them grows (a grown store is a new tensor): counted once, as the prefix cache needs
    assert rows_engine.unshared_nbytes([row, fork]) == rows_engine.unshared_nbytes([row]) + 8 * fork.length
    before = delta_of(fork.state, 0)
    rows_engine.step([row], [5], ["A1"])  # the original goes on...
    rows_engine.prefill_rows([row], [[6, 7, 8]])
    after = delta_of(fork.state, 0)  # ...and the fork is as it was
    assert fork.length == 29 and after.tokens == before.tokens
    assert before.replaced.keys() == after.replaced.keys() and before.appended.keys() == after.appended.keys()
    assert all(torch.equal(before.replaced[name], after.replaced[name]) for name in before.replaced)
    assert all(torch.equal(before.appended[name], after.appended[name]) for name in before.appended)
    assert fork.bound_adapter == "A1" and fork.bound_length == fork.length  # its windows kept: no replay needed
    assert rows_engine.fork(row).bound_length == -1  # without keep_bound, the next turn replays
