"""A deepseek_v41 prefill chunk and a replay in one native call each (V41Plan.prefill / .replay over v41.cpp's
`v41_run`): a chunk's tokens are the rows of one call, each at its own position in the same tails. The state a
chunk writes is bitwise what its tokens one at a time write, however the prompt is cut; against torch's path (the
kernels off) H19, the logits and every state tensor agree within float tolerance and the choices are the same,
through pending groups, first entries, windows overrun within a chunk and adapters on every module."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ced import kernels
from ced.deepseek_v41.state import copy_state

from test_batched_step import assert_close_logits, assert_close_states, make_engine, run_both, tokens
from test_engine import shared_tensors

pytestmark = pytest.mark.skipif(not kernels.available(torch.float32), reason="no C++ compiler: no native kernels")


@pytest.fixture
def engine(tmp_path, tiny_v41, random_adapter):
    """v41-tiny (W=8) with its encoder source at ratio 4: groups pend across chunk boundaries and a conversation's
    first positions have no global entry yet."""
    return make_engine(dataclasses.replace(tiny_v41, compress_ratios=(0, 4, 4, 4, 1, 1, 1, 1)), tmp_path,
                       random_adapter)


def prefill_in(engine, cuts: list[int], prompt: list[int]):
    state, h19, at = engine.new_conversation(), [], 0
    for cut in cuts:
        h19.append(engine.prefill(state, prompt[at: at + cut]))
        at += cut
    assert at == len(prompt)
    return state, torch.cat(h19)


def test_a_chunk_writes_bitwise_what_its_tokens_one_at_a_time_write(engine):
    prompt = tokens(0, 23)
    whole, h19 = prefill_in(engine, [23], prompt)
    for cuts in ([1] * 23, [5, 7, 11], [3, 1, 19]):
        state, other_h19 = prefill_in(engine, cuts, prompt)
        assert torch.equal(h19, other_h19), cuts
        ours, theirs = shared_tensors(whole), shared_tensors(state)
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            assert (tensor is None) == (theirs[name] is None), (cuts, name)
            assert tensor is None or torch.equal(tensor, theirs[name]), (cuts, name)


def test_the_kernel_runs_once_per_chunk_and_once_per_replay(engine, monkeypatch):
    calls = []
    library, run = kernels.library(), kernels.library().v41_run
    monkeypatch.setattr(library, "v41_run", lambda *args: calls.append(args[3]) or run(*args))
    engine.prefill_chunk = 5
    state = engine.new_conversation()
    engine.prefill(state, tokens(1, 17))
    engine.replay(state, "all")
    assert calls == [0, 0, 0, 0, 2 * engine.config.decoder_start + 1]  # four chunks from the embedding, one replay


@pytest.mark.parametrize("history", [0, 3, 13])
@pytest.mark.parametrize("length", [1, 3, 8, 21])
def test_prefill_and_replay_agree_with_torchs_path(engine, history, length):
    """A turn of `length` tokens after `history` (prefilled and replayed under "attn") under each adapter or none,
    then steps: H19, the replay's logits and every state tensor within float tolerance of torch's path."""
    for adapter in (None, "all", "experts"):
        native = engine.new_conversation()
        if history:
            engine.prefill(native, tokens(2, history))
            engine.replay(native, "attn")
        reference = copy_state(native)
        prompt = tokens(3, length)
        h19, (logits, replayed) = engine.prefill(native, prompt), engine.replay(native, adapter)
        with kernels.turned_off():
            theirs_h19, (theirs, theirs_replayed) = engine.prefill(reference, prompt), engine.replay(reference, adapter)
        assert replayed == theirs_replayed == min(engine.config.sliding_window, history + length)
        assert_close_logits(h19, theirs_h19)
        assert_close_logits([logits], [theirs])
        assert_close_states(native, reference)
        run_both(engine, [native], [adapter], n_steps=3)  # and the steps after it, against torch's


def test_no_store_tensor_appears_before_its_first_entry(engine):
    """A prefill that completes no group leaves a store as torch's path leaves it: no entries, not an empty tensor
    (torch's batched pass reads "no entries" from None)."""
    state = engine.new_conversation()
    engine.prefill(state, tokens(4, 2))
    assert state.shared.stores[1].latent is None and state.shared.stores[1].pending.shape[1] == 2


def test_a_call_from_a_site_whose_inputs_it_does_not_read_is_refused(engine):
    """Only the embedding (a step, a prefill chunk) or layer E's tails (a replay) start a call; nothing is run."""
    import ctypes

    from ced.deepseek_v41.native import RowPlaces

    rows = RowPlaces(1, engine.config.num_hidden_layers).rows(1)
    code = kernels.library().v41_run(ctypes.byref(rows), ctypes.byref(engine.native.model_struct()), None, 1, 2,
                                     None, None, 1)
    assert code == -2
    with pytest.raises(RuntimeError, match="site 0"):
        kernels.check(code)
