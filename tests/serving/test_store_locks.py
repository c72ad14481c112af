"""One owner per conversation across processes, and the limits: a turn lock held by another live process refuses a
second turn; a killed process leaves no lock; a store another live server holds is refused, naming it; a new
conversation over max_conversations / max_store_bytes and a prompt over max_prompt_tokens are refused, each
message naming the limit and its value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ced import CEDEngine, CEDForCausalLM
from ced.batched import BatchedEngine
from ced.row_engine import RowEngine
from ced.tokenization import ChatTokenizer
from python_backend.core.limits import LimitError, Limits, parse_size
from python_backend.core.scheduler import Scheduler, Turn
from python_backend.core.settings import ServingSettings
from python_backend.core.routing import RouteDecision
from python_backend.core.store import ConversationBusy, ConversationStore, StoreInUse, hold_store

from turn_sink import ListSink

# Another process: holds the store (as `mol2 serve` does) and a turn of c1, then waits to be killed.
HOLDER = """
import sys, time
from ced import CEDConfig
from python_backend.core.store import ConversationStore, hold_store
hold_store(sys.argv[1], {"pid": __import__("os").getpid(), "http": "127.0.0.1:1"})
ConversationStore(sys.argv[1], CEDConfig.from_name("tiny")).begin_turn("c1")
print("held", flush=True)
time.sleep(600)
"""


def test_another_live_process_owns_its_turn_and_store_until_it_is_killed(tmp_path, engine):
    state = engine.new_conversation()
    engine.turn(state, list(range(12)), "A1")
    store = ConversationStore(tmp_path, engine.config, idle_timeout_s=1)
    store.save("c1", state)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConversationBusy, match="'c1' already has a turn in progress"):
            store.begin_turn("c1")  # two live owners never interleave turns on one conversation
        assert store.expire(now=time.time() + 60) == []  # idle, but its lock is held: not expired
        with pytest.raises(StoreInUse, match=rf"held by another live server \(pid {holder.pid}, http 127.0.0.1:1\)"
                                             r".*--store DIR"):
            hold_store(tmp_path, {"pid": os.getpid()})
        os.kill(holder.pid, signal.SIGKILL)  # dies mid-turn
        holder.wait()
    finally:
        holder.kill()
        holder.wait()
    store.begin_turn("c1")  # at once: the kernel released the dead process's locks
    assert store.load("c1").length == state.length
    store.end_turn("c1")
    assert not (tmp_path / "c1.lock").exists()
    hold_store(tmp_path, {"pid": os.getpid()}).release()


def test_new_conversations_over_the_store_limits_are_refused(engine, tmp_path):
    state = engine.new_conversation()
    engine.turn(state, list(range(12)), "A1")
    store = ConversationStore(tmp_path, engine.config, limits=Limits(max_conversations=2))
    store.save("c1", state)
    store.begin_turn("starting")  # a first turn running: it counts before its record exists
    with pytest.raises(LimitError, match=r"already holds 2 conversations, its limit \(max_conversations=2\)"):
        store.begin_turn("c3")
    assert not (tmp_path / "c3.lock").exists()  # the refusal holds nothing
    store.begin_turn("c1")  # a stored conversation goes on
    store.end_turn("c1")
    store.end_turn("starting")
    store.begin_turn("c3")
    store.end_turn("c3")

    size = store.journal_size("c1")
    full = ConversationStore(tmp_path, engine.config, limits=Limits(max_store_bytes=size))
    with pytest.raises(LimitError, match=rf"holds {size:,} bytes, at its limit \(max_store_bytes={size:,}\)"):
        full.begin_turn("c4")
    unlimited = ConversationStore(tmp_path, engine.config, limits=Limits(max_conversations=0, max_store_bytes=0))
    unlimited.begin_turn("c4")
    unlimited.end_turn("c4")


def test_limit_settings_come_from_parameters_then_the_environment(monkeypatch):
    monkeypatch.setenv("MOL2_MAX_PROMPT_TOKENS", "100")
    monkeypatch.setenv("MOL2_MAX_STORE_BYTES", "2G")
    monkeypatch.setenv("MOL2_IDLE_TIMEOUT_S", "90")
    settings = ServingSettings.from_parameters({"max_conversations": "7", "max_prompt_tokens": "auto"})
    assert settings.limits == Limits(max_prompt_tokens=100, max_conversations=7, max_store_bytes=2 << 30)
    assert settings.idle_timeout_s == 90.0
    assert ServingSettings.from_parameters({"max_prompt_tokens": "50"}).limits.max_prompt_tokens == 50
    monkeypatch.delenv("MOL2_MAX_PROMPT_TOKENS")
    assert ServingSettings.from_parameters({}).limits.max_prompt_tokens == 16384
    assert parse_size("512MiB") == 512 << 20 and parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="max_prompt_tokens must be positive"):
        Limits(max_prompt_tokens=0)


@pytest.mark.parametrize("rows", [BatchedEngine, RowEngine])
def test_a_prompt_over_max_prompt_tokens_is_refused_by_both_engines_paths(served_dir, tmp_path, rows):
    engine = CEDEngine(CEDForCausalLM.from_pretrained(served_dir / "model"))
    tokenizer = ChatTokenizer(served_dir / "model")
    store = ConversationStore(tmp_path, engine.config, limits=Limits(max_prompt_tokens=16))
    scheduler = Scheduler(rows(engine), store, tokenizer, lambda decision: None, lambda: [])
    long, short = tokenizer.encode("far too long for this server " * 4), tokenizer.encode("hi")
    decision = RouteDecision("base", 0)
    sinks = []
    for cid, text in (("long", long), ("short", short)):
        sinks.append(ListSink())
        scheduler.submit(Turn(cid, text, lambda pooled: decision, sinks[-1], max_tokens=2, explicit=True, new=True))
    scheduler.drain()
    prompt = len(tokenizer.user_turn(long, first=True))
    assert isinstance(sinks[0].error, LimitError)
    assert str(sinks[0].error).startswith(f"the prompt is {prompt} tokens, over this server's limit of 16 tokens "
                                          "per request (max_prompt_tokens)")
    assert sinks[1].done and sinks[1].error is None  # the short one is served
    assert not (tmp_path / "long.lock").exists() and not store.exists("long")  # refused: nothing held or kept
    prefill = ListSink()  # the split server's prefill: a turn that leaves once prefilled, refused the same way
    scheduler.submit(Turn("p", long, None, prefill, new=True, leaves_prefilled=True, returns_state=True))
    scheduler.drain()
    assert isinstance(prefill.error, LimitError) and "over this server's limit of 16 tokens" in str(prefill.error)


def test_the_relay_holds_the_turn_lock_in_its_own_process(engine, tmp_path):
    """A split server's relay takes the lock itself (prefill, another process, takes none): a conversation whose
    turn runs is refused before any stage is called, and a new conversation over the limits stores nothing."""
    import numpy as np

    from ced.tokenization import ChatTokenizer
    from python_backend.core.settings import ROOT
    from python_backend.triton.front import Relay
    from python_backend.core.seal import Sealer

    state = engine.new_conversation()
    engine.turn(state, list(range(12)), "A1")
    store = ConversationStore(tmp_path, engine.config, limits=Limits(max_conversations=1))
    store.save("c1", state)
    tokenizer = ChatTokenizer(ROOT / "models" / "demo" / "model")
    calls = []

    def call(model, inputs, outputs):
        calls.append(model)
        return {"_h19": np.zeros(4, np.float32), "_state": np.zeros(1, np.uint8), "_transfer_meta": np.array([12, 0]),
                "_conversation_id": np.array([b"fresh"], dtype=object)}

    relay = Relay(call, store, "router", "host:1", "decode", Sealer(bytes(range(32))),
                  lambda *args: pytest.fail("decode must not be reached"), tokenizer=tokenizer)
    other = ConversationStore(tmp_path, engine.config)  # another process's turn on c1, in effect
    other.begin_turn("c1")
    with pytest.raises(ConversationBusy, match="'c1' already has a turn in progress"):
        relay.run({"text_input": np.array([b"hi"], dtype=object), "conversation_id": np.array([b"c1"], dtype=object)},
                  lambda *args: None)
    assert calls == []  # refused before prefill
    other.end_turn("c1")
    with pytest.raises(LimitError, match=r"max_conversations=1"):
        relay.run({"text_input": np.array([b"hi"], dtype=object)}, lambda *args: None)
    assert calls == ["prefill"] and not store.exists("fresh") and not (tmp_path / "fresh.lock").exists()
