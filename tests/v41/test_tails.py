"""`Tail` (ced/deepseek_v41/state.py), the appendable tensors a native step writes in place: a view it handed out
is never written afterwards, and `drop` (a store's pending inputs once their group completes) empties it without a
new buffer."""

from __future__ import annotations

import copy
import pickle

import torch

from ced.deepseek_v41.state import Tail


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values).view(1, -1, 1)


def test_a_dropped_tail_is_empty_and_keeps_its_buffer():
    tail = Tail()
    tail.append(rows(1.0, 2.0))
    buffer = tail.place(rows(0.0))
    tail.drop()
    assert len(tail) == 0 and tail.value.shape == (1, 0, 1)
    tail.append(rows(3.0))
    assert torch.equal(tail.value, rows(3.0))
    assert tail.place(rows(0.0)) - buffer == 2 * 4  # the same buffer, past the two positions dropped


def test_no_view_handed_out_is_written_after_a_drop():
    tail = Tail()
    tail.append(rows(1.0, 2.0))
    held = tail.value  # a copy of the state shares this view
    tail.drop()
    for value in (5.0, 6.0, 7.0):
        tail.append(rows(value))
    assert torch.equal(held, rows(1.0, 2.0))
    assert torch.equal(tail.value, rows(5.0, 6.0, 7.0))


def test_a_copied_tail_never_writes_into_the_original_buffer():
    """A deep copy takes its own buffer's address; a pickled or shallow copy holds none, so its first write moves it
    to a buffer of its own. A native step writes where `meta` points, so a copy must not point at the original."""
    tail = Tail()
    tail.append(rows(1.0, 2.0))
    original = tail.place(rows(0.0), at_end=True)
    for twin in (copy.deepcopy(tail), copy.copy(tail), pickle.loads(pickle.dumps(tail))):
        assert torch.equal(twin.value, rows(1.0, 2.0))
        assert twin.place(rows(0.0), at_end=True) != original
        twin.append(rows(9.0))
        assert torch.equal(tail.value, rows(1.0, 2.0)) and torch.equal(twin.value, rows(1.0, 2.0, 9.0))
