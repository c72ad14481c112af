"""The batched engine over the paged pool: a row's prefill and replay are the serial engine's bit for bit; in a mixed batch (ragged
histories, each row under its own adapter) greedy tokens are the serial ones and logits agree to float tolerance;
source independence stays bitwise; rows joining and leaving do not change the others' tokens."""

from __future__ import annotations

import pytest
import torch

from ced import CEDEngine, kernels
from ced.batched import BatchedEngine
from ced.native_decode import NativeDecode
from ced.paged import PagePool

LOGIT_TOLERANCE = 1e-4  # float32: measured up to ~6e-6 on the tiny preset (batch matmuls block differently)


def make_engines(adapter_dirs, tiny_model):
    engines = []
    for _ in range(2):
        engine = CEDEngine(tiny_model(), max_adapters=4, max_rank=8)
        for name in ("A1", "L0"):
            engine.adapters.load(name, adapter_dirs[name])
        engines.append(engine)
    return engines[0], BatchedEngine(engines[1], page_entries=4)


def history(length: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def serial_run(engine: CEDEngine, tokens: list[int], adapter, steps: int):
    state = engine.new_conversation()
    for start in range(0, len(tokens), 256):
        engine.prefill(state, tokens[start: start + 256])
    logits, _ = engine.replay(state, adapter)
    out, ids = [logits], []
    for _ in range(steps):
        ids.append(int(logits.argmax()))
        logits = engine.step(state, ids[-1], adapter)
        out.append(logits)
    return ids, out


def prefilled(batched: BatchedEngine, tokens: list[int]):
    row = batched.open()
    for start in range(0, len(tokens), 256):
        batched.prefill(row, tokens[start: start + 256])
    return row


ROWS = [(5, "A1"), (37, None), (300, "L0"), (130, "A1"), (16, "L0")]


@pytest.fixture()
def engines(adapter_dirs, tiny_model):
    return make_engines(adapter_dirs, tiny_model)


def test_a_row_alone_is_the_serial_engine(engines):
    """Prefill and replay are the serial engine's bit for bit; a decode step attends over the window ring in place
    (another summation order), so its logits agree to float tolerance."""
    serial, batched = engines
    tokens = history(300, 3)
    ids, expected = serial_run(serial, tokens, "L0", 12)
    row = prefilled(batched, tokens)
    logits, _ = batched.replay([row], ["L0"])
    got = [logits[0]]
    for token in ids:
        got.append(batched.step([row], [token], ["L0"])[0])
    assert torch.equal(expected[0], got[0])
    assert max(float((a - b).abs().max()) for a, b in zip(expected, got)) < LOGIT_TOLERANCE


def test_a_mixed_batch_gives_each_rows_serial_tokens(engines):
    serial, batched = engines
    expected = [serial_run(serial, history(n, i), adapter, 20) for i, (n, adapter) in enumerate(ROWS)]
    rows = [prefilled(batched, history(n, i)) for i, (n, _) in enumerate(ROWS)]
    adapters = [adapter for _, adapter in ROWS]
    logits, replayed = batched.replay(rows, adapters)
    assert replayed == [min(16, n) for n, _ in ROWS]
    got, ids = [[logits[i]] for i in range(len(rows))], [[] for _ in rows]
    for _ in range(20):
        tokens = logits.argmax(-1).tolist()
        for i, token in enumerate(tokens):
            ids[i].append(token)
        logits = batched.step(rows, tokens, adapters)
        for i in range(len(rows)):
            got[i].append(logits[i])
    for i, (serial_ids, serial_logits) in enumerate(expected):
        assert ids[i] == serial_ids, i
        worst = max(float((a - b).abs().max()) for a, b in zip(serial_logits, got[i]))
        assert worst < LOGIT_TOLERANCE, (i, worst)


def test_source_independence_is_bitwise_in_a_fixed_batch(engines):
    """Row 0's history decoded under one adapter or the other: replayed under a target, its logits are the same
    bits (the batch beside it unchanged)."""
    _, batched = engines
    results = []
    for source in ("A1", "L0"):
        rows = [prefilled(batched, history(40, 7)), prefilled(batched, history(90, 8))]
        batched.replay(rows, [source, None])
        for token in (21, 22, 23, 24, 25, 26):  # the same tokens join the history under `source`
            batched.step(rows, [token, token], [source, None])
        for row in rows:
            batched.prefill(row, [11, 12, 13])
        results.append(batched.replay(rows, ["L0", None])[0])
        for row in rows:
            batched.close(row)
    assert torch.equal(results[0], results[1])


def test_rows_joining_and_leaving_do_not_change_the_others(engines):
    _, batched = engines

    def run(join_and_leave: bool) -> dict[int, list[int]]:
        rows = {i: prefilled(batched, history(n, i)) for i, (n, _) in enumerate(ROWS[:3])}
        adapters = {i: ROWS[i][1] for i in rows}
        logits, _ = batched.replay(list(rows.values()), list(adapters.values()))
        nxt = dict(zip(rows, logits.argmax(-1).tolist()))
        ids = {i: [] for i in rows}
        for step in range(16):
            if join_and_leave and step == 4:  # a row joins: its replay runs beside the batch
                rows[9] = prefilled(batched, history(50, 9))
                adapters[9] = "L0"
                nxt[9] = int(batched.replay([rows[9]], ["L0"])[0][0].argmax())
                ids[9] = []
            if join_and_leave and step == 9:  # and row 1 leaves
                batched.close(rows.pop(1))
                nxt.pop(1)
            order = list(rows)
            logits = batched.step([rows[i] for i in order], [nxt[i] for i in order], [adapters[i] for i in order])
            for i, row_logits in zip(order, logits):
                ids[i].append(nxt[i])
                nxt[i] = int(row_logits.argmax())
        for row in rows.values():
            batched.close(row)
        return ids

    alone, busy = run(False), run(True)
    assert busy[0] == alone[0] and busy[2] == alone[2]
    assert busy[1] == alone[1][:9]


def test_export_continues_in_the_serial_engine(engines):
    serial, batched = engines
    tokens = history(70, 5)
    ids, expected = serial_run(serial, tokens, "A1", 8)
    row = prefilled(batched, tokens)
    logits, _ = batched.replay([row], ["A1"])
    for token in ids[:4]:
        batched.step([row], [token], ["A1"])
    state = batched.export(row)  # mid-decode: bound windows current, so the serial engine steps on directly
    got = [serial.step(state, token, "A1") for token in ids[4:]]
    assert max(float((a - b).abs().max()) for a, b in zip(expected[5:], got)) < LOGIT_TOLERANCE
    reopened = batched.open(state)  # and back into the pool
    assert batched.step([reopened], [ids[-1]], ["A1"]).shape[0] == 1


def test_the_pool_grows_and_reuses_pages(engines):
    _, batched = engines
    pages_before = batched.pool.n_pages
    rows = [prefilled(batched, history(600, i)) for i in range(6)]  # 600 tokens = 150 entries = 38 pages each
    assert batched.pool.n_pages > pages_before and batched.pool.n_slots >= 6
    for row in rows:
        batched.close(row)
    free = len(batched.pool.free_pages)
    again = prefilled(batched, history(600, 0))
    assert len(batched.pool.free_pages) == free - len(again.pages)


def test_a_decode_batch_settles_into_the_first_slots_and_moves_no_state(engines, monkeypatch):
    """A step moves its rows into slots 0..B-1 (their rings then read in place): its logits and the states it
    leaves are bitwise those of the same step on unmoved copies (the rings copied out instead), and a bystander
    moved out of the way keeps its state."""
    _, batched = engines
    fillers = [prefilled(batched, history(9, 20 + i)) for i in range(4)]  # slots 0..3
    rows = [prefilled(batched, history(n, i)) for i, (n, _) in enumerate(ROWS[:3])]  # slots 4..6
    adapters = [adapter for _, adapter in ROWS[:3]]
    batched.close(fillers[1])  # a hole at slot 1; slots 0, 2 and 3 stay held by conversations outside the batch
    bystanders = [fillers[0], fillers[2], fillers[3]]
    logits, _ = batched.replay(rows, adapters)
    tokens = logits.argmax(-1).tolist()
    before = [batched.export(row) for row in bystanders]
    copies = [batched.fork(row, keep_bound=True) for row in rows]
    with monkeypatch.context() as patch:  # the copies stay where they are: their step copies the rings out
        patch.setattr(batched.pool, "settle", lambda conversations: None)
        expected = batched.step(copies, tokens, adapters)
    assert sorted(row.slot for row in copies) != [0, 1, 2]
    assert batched.step(rows, tokens, adapters).equal(expected)
    assert sorted(row.slot for row in rows) == [0, 1, 2]
    for row, copy in zip(rows, copies):
        assert_same_state(batched.export(row), batched.export(copy))
    for row, state in zip(bystanders, before):
        assert_same_state(batched.export(row), state)
    everyone = rows + bystanders + copies
    assert batched.pool.holders == {row.slot: row for row in everyone} and len(batched.pool.holders) == len(everyone)
    assert set(batched.pool.free_slots).isdisjoint(batched.pool.holders)


def assert_same_state(a, b) -> None:
    def same(x, y) -> bool:
        return (x is None and y is None) or x.equal(y)

    assert a.shared.tokens == b.shared.tokens and a.bound.adapter == b.bound.adapter
    assert same(a.shared.stream, b.shared.stream) and same(a.shared.selection.idx, b.shared.selection.idx)
    for own, other in ((a.shared.windows, b.shared.windows), (a.bound.windows, b.bound.windows)):
        for layer, window in own.items():
            assert same(window.k, other[layer].k) and same(window.v, other[layer].v)
    for s, store in a.shared.globals.items():
        other = b.shared.globals[s]
        assert same(store.k, other.k) and same(store.v, other.v) and same(store.pending, other.pending)


def test_chunks_of_different_lengths_prefill_together_as_each_alone(engines):
    """One padded call for chunks of several lengths (a row's history from empty, mid-block, past W, and more than W
    new tokens) leaves each row the state a call of its own leaves, to float tolerance, and the same top-k choice;
    greedy tokens after the replay are the same."""
    _, batched = engines
    W = batched.config.window
    cases = [(0, 5), (37, 3), (300, 2 * W + 7), (130, 16), (3, W + 1)]  # (history, new tokens)
    alone, together = [], []
    for i, (past, _) in enumerate(cases):
        alone.append(prefilled(batched, history(past, i)) if past else batched.open())
        together.append(prefilled(batched, history(past, i)) if past else batched.open())
    chunks = [history(n, 50 + i) for i, (_, n) in enumerate(cases)]
    expected = [batched.prefill(row, chunk) for row, chunk in zip(alone, chunks)]
    got = batched.prefill_rows(together, chunks)
    for a, b, row_a, row_b in zip(expected, got, alone, together):
        assert a.shape == b.shape and float((a - b).abs().max()) < LOGIT_TOLERANCE
        state_a, state_b = batched.export(row_a), batched.export(row_b)
        assert state_a.shared.tokens == state_b.shared.tokens
        chosen_a, chosen_b = state_a.shared.selection, state_b.shared.selection  # an invalid place's index is noise
        assert chosen_a.valid.equal(chosen_b.valid)
        assert chosen_a.idx.masked_fill(~chosen_a.valid, 0).equal(chosen_b.idx.masked_fill(~chosen_b.valid, 0))
        for layer, window in state_a.shared.windows.items():
            assert float((window.k - state_b.shared.windows[layer].k).abs().max()) < LOGIT_TOLERANCE
        for s, store in state_a.shared.globals.items():
            other = state_b.shared.globals[s]
            for mine, theirs in ((store.k, other.k), (store.v, other.v), (store.pending, other.pending)):
                assert (mine is None) == (theirs is None)
                assert mine is None or float((mine - theirs).abs().max()) < LOGIT_TOLERANCE
    adapters = ["A1", None, "L0", "A1", "L0"]
    tokens_a = batched.replay(alone, adapters)[0].argmax(-1)
    assert batched.replay(together, adapters)[0].argmax(-1).equal(tokens_a)


def test_a_bad_chunk_in_a_batch_touches_no_row(engines):
    _, batched = engines
    rows = [prefilled(batched, history(20, i)) for i in range(2)]
    before = [batched.export(row) for row in rows]
    with pytest.raises(ValueError, match="out of range"):
        batched.prefill_rows(rows, [history(4, 7), [5, 10**6]])
    for row, state in zip(rows, before):
        assert_same_state(batched.export(row), state)


def test_a_short_row_stepped_beside_a_long_one_replays_alone(engines):
    """In a batch the index keys are padded to the longest row, so a short row's invalid top-k places can name
    entries it does not have; what its rings keep must still be readable by a call of its own (its next turn)."""
    serial, batched = engines
    short_tokens, long_tokens = history(9, 1), history(300, 2)  # fewer entries than top_k: some places invalid
    short, long = prefilled(batched, short_tokens), prefilled(batched, long_tokens)
    logits, _ = batched.replay([short, long], ["A1", "L0"])
    ids = []
    for _ in range(3):
        ids.append(logits.argmax(-1).tolist())
        logits = batched.step([short, long], ids[-1], ["A1", "L0"])
    got, _ = batched.replay([short], ["L0"])  # the short row alone: its page table holds its own pages only
    state = serial.new_conversation()
    serial.prefill(state, short_tokens + [row[0] for row in ids])
    expected, _ = serial.replay(state, "L0")
    assert float((got[0] - expected).abs().max()) < LOGIT_TOLERANCE


class FreeCpusReading:
    """FreeCpus's answer, fixed: how many CPUs other processes leave free."""

    def __init__(self, free: int):
        self.free = free

    def threads(self, most: int, shared_ok: float = 0.25) -> int:
        return max(1, min(most, self.free))


@pytest.mark.parametrize("free", [2, 1])
def test_large_chunk_work_runs_on_the_chunk_threads_that_are_free(adapter_dirs, tiny_model, monkeypatch, free):
    """Prefill and replay of at least CHUNK_THREADS_MIN_POSITIONS positions run on `chunk_threads`, or on as many
    as other processes leave free; smaller ones and decode steps on the caller's setting, restored after each call."""
    from ced import batched as batched_module

    _, batched = make_engines(adapter_dirs, tiny_model)
    batched.chunk_threads, batched.free_cpus = 2, FreeCpusReading(free)
    monkeypatch.setattr(batched_module, "CHUNK_THREADS_MIN_POSITIONS", 32)
    seen = []

    def recording(stage):
        run = getattr(batched.model, stage)

        def recorded(*args, **kwargs):
            seen.append((stage, torch.get_num_threads()))
            return run(*args, **kwargs)
        return recorded

    for stage in ("shared_stage", "decoder_stage"):
        monkeypatch.setattr(batched.model, stage, recording(stage))
    native_step = NativeDecode.step
    monkeypatch.setattr(NativeDecode, "step", lambda *args: seen.append(("step", torch.get_num_threads()))
                        or native_step(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        row = batched.open()
        batched.prefill(row, history(40, 1))  # large
        batched.prefill(row, history(5, 2))  # small
        logits, _ = batched.replay([row], ["A1"])  # W = 16 positions: small
        batched.step([row], [int(logits.argmax())], ["A1"])
        rows = [prefilled(batched, history(20, i)) for i in range(3)]
        batched.replay(rows, ["A1", "L0", None])  # 3 rows x 16 positions: large
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    step = [("step", 1)] if kernels.library() is not None else [("shared_stage", 1), ("decoder_stage", 1)]
    assert seen[:3 + len(step)] == [("shared_stage", free), ("shared_stage", 1), ("decoder_stage", 1), *step]
    assert seen[-1] == ("decoder_stage", free)


def test_a_pool_with_room_does_not_grow_and_never_reads_stale_or_uninitialised_memory(adapter_dirs, tiny_model):
    """A pool built with a capacity takes conversations without growing; its slots and pages are zeroed when handed
    out: with every buffer filled with NaN (and impossible entry numbers) first, a conversation's logits are those of
    a pool that never held anything."""
    serial, fresh = make_engines(adapter_dirs, tiny_model)
    _, dirty = make_engines(adapter_dirs, tiny_model)
    dirty.pool = PagePool(dirty.config, torch.float32, 4, capacity_bytes=64 * dirty.pool.slot_nbytes())
    slots, pages = dirty.pool.n_slots, dirty.pool.n_pages
    assert slots >= 64 and pages >= 64 * dirty.pool.slot_nbytes() // dirty.pool.page_nbytes()
    pool = dirty.pool
    for buffer in (*pool.wk.values(), *pool.wv.values(), *pool.pending.values(), pool.stream, *pool.gk.values(),
                   *pool.gv.values(), *pool.gi.values()):
        buffer.fill_(float("nan"))
    pool.sel_idx.fill_(10 ** 9)
    pool.sel_valid.fill_(True)
    for batched in (fresh, dirty):  # shorter than W (16): the rings' unwritten places are read (and masked)
        rows = [prefilled(batched, history(n, seed)) for n, seed in ((5, 3), (11, 4), (70, 6))]
        logits, _ = batched.replay(rows, ["A1", "L0", None])
        steps = [logits]
        for _ in range(4):
            steps.append(batched.step(rows, steps[-1].argmax(-1).tolist(), ["A1", "L0", None]))
        batched.close(rows[1])
        again = prefilled(batched, history(3, 5))  # a released slot: its last owner's rings are gone
        steps.append(batched.replay([again], [None])[0])
        batched.outputs = torch.cat(steps)
    assert torch.isfinite(dirty.outputs).all() and dirty.outputs.equal(fresh.outputs)
    assert (pool.n_slots, pool.n_pages) == (slots, pages)
