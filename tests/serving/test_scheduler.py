"""The scheduler without a server (the only loop a turn runs in, whatever engine runs the model): interleaved turns give each conversation the serial engine's tokens and write
the journal; a cancelled row stops at the next step and stores nothing while the others go on; a long prompt is
prefilled in chunks while decoding rows keep getting a token every iteration."""

from __future__ import annotations

import pytest

from ced import CEDEngine, CEDForCausalLM
from ced.batched import BatchedEngine
from ced.row_engine import RowEngine
from ced.tokenization import ChatTokenizer
from python_backend.core.scheduler import CancelledTurn, Scheduler, Turn
from python_backend.core.routing import RouteDecision
from python_backend.core.store import ConversationStore

from turn_sink import ListSink


def make_engine(served_dir) -> CEDEngine:
    engine = CEDEngine(CEDForCausalLM.from_pretrained(served_dir / "model"))
    for name in ("chat", "coding"):
        engine.adapters.load(name, served_dir / "adapters" / name)
    return engine


@pytest.fixture(params=[BatchedEngine, RowEngine])
def parts(served_dir, tmp_path, request):
    """The scheduler over the paged pool (torch), and over an engine that runs one conversation per call (the
    exported graphs' path: ced/row_engine.py; here over the serial torch engine)."""
    engine = make_engine(served_dir)
    store = ConversationStore(tmp_path, engine.config)
    tokenizer = ChatTokenizer(served_dir / "model")
    scheduler = Scheduler(request.param(engine), store, tokenizer, lambda decision: decision.adapter, lambda: [],
                          prefill_chunk=64, token_budget=80)
    return scheduler, store, tokenizer


def turn(cid, text, adapter, sink, tokenizer, new=True, max_tokens=6):
    decision = RouteDecision(adapter, 0)
    return Turn(cid, tokenizer.encode(text), lambda pooled: decision, sink, max_tokens=max_tokens, explicit=True,
                new=new)


def serial_tokens(served_dir, tokenizer, turns, max_tokens=6):
    engine, state, out = make_engine(served_dir), None, []
    state = engine.new_conversation()
    for text, adapter in turns:
        logits = engine.turn(state, tokenizer.user_turn(tokenizer.encode(text), state.length == 0), adapter).logits
        out.append(list(engine.generate(state, adapter, logits, max_tokens, stop_tokens=tokenizer.stop_ids)))
    return out


def test_interleaved_turns_are_each_conversations_serial_run(parts, served_dir):
    scheduler, store, tokenizer = parts
    scripts = {f"c{n}": [(f"conversation {n} turn {t}", ["chat", "coding"][(n + t) % 2]) for t in range(3)]
               for n in range(4)}
    got = {cid: [] for cid in scripts}
    for t in range(3):
        sinks = {}
        for cid, script in scripts.items():
            sinks[cid] = ListSink()
            scheduler.submit(turn(cid, script[t][0], script[t][1], sinks[cid], tokenizer, new=t == 0))
        scheduler.drain()
        for cid, sink in sinks.items():
            assert sink.done and sink.error is None, sink.error
            got[cid].append(sink.tokens)
    for cid, script in scripts.items():
        assert got[cid] == serial_tokens(served_dir, tokenizer, script), cid
        assert store.length_of(cid) == scheduler.residency.row_of(cid).length
    assert scheduler.stats.decode_rows > scheduler.stats.decode_steps  # rows really shared steps
    assert scheduler.stats.prefill_rows > scheduler.stats.prefill_calls  # and prompts of different lengths, calls


def test_a_cancelled_row_stops_and_stores_nothing(parts):
    scheduler, store, tokenizer = parts
    for cid in ("keep", "cancel"):
        scheduler.submit(turn(cid, "first", "chat", ListSink(), tokenizer))
    scheduler.drain()
    size = store.journal_size("cancel")
    keep, cancel = ListSink(), ListSink(cancel_after=2)
    for cid, sink in (("keep", keep), ("cancel", cancel)):
        scheduler.submit(turn(cid, "second", "coding", sink, tokenizer, new=False, max_tokens=20))
    scheduler.drain()
    assert isinstance(cancel.error, CancelledTurn) and len(cancel.tokens) == 2
    assert store.journal_size("cancel") == size and not scheduler.residency.has("cancel")
    assert keep.done and len(keep.tokens) > 2
    again = ListSink()
    scheduler.submit(turn("cancel", "third", "chat", again, tokenizer, new=False))
    scheduler.drain()
    assert again.done


def test_a_long_prompt_is_chunked_while_rows_decode(parts):
    scheduler, store, tokenizer = parts
    short = ListSink()
    scheduler.submit(turn("short", "hi", "chat", short, tokenizer, max_tokens=40))
    scheduler.iterate()  # prefilled and replayed: decoding from now on
    assert short.tokens
    long = ListSink()
    scheduler.submit(turn("long", "word " * 200, "coding", long, tokenizer, max_tokens=2))  # ~1000 byte tokens
    before = len(short.tokens)
    iterations = 0
    while not long.tokens:
        scheduler.iterate()
        iterations += 1
    assert iterations > 5  # the prompt took several iterations (chunks of 64 under a budget of 80) ...
    assert len(short.tokens) - before >= iterations - 1  # ... and the short row got a token in each of them
    scheduler.drain()
    assert short.done and long.done


def test_a_turn_that_fails_in_prefill_fails_alone(parts):
    scheduler, store, tokenizer = parts
    good, bad = ListSink(), ListSink()
    scheduler.submit(turn("good", "hello there", "chat", good, tokenizer, max_tokens=8))
    scheduler.iterate()  # decoding
    broken = turn("bad", "x", "chat", bad, tokenizer)
    broken.text_ids = [10 ** 6]  # no such token: refused by the engine's prefill
    beside = ListSink()  # arrives with it: the two would share a prefill call
    scheduler.submit(broken)
    scheduler.submit(turn("beside", "hi", "coding", beside, tokenizer, max_tokens=4))
    scheduler.drain()
    assert isinstance(bad.error, ValueError) and "out of range" in str(bad.error)
    assert good.done and good.error is None and len(good.tokens) == 8
    assert beside.done and beside.error is None and len(beside.tokens) == 4


def test_sampling_controls_shape_the_batched_turns_as_the_serial_engine(parts, served_dir):
    """Rows with penalties, min_tokens and stop_token_ids beside a plain row in one batch: each gets the serial
    engine's tokens under the same settings, and the plain row is untouched by its neighbours' settings."""
    from ced.engine import SamplingParams

    scheduler, store, tokenizer = parts
    plain = serial_tokens(served_dir, tokenizer, [("tell me more", "chat")], max_tokens=10)[0]
    stop = plain[3]
    settings = {"plain": SamplingParams(), "penalised": SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0),
                "stopped": SamplingParams(stop_token_ids=(stop,)), "late": SamplingParams(min_tokens=10)}
    sinks = {}
    for cid, sampling in settings.items():
        sinks[cid] = ListSink()
        made = turn(cid, "tell me more", "chat", sinks[cid], tokenizer, max_tokens=10)
        made.sampling = sampling
        scheduler.submit(made)
    scheduler.drain()
    engine = make_engine(served_dir)
    for cid, sampling in settings.items():
        state = engine.new_conversation()
        logits = engine.turn(state, tokenizer.user_turn(tokenizer.encode("tell me more"), True), "chat").logits
        expected = list(engine.generate(state, "chat", logits, 10, sampling, stop_tokens=tokenizer.stop_ids))
        assert sinks[cid].done and sinks[cid].tokens == expected, cid
    assert sinks["plain"].tokens == plain
    assert sinks["penalised"].tokens != plain
    assert sinks["stopped"].tokens == plain[:plain.index(stop) + 1]
    assert len(sinks["late"].tokens) == 10 and not set(sinks["late"].tokens) & set(tokenizer.stop_ids)
