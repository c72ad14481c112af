"""The conversation journal: turns saved as deltas load back bit-for-bit, bytes per turn do not grow with context,
a kill mid-write or a damaged record brings the conversation back at its last good turn (the bad tail
quarantined), a journal with no good record is dropped, and compaction changes the file, never the state."""

import logging
import shutil

import pytest
import torch

from ced import CEDConfig
from ced.state import apply_delta, delta_of, empty_state
from python_backend.core.journal import JournalError, decode_record, encode_record, read_journal
from python_backend.core.store import ConversationReset, ConversationStore, StoreError
from python_backend.core.transfer import TransferError, decode_state, encode_state


@pytest.fixture()
def conversation(engine):
    state = engine.new_conversation()
    result = engine.turn(state, list(range(40)), "A1")
    list(engine.generate(state, "A1", result.logits, max_tokens=5))
    return engine, state


def next_turn(engine, state, tokens=(7, 8, 9), adapter="A1"):
    result = engine.turn(state, list(tokens), adapter)
    list(engine.generate(state, adapter, result.logits, max_tokens=5))


def copy(state, config):
    return decode_state(encode_state(state, config), config)


def assert_same_shared(a, b):
    """The journal keeps everything but the adapter-bound windows (replay rebuilds them); an empty pending block
    may come back as None."""
    def same(x, y):
        if x is None or y is None:
            assert (x is None or x.numel() == 0) and (y is None or y.numel() == 0)
        else:
            assert torch.equal(x, y)

    assert a.shared.tokens == b.shared.tokens
    for layer in a.shared.windows:
        same(a.shared.windows[layer].k, b.shared.windows[layer].k)
        same(a.shared.windows[layer].v, b.shared.windows[layer].v)
    for layer in a.shared.globals:
        ga, gb = a.shared.globals[layer], b.shared.globals[layer]
        for x, y in [(ga.k, gb.k), (ga.v, gb.v), (ga.index_keys, gb.index_keys), (ga.pending, gb.pending)]:
            same(x, y)
    same(a.shared.stream, b.shared.stream)
    same(a.shared.selection.idx, b.shared.selection.idx)
    same(a.shared.selection.valid, b.shared.selection.valid)


def assert_continues_alike(engine, live, loaded, adapter="A1"):
    logits_live, _ = engine.replay(live, adapter)
    logits_loaded, _ = engine.replay(loaded, adapter)
    assert torch.equal(logits_live, logits_loaded)
    assert list(engine.generate(live, adapter, logits_live, 6)) == list(engine.generate(loaded, adapter,
                                                                                       logits_loaded, 6))
    assert torch.equal(engine.turn(live, [3, 4], "L0").logits, engine.turn(loaded, [3, 4], "L0").logits)


def test_delta_round_trips(conversation):
    engine, state = conversation
    rebuilt = empty_state(engine.config)
    apply_delta(rebuilt, delta_of(state, 0))
    assert_same_shared(rebuilt, state)
    assert rebuilt.bound.adapter == "A1" and rebuilt.bound.length == 0 and rebuilt.bound.digest is None
    assert all(len(w) == 0 for w in rebuilt.bound.windows.values())

    earlier, since = copy(state, engine.config), state.length
    next_turn(engine, state, tokens=range(50, 63))  # 13 tokens: crosses block boundaries of the global KV
    delta = decode_record(encode_record(delta_of(state, since), engine.config), engine.config)
    assert delta.start_length == since and delta.tokens == state.shared.tokens[since:]
    apply_delta(earlier, delta)
    assert_same_shared(earlier, state)
    with pytest.raises(JournalError, match="starts at token"):
        apply_delta(earlier, delta)


def test_records_refuse_damage_foreign_configs_and_gaps(conversation):
    engine, state = conversation
    first = encode_record(delta_of(state, 0), engine.config)
    since = state.length
    next_turn(engine, state)
    second = encode_record(delta_of(state, since), engine.config)
    scan = read_journal(first + second, engine.config)
    assert len(scan.deltas) == 2 and scan.good == len(first + second) and scan.problem is None
    assert scan.digests == [first[-16:], second[-16:]] and scan.tail == len(first)

    for field_byte in (10, len(first) // 2, len(first) - 3):  # the length, the payload, the digest
        damaged = bytearray(first)
        damaged[field_byte] ^= 0x01
        scan = read_journal(bytes(damaged) + second, engine.config)
        assert scan.deltas == [] and scan.good == 0 and scan.problem is not None and not scan.torn
    assert "bad magic" in read_journal(first + b"XXXX" + second[4:], engine.config).problem
    torn = read_journal(first + second[:-1], engine.config)
    assert "truncated" in torn.problem and torn.torn  # a write cut off: only the turn being written is lost
    assert "starts at token" in read_journal(second, engine.config).problem  # a delta with no records before it
    assert "starts at token" in read_journal(first + first, engine.config).problem
    assert "another model config" in read_journal(first, CEDConfig.from_name("tiny", window=32)).problem
    longer = bytearray(first)
    longer[4:12] = (len(first) * 3).to_bytes(8, "little")  # a length field that announces more than there is
    scan = read_journal(bytes(longer) + second, engine.config)
    assert "truncated" in scan.problem and not scan.torn  # a good record follows: damage, not a cut-off write


def test_turns_saved_then_loaded_continue_bit_for_bit(conversation, tmp_path):
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    store.save("c1", state)
    before = (tmp_path / "c1.state").read_bytes()
    for tokens in ([5, 6], list(range(100, 117)), [9]):
        next_turn(engine, state, tokens)
        store.save("c1", state)
    assert (tmp_path / "c1.state").read_bytes().startswith(before)  # appended to, never rewritten
    assert len(read_journal((tmp_path / "c1.state").read_bytes(), engine.config).deltas) == 4
    assert store.length_of("c1") == ConversationStore(tmp_path, engine.config).length_of("c1") == state.length
    loaded = ConversationStore(tmp_path, engine.config).load("c1")  # another process: no cache
    assert_same_shared(loaded, state)
    assert_continues_alike(engine, state, loaded)


def test_processes_taking_turns_on_one_journal(conversation, tmp_path):
    """Each process's cache goes stale when another one appends: it reads the journal again, never appends
    after the wrong length."""
    engine, state = conversation
    prefill, decode = ConversationStore(tmp_path, engine.config), ConversationStore(tmp_path, engine.config)
    for turn in range(4):
        next_turn(engine, state, [turn + 1, 2, 3])
        (prefill if turn % 2 else decode).save("c1", state)
    assert read_journal((tmp_path / "c1.state").read_bytes(), engine.config).problem is None
    assert_same_shared(prefill.load("c1"), state)
    with pytest.raises(StoreError, match="starts at token 3, its journal holds"):
        decode.append("c1", delta_of(state, 3))


def test_bytes_per_turn_do_not_grow_with_context(engine, tmp_path):
    store, per_turn, snapshots = ConversationStore(tmp_path, engine.config), {}, {}
    for history in (100, 1500):
        state = engine.new_conversation()
        engine.prefill(state, [(7 * i) % 300 for i in range(history)])
        store.save(f"c{history}", state)
        snapshots[history] = store.last_write_bytes
        written = store.bytes_written
        next_turn(engine, state, list(range(20)))
        store.save(f"c{history}", state)
        per_turn[history] = store.last_write_bytes
        assert store.bytes_written == written + per_turn[history]
    assert per_turn[1500] < 2 * per_turn[100]
    assert snapshots[1500] > 5 * per_turn[1500]  # the whole state, as every turn used to write


def test_compaction_keeps_the_state_and_shrinks_the_file(conversation, tmp_path):
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    store.save("c1", state)
    for turn in range(6):
        next_turn(engine, state, [turn, 1])
        store.save("c1", state)
    size, before = store.journal_size("c1"), store.load("c1")
    store.compact("c1")
    assert store.journal_size("c1") < size / 2
    assert len(read_journal((tmp_path / "c1.state").read_bytes(), engine.config).deltas) == 1
    assert_same_shared(store.load("c1"), before)

    eager = ConversationStore(tmp_path, engine.config, compact_slack=0)  # compacts as soon as dead bytes pass live
    sizes = []
    for turn in range(8):
        next_turn(engine, state, [turn, 2])
        eager.save("c1", state)
        sizes.append(eager.journal_size("c1"))
        assert sizes[-1] <= 2 * state.shared.nbytes() + 4096  # bounded by the live state (plus headers)
    assert any(later < earlier for earlier, later in zip(sizes, sizes[1:]))  # it did compact
    assert_continues_alike(engine, state, ConversationStore(tmp_path, engine.config).load("c1"))


def test_a_shorter_state_replaces_the_journal(conversation, tmp_path, engine):
    _, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    store.save("c1", state)
    other = engine.new_conversation()
    next_turn(engine, other, [1, 2, 3])
    store.save("c1", other)  # another conversation under the same id, shorter than the stored one
    assert_same_shared(store.load("c1"), other)


def two_turns(engine, state, store):
    """Saves a second turn after the first; returns the state after the first and the journal's size then."""
    store.save("c1", state)
    first, size = copy(state, engine.config), store.journal_size("c1")
    next_turn(engine, state, list(range(60, 75)))
    store.save("c1", state)
    return first, size


def test_a_kill_mid_write_loads_the_previous_turn(conversation, tmp_path, caplog):
    engine, state = conversation
    first, size = two_turns(engine, state, ConversationStore(tmp_path, engine.config))
    path = tmp_path / "c1.state"
    data = path.read_bytes()
    path.write_bytes(data[: (size + len(data)) // 2])  # the second record cut in its middle
    restarted = ConversationStore(tmp_path, engine.config)
    with caplog.at_level(logging.ERROR):
        loaded = restarted.load("c1")
    assert_same_shared(loaded, first)
    assert path.read_bytes() == data[:size]
    tails = list((tmp_path / "quarantine").glob("c1.*.tail"))
    assert len(tails) == 1 and tails[0].read_bytes() == data[size: (size + len(data)) // 2]
    assert "c1" in caplog.text and "truncated" in caplog.text
    assert restarted.conversations() == ["c1"]
    next_turn(engine, loaded, [4, 5])  # the conversation goes on from there
    restarted.save("c1", loaded)
    assert_same_shared(ConversationStore(tmp_path, engine.config).load("c1"), loaded)


def test_a_damaged_last_record_is_refused_once_then_loads_the_previous_turn(conversation, tmp_path, caplog):
    """Damage to a complete record lost an answered turn: the load that finds it says what it found and what the
    conversation was reset to; the next one loads that turn."""
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    first, size = two_turns(engine, state, store)
    path = tmp_path / "c1.state"
    data = bytearray(path.read_bytes())
    data[(size + len(data)) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR), pytest.raises(ConversationReset) as reset:
        store.load("c1")  # load always reads the file itself
    (tail,) = (tmp_path / "quarantine").glob("c1.*.tail")
    assert "digest mismatch" in str(reset.value) and str(tail) in str(reset.value)
    assert f"reset to its last good turn ({first.length} tokens)" in str(reset.value)
    assert store.journal_size("c1") == size and "digest mismatch" in caplog.text
    assert_same_shared(store.load("c1"), first)


def test_a_half_written_record_is_left_alone_while_its_turn_runs(conversation, tmp_path):
    engine, state = conversation
    writer = ConversationStore(tmp_path, engine.config)
    first, size = two_turns(engine, state, writer)
    path = tmp_path / "c1.state"
    data = path.read_bytes()
    path.write_bytes(data[: size + 20])  # as a reader may see the file while the turn appends
    writer.begin_turn("c1")
    reader = ConversationStore(tmp_path, engine.config)
    assert_same_shared(reader.load("c1"), first)
    assert path.read_bytes() == data[: size + 20] and not (tmp_path / "quarantine").exists()
    writer.end_turn("c1")


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_damage_in_the_only_record_drops_the_conversation(conversation, tmp_path, damage):
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    store.save("c1", state)
    path = tmp_path / "c1.state"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-30] ^= 0xFF
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="damaged and has been dropped"):
        store.load("c1")
    assert not path.exists() and store.conversations() == []
    assert [p.read_bytes() for p in (tmp_path / "quarantine").iterdir()] == [bytes(data)]
    store.save("c1", state)  # the id can be used again
    assert_same_shared(store.load("c1"), state)


def test_every_header_field_is_under_the_digest(conversation, tmp_path, caplog):
    """A record whose header field is changed to another valid value (its adapter, its start length) is as damaged
    as a flipped tensor bit: set aside in quarantine/ (named in the log), never loaded; the conversation comes back
    at its last good turn, after one refusal that says so."""
    engine, state = conversation
    first = encode_record(delta_of(state, 0), engine.config)
    since = state.length
    next_turn(engine, state, adapter="A2")
    second = encode_record(delta_of(state, since), engine.config)
    for old, new in ((b'\\"A2\\"', b'\\"A3\\"'), (f'"start_length":"{since}"'.encode(),
                                                  f'"start_length":"{since - 1}"'.encode())):
        assert second.count(old) == 1
        damaged = second.replace(old, new)
        scan = read_journal(first + damaged, engine.config)
        assert len(scan.deltas) == 1 and scan.good == len(first) and "digest mismatch" in scan.problem

        path = tmp_path / "c1.state"
        path.write_bytes(first + damaged)
        shutil.rmtree(tmp_path / "quarantine", ignore_errors=True)
        caplog.clear()
        store = ConversationStore(tmp_path, engine.config)
        with caplog.at_level(logging.ERROR), pytest.raises(ConversationReset, match="digest mismatch"):
            store.load("c1")
        loaded = store.load("c1")
        assert loaded.length == since and loaded.bound.adapter == "A1"  # the first turn's, not the damaged one's
        (tail,) = (tmp_path / "quarantine").iterdir()
        assert tail.read_bytes() == damaged and str(tail) in caplog.text  # set aside whole, and named
        assert path.read_bytes() == first


def test_transfer_metadata_is_under_the_checksum(conversation):
    """The transfer between the pair's servers: a changed bound adapter or bound length is refused as damage."""
    engine, state = conversation
    data = encode_state(state, engine.config)
    length = str(state.bound.length)
    other_length = length[:-1] + str((int(length[-1]) + 1) % 10)  # as many digits: the header keeps its size
    for old, new in ((b'\\"A1\\"', b'\\"A2\\"'), (f'"bound_length":"{length}"'.encode(),
                                                  f'"bound_length":"{other_length}"'.encode())):
        assert data.count(old) == 1
        with pytest.raises(TransferError, match="damaged"):
            decode_state(data.replace(old, new), engine.config)
    with pytest.raises(TransferError, match="not a readable|do not hold"):
        decode_state(data[:40], engine.config)
