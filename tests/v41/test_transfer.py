"""A deepseek_v41 conversation through the transfer codec every family shares (python_backend/core/transfer.py,
delta_transfer.py): the full transfer rebuilds the state bitwise with its adapter-bound windows, and a delta on the
last turn's state rebuilds it bitwise, in bytes that do not grow with the history."""

from __future__ import annotations

import torch

from python_backend.core.delta_transfer import TO_DECODE, base_of, decode_delta, encode_delta, rebuild
from python_backend.core.transfer import decode_state, encode_state

from test_engine import assert_same_shared, engine, tokens, write_history  # noqa: F401 - `engine` is a fixture


def assert_same_bound(a, b) -> None:
    assert (a.bound.adapter, a.bound.length, a.bound.digest) == (b.bound.adapter, b.bound.length, b.bound.digest)
    for layer, window in a.bound.windows.items():
        other = b.bound.windows[layer].kv
        assert (window.kv is None) == (other is None) and (window.kv is None or torch.equal(window.kv, other))


def test_a_full_transfer_rebuilds_the_state_with_its_windows(engine):
    state = write_history(engine, tokens(1, 20), "all")
    received = decode_state(encode_state(state, engine.config), engine.config)
    assert_same_shared(received, state)
    assert_same_bound(received, state)
    step = engine.step(received, 7, "all")  # the windows came with it: no replay needed
    assert torch.equal(step, engine.step(state, 7, "all"))


def test_a_delta_transfer_rebuilds_the_state_bitwise_in_bytes_bounded_by_the_turn(engine):
    sizes = []
    for history in (16, 64, 160):
        base_state = write_history(engine, tokens(2, history), "experts")
        base = base_of(base_state, engine.config, version="v1")
        grown = write_history(engine, tokens(2, history), "experts")
        engine.prefill(grown, tokens(3, 7))  # the next user turn
        engine.replay(grown, "all")
        data = encode_delta(grown, base, engine.config, TO_DECODE)
        rebuilt = rebuild(base_state, decode_delta(data, engine.config, TO_DECODE), engine.config)
        assert_same_shared(rebuilt, grown)
        assert_same_bound(rebuilt, grown)
        sizes.append(len(data))
    assert len(set(sizes)) == 1, sizes  # the same turn on any history: the same bytes
    assert len(encode_state(grown, engine.config)) > 2 * sizes[-1]  # while the whole state grew
