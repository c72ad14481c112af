"""V41Engine.step_rows steps many conversations at once, in one native call (ced/deepseek_v41/native.py) or, where
the kernels are off, in one pass of the torch model (ced/deepseek_v41/batch.py): each row's logits and state equal
its own serial torch `step`'s within float tolerance (RTOL = 1e-5 of the largest logit), with the same top-k and
pool choices, whatever rows, lengths and adapters share the batch; bad rows are refused before any row is touched;
RowEngine uses it."""

from __future__ import annotations

import dataclasses

import contextlib

import pytest
import torch

from ced import kernels
from ced.adapters import UnknownAdapterError
from ced.deepseek_v41.engine import V41Engine
from ced.deepseek_v41.model import DeepseekV41ForCausalLM
from ced.deepseek_v41.native import TAILS_NEED_ROOM
from ced.deepseek_v41.state import copy_state
from ced.engine import StateError
from ced.row_engine import RowEngine

from test_engine import shared_tensors

RTOL = 1e-5  # of the row's largest |logit|: a batched matmul may sum in another order than one row's
ADAPTERS = {"all": lambda n: True, "experts": lambda n: ".experts." in n, "attn": lambda n: ".attn." in n}


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(config, tmp_path, random_adapter) -> V41Engine:
    engine = V41Engine(DeepseekV41ForCausalLM.from_config(config, seed=0), max_adapters=4, max_rank=8)
    for seed, (name, include) in enumerate(ADAPTERS.items()):
        rank = 4 + 2 * (seed % 2)  # ranks differ: each adapter's block is padded to the widest
        engine.adapters.load(name, random_adapter(tmp_path / name, engine.adapter_set.modules, include,
                                                  rank=rank, seed=seed + 1))
    return engine


@pytest.fixture
def engine(tmp_path, tiny_v41, random_adapter) -> V41Engine:
    """v41-tiny (W=8, an encoder source of ratio 2) with three adapters: every module, routed experts only, and
    attention only (so a row's adapter may leave a module alone while its neighbour's adapts it)."""
    return make_engine(tiny_v41, tmp_path, random_adapter)


def open_rows(engine: V41Engine, lengths: list[int], adapters: list[str | None]) -> list:
    states = []
    for i, (n, adapter) in enumerate(zip(lengths, adapters)):
        state = engine.new_conversation()
        engine.prefill(state, tokens(i, n))
        engine.replay(state, adapter)
        states.append(state)
    return states


def state_tensors(state) -> dict:
    """Every tensor a conversation holds, by name (None where a part is empty): the shared ones and its windows."""
    return shared_tensors(state) | {f"bound.{i}": w.kv for i, w in state.bound.windows.items()}


def assert_close_states(ours, reference, bound: bool = True, rtol: float = RTOL) -> None:
    """Every tensor of the state close (within `rtol` of its largest value; the choices equal); `bound`: the
    adapter-bound windows too."""
    assert ours.shared.tokens == reference.shared.tokens
    if bound:
        assert (ours.bound.adapter, ours.bound.length) == (reference.bound.adapter, reference.bound.length)
    keep = lambda parts: {k: v for k, v in parts.items() if bound or not k.startswith("bound.")}  # noqa: E731
    mine, theirs = keep(state_tensors(ours)), keep(state_tensors(reference))
    assert mine.keys() == theirs.keys()
    for name, expected in theirs.items():
        got = mine[name]
        assert (got is None) == (expected is None), name
        if expected is None:
            continue
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        if expected.dtype.is_floating_point and expected.numel():
            torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * expected.abs().max().item(), msg=name)
        else:  # entry and block numbers, their validity: the same choices
            assert torch.equal(got, expected), name


def assert_close_logits(batched, serial) -> None:
    for row, (ours, theirs) in enumerate(zip(batched, serial)):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= RTOL * scale, f"row {row}"


def torch_path():
    return kernels.turned_off()


def run_both(engine, states, adapters, n_steps, seed=100, native=True):
    """n_steps of step_rows on `states` (native, or torch's batched pass) and of serial torch steps on copies;
    asserts logits and states agree."""
    serial = [copy_state(state) for state in states]
    for t in range(n_steps):
        next_tokens = tokens(seed + t, len(states))
        with contextlib.nullcontext() if native else torch_path():
            batched_logits = engine.step_rows(states, next_tokens, adapters)
        with torch_path():
            serial_logits = torch.stack([engine.step(s, tok, a) for s, tok, a in zip(serial, next_tokens, adapters)])
        assert batched_logits.shape == serial_logits.shape
        assert_close_logits(batched_logits, serial_logits)
    for ours, theirs in zip(states, serial):
        assert_close_states(ours, theirs)
    return serial


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_rows_of_every_length_and_adapter_match_serial_steps(engine, native):
    """Lengths below, at and past the window (8) and the candidate pool, odd and even (a pending ratio-2 group or
    not), each under its own adapter or none: 12 steps in one batch give each row its serial logits and state."""
    lengths = [1, 2, 5, 8, 9, 17, 30, 31]
    adapters = [None, "all", "experts", "attn", "all", None, "attn", "experts"]
    run_both(engine, open_rows(engine, lengths, adapters), adapters, n_steps=12, native=native)


@pytest.mark.parametrize("adapter", [None, "all"])
def test_a_batch_of_one_adapter_matches_serial_steps(engine, adapter):
    """Every row under the same adapter (the mask is skipped) or none (no LoRA computed at all)."""
    adapters = [adapter] * 4
    run_both(engine, open_rows(engine, [3, 12, 20, 7], adapters), adapters, n_steps=6)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_rows_before_their_first_global_entry(tmp_path, tiny_v41, random_adapter, native):
    """Encoder source at ratio 4: in one batch a row whose store has no entry yet (no global attention, no
    top-k) beside rows that have some, until it gets its first."""
    config = dataclasses.replace(tiny_v41, compress_ratios=(0, 4, 4, 4, 1, 1, 1, 1))
    engine = make_engine(config, tmp_path, random_adapter)
    adapters = ["all", None, "experts"]
    run_both(engine, open_rows(engine, [1, 2, 14], adapters), adapters, n_steps=5, native=native)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_row_without_adapter_is_unaffected_by_its_neighbours(engine, native):
    """Row 0 runs the base model; its neighbours' adapters (every module, or none) do not move its logits: the
    native step gives it the same bits as the row stepped alone, the torch pass the same within float tolerance."""
    same = torch.equal if native else (lambda a, b: assert_close_logits([a], [b]) is None)
    outs = []
    for neighbours in (["all", "experts", "attn"], [None, None, None]):
        adapters = [None, *neighbours]
        states = open_rows(engine, [11, 6, 19, 4], adapters)
        alone = copy_state(states[0])
        with contextlib.nullcontext() if native else torch_path():
            batched = engine.step_rows(states, [42, 7, 8, 9], adapters)[0]
            assert same(batched, engine.step(alone, 42, None))
        outs.append(batched)
    assert same(outs[0], outs[1])


def test_bad_rows_are_refused_before_any_row_is_touched(engine):
    adapters = ["all", "experts"]
    states = open_rows(engine, [5, 9], adapters)
    before = [copy_state(state) for state in states]
    with pytest.raises(StateError, match="replay first"):  # row 1's windows are "experts"'
        engine.step_rows(states, [1, 2], ["all", "all"])
    with pytest.raises(UnknownAdapterError):
        engine.step_rows(states, [1, 2], ["all", "nope"])
    with pytest.raises(ValueError, match="out of range"):  # a token outside the vocabulary
        engine.step_rows(states, [1, 10_000], adapters)
    with pytest.raises(StateError, match="twice"):
        engine.step_rows([states[0], states[0]], [1, 2], ["all", "all"])
    for state, copy in zip(states, before):
        assert_close_states(state, copy)
        assert state.bound.length == state.length
    run_both(engine, states, adapters, n_steps=2)  # and the rows still step


def count_steps(monkeypatch, calls: list) -> None:
    """Appends 1 to `calls` for each native call that steps rows (one that only asked for room in a full tail, then
    did nothing, does not count)."""
    library, step = kernels.library(), kernels.library().v41_step_tails

    def counted(*args):
        code = step(*args)
        if code != TAILS_NEED_ROOM:
            calls.append(1)
        return code

    monkeypatch.setattr(library, "v41_step_tails", counted)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_row_engine_steps_the_batch_in_one_pass(engine, native, monkeypatch):
    """The scheduler's RowEngine drives V41Engine: a step of 3 rows is one native call (no torch layer runs) or,
    with the kernels off, one pass of the model (its first layer's attention runs once), with the serial logits."""
    calls = []
    if native:
        count_steps(monkeypatch, calls)
    rows_engine = RowEngine(engine)
    adapters = ["all", None, "attn"]
    rows = [rows_engine.open() for _ in adapters]
    for i, (row, adapter) in enumerate(zip(rows, adapters)):
        rows_engine.prefill_rows([row], [tokens(i, 4 + 3 * i)])
        rows_engine.replay([row], [adapter])
    serial = [copy_state(row.state) for row in rows]
    passes = []
    hook = engine.model.layers[0].attn.register_forward_hook(lambda *args: passes.append(1))
    try:
        with contextlib.nullcontext() if native else torch_path():
            logits = rows_engine.step(rows, [5, 6, 7], adapters)
    finally:
        hook.remove()
    assert (len(calls), len(passes)) == ((1, 0) if native else (0, 1))
    with torch_path():
        assert_close_logits(logits, [engine.step(s, tok, a) for s, tok, a in zip(serial, [5, 6, 7], adapters)])


def test_the_native_step_follows_adapter_changes(engine, tmp_path, random_adapter):
    """The native step's packed LoRA is rebuilt when the registry changes: after `all` is replaced by other
    weights and `attn` unloaded, replayed rows step with what the registry now holds (as torch's step does)."""
    adapters = ["all", "experts"]
    states = open_rows(engine, [9, 14], adapters)
    before = engine.step_rows([copy_state(state) for state in states], [1, 2], adapters)
    engine.adapters.replace("all", random_adapter(tmp_path / "new", engine.adapter_set.modules, lambda n: True,
                                                  rank=4, seed=9))
    engine.adapters.unload("attn")
    for state, adapter in zip(states, adapters):
        engine.replay(state, adapter)
    after = engine.step_rows([copy_state(state) for state in states], [1, 2], adapters)
    assert (after[0] - before[0]).abs().max() > 1e-3  # the new weights answer
    run_both(engine, states, adapters, n_steps=3)


def test_the_native_steps_wide_paths_match_serial_steps(tmp_path, tiny_v41, random_adapter):
    """Heads of 64 dims and four indexer heads (the demo's shapes): the kernel's paths that take four heads and 64
    dims at a time give each row its serial torch logits and state, as v41-tiny's narrower heads do through the
    plain ones."""
    config = dataclasses.replace(tiny_v41, head_dim=64, index_n_heads=4)
    engine = make_engine(config, tmp_path, random_adapter)
    adapters = [None, "all", "experts", "attn"]
    run_both(engine, open_rows(engine, [1, 6, 9, 23], adapters), adapters, n_steps=8)


def test_native_steps_write_only_their_own_state(engine):
    """The native step writes into each row's tails in place: a deep copy or a copy_state of a conversation steps
    on its own (into its own room), with the logits the original then gets for the same tokens, and leaves the
    original's tensors as they were."""
    import copy

    original = open_rows(engine, [9], ["all"])[0]
    before = {name: None if t is None else t.clone() for name, t in state_tensors(original).items()}
    twins = [copy.deepcopy(original), copy_state(original)]
    runs = [[engine.step(twin, token, "all") for token in (3, 4, 5)] for twin in twins]
    for name, tensor in state_tensors(original).items():
        assert (tensor is None and before[name] is None) or torch.equal(tensor, before[name]), name
    expected = [engine.step(original, token, "all") for token in (3, 4, 5)]
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run, expected, strict=True))


def test_a_step_of_many_rows_is_one_native_call(engine, monkeypatch):
    """40 rows (more than the ced family's kernel takes) are still one call, each row as its serial torch step."""
    calls = []
    count_steps(monkeypatch, calls)
    adapters = [[None, "all", "experts", "attn"][b % 4] for b in range(40)]
    run_both(engine, open_rows(engine, [1 + b % 13 for b in range(40)], adapters), adapters, n_steps=2)
    assert len(calls) == 2
