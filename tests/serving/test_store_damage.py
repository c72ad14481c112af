"""A journal damaged behind the engine's back (a byte flipped in place, the file replaced at equal size) is caught
before the next turn is appended behind it: while the conversation is resident its copy, which is what the engine
wrote, rewrites the journal and no answered turn is lost, even to a kill right after; a journal replaced by
another valid one is read back, never appended to with a stale copy; damage found with no copy to hand is refused
once, saying what was found and what the conversation was reset to. The scheduler in process, and the issue's
reproduction on the session's server (a kill -9 of its core after the damage)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from ced.batched import BatchedEngine
from ced.tokenization import ChatTokenizer
from python_backend.core.journal import read_journal
from python_backend.core.scheduler import Scheduler, Turn
from python_backend.core.routing import RouteDecision
from python_backend.core.store import ConversationReset, ConversationStore

from test_engine_core import engine_core_pid
from test_journal import assert_same_shared
from test_scheduler import make_engine
from turn_sink import ListSink
from test_triton import generate

TURNS = ["first turn", "second one", "third turn"]  # the twins below send texts of these lengths


class EngineProcess:
    """One engine process as the scheduler tests build it: a scheduler and its store on `root`. A second one on the
    same root is what a restart after `kill -9` finds: the journal alone, no resident copy."""

    def __init__(self, served_dir, root):
        self.engine = make_engine(served_dir)
        self.store = ConversationStore(root, self.engine.config)
        self.tokenizer = ChatTokenizer(served_dir / "model")
        self.scheduler = Scheduler(BatchedEngine(self.engine), self.store, self.tokenizer,
                                   lambda decision: decision.adapter, lambda: [], prefill_chunk=64, token_budget=80)

    def turn(self, cid: str, text: str, new: bool = False) -> ListSink:
        sink, decision = ListSink(), RouteDecision("chat", 0)
        self.scheduler.submit(Turn(cid, self.tokenizer.encode(text), lambda pooled: decision, sink, max_tokens=4,
                                   ignore_eos=True, explicit=True, new=new))
        self.scheduler.drain()
        return sink

    def answered(self, cid: str, text: str, new: bool = False) -> list[int]:
        sink = self.turn(cid, text, new)
        assert sink.done and sink.error is None, sink.error
        return sink.tokens

    def tokens(self, cid: str) -> list[int]:
        return row.tokens if (row := self.scheduler.residency.row_of(cid)) else None


@pytest.fixture()
def process(served_dir, tmp_path):
    return EngineProcess(served_dir, tmp_path)


def three_turns(process: EngineProcess, cid: str, texts=TURNS) -> None:
    for n, text in enumerate(texts):
        process.answered(cid, text, new=n == 0)


def record_starts(path) -> list[int]:
    """Where each record of a journal starts (its framing: 4 magic bytes, an 8-byte length, payload, 16-byte digest)."""
    starts, data, offset = [], path.read_bytes(), 0
    while offset < len(data):
        starts.append(offset)
        offset += 12 + int.from_bytes(data[offset + 4: offset + 12], "little") + 16
    return starts


def flip_in_place(path, record: int) -> None:
    """One byte of the record's payload flipped through a descriptor: same file, same size."""
    starts = record_starts(path) + [path.stat().st_size]
    middle = (starts[record] + starts[record + 1]) // 2
    with open(path, "r+b") as file:
        file.seek(middle)
        byte = file.read(1)
        file.seek(middle)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("record", [2, 1], ids=["last record", "an earlier record"])
def test_a_byte_flipped_in_place_is_caught_before_the_next_turn_and_no_answered_turn_is_lost(
        served_dir, tmp_path, process, record, caplog):
    three_turns(process, "c")
    twin = EngineProcess(served_dir, tmp_path / "twin")  # the same turns on a journal nobody damages
    three_turns(twin, "c")
    path = tmp_path / "c.state"
    size, inode = path.stat().st_size, path.stat().st_ino
    assert len(record_starts(path)) == 3
    time.sleep(0.02)  # damage lands a clock tick after the engine's write (on kernels with coarse file times, an
    #                   earlier record changed within the same tick as that write goes unseen until the next load)
    flip_in_place(path, record)
    assert (path.stat().st_size, path.stat().st_ino) == (size, inode)

    fourth = process.answered("c", "fourth turn")
    assert fourth == twin.answered("c", "fourth turn")
    expected = process.tokens("c")

    restarted = EngineProcess(served_dir, tmp_path)  # kill -9 of the core: only the journal is left
    assert restarted.store.load("c").shared.tokens == expected  # t1 to t4: t4 was not appended behind the damage
    assert restarted.answered("c", "fifth turn") == twin.answered("c", "fifth turn")
    (kept,) = (tmp_path / "quarantine").glob("c.*.journal")  # the damaged file, kept for a person
    assert "digest mismatch" in caplog.text and "no turn lost" in caplog.text and str(kept) in caplog.text


@pytest.mark.parametrize("how", ["renamed over", "copied in place"])
def test_a_journal_replaced_at_equal_size_is_read_back_not_overwritten(served_dir, tmp_path, process, how):
    """Another valid journal of the same size (another conversation with turns of the same lengths) put in place
    of this one is the conversation now: the next turn is computed on it, and appended to it."""
    three_turns(process, "a")
    three_turns(process, "b", texts=["other text", "more words", "and a 3rd."])
    a, b = tmp_path / "a.state", tmp_path / "b.state"
    assert a.stat().st_size == b.stat().st_size  # twins in shape: their records are the same sizes
    control = EngineProcess(served_dir, tmp_path / "control")  # the same turn on a copy of b: what a must now give
    shutil.copy(b, tmp_path / "control" / "b.state")
    expected = control.answered("b", "fourth turn")

    if how == "renamed over":
        shutil.copy(b, tmp_path / "replacement")
        os.replace(tmp_path / "replacement", a)
    else:
        a.write_bytes(b.read_bytes())  # same inode, same size
    answer = process.turn("a", "fourth turn")
    assert answer.error is None and answer.tokens == expected
    assert_same_shared(process.store.load("a"), control.store.load("b"))  # b's history and the turn on it, whole
    assert read_journal(a.read_bytes(), process.engine.config).problem is None


def test_damage_found_after_a_restart_is_refused_once_saying_what_was_lost(served_dir, tmp_path, process):
    """No copy to rewrite from (the core was killed before its next turn): the turns from the damaged record on are
    lost, and the first turn to find it is refused with what was found and the turn the conversation is back at;
    sent again, it continues from there."""
    three_turns(process, "c")
    first = EngineProcess(served_dir, tmp_path / "twin")
    first.answered("c", TURNS[0], new=True)
    flip_in_place(tmp_path / "c.state", 1)

    restarted = EngineProcess(served_dir, tmp_path)
    refused = restarted.turn("c", "fourth turn")
    assert isinstance(refused.error, ConversationReset), refused.error
    message = str(refused.error)
    assert "digest mismatch" in message and f"reset to its last good turn ({len(first.tokens('c'))} tokens)" in message
    (tail,) = (tmp_path / "quarantine").glob("c.*.tail")
    assert str(tail) in message and not refused.tokens
    assert restarted.answered("c", "fourth turn") == first.answered("c", "fourth turn")


def wait_for_a_new_core(server, killed: int, timeout_s: float = 120.0) -> None:
    """Until the stub has started a core in place of `killed` (a turn sent before that fails with 'core died')."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if engine_core_pid(server) != killed:
                return
        except (AssertionError, StopIteration):  # between the two: no core, or two
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no new engine core within {timeout_s:.0f} s")


def test_on_the_server_a_flipped_byte_costs_no_answered_turn_even_across_a_kill(server, served_dir):
    """Issue 31's reproduction: turns t1-t3, a byte flipped in place in record 3, t4 answered, kill -9 of the core;
    the next turn went on from t2. Now it goes on from t4, as its twin (the same turns, nothing damaged) does."""
    fields = dict(adapter="chat", max_tokens=4, ignore_eos=True)
    damaged = generate(server, text_input="t1", **fields)["conversation_id_out"]
    twin = generate(server, text_input="t1", **fields)["conversation_id_out"]
    for text in ("t2", "t3"):
        for cid in (damaged, twin):
            assert "error" not in generate(server, text_input=text, conversation_id=cid, **fields)
    path = served_dir / "conversations" / f"{damaged}.state"
    assert len(record_starts(path)) == 3
    flip_in_place(path, 2)
    for cid in (damaged, twin):
        assert "error" not in generate(server, text_input="t4", conversation_id=cid, **fields)
    killed = engine_core_pid(server)
    os.kill(killed, signal.SIGKILL)
    wait_for_a_new_core(server, killed)

    answers = [generate(server, text_input="t5", conversation_id=cid, **fields) for cid in (damaged, twin)]
    assert "error" not in answers[0], answers[0]
    assert answers[0]["text_output"] == answers[1]["text_output"]
    lengths = [ConversationStore(served_dir / "conversations", make_engine(served_dir).config).length_of(cid)
               for cid in (damaged, twin)]
    assert lengths[0] == lengths[1]  # t1 to t5 stored, as for the twin
