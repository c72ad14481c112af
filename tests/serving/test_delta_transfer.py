"""The disaggregated pair's delta transfer (python_backend/core/delta_transfer.py) without a server: the codec, the
decode server's cache, and the relay with an in-process decode stage and prefill (real engine, real store, real
seals). A delta rebuilds bitwise the state a full transfer gives; its bytes do not grow with the history; a
missing or wrong base falls back to the full transfer with the same answers; a damaged delta is refused."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.torch import load

from ced import CEDConfig

from ced.batched import BatchedEngine
from ced.row_engine import RowEngine
from ced.tokenization import ChatTokenizer
from python_backend.core.adapter_set import parse_adapter_set, sync_registry
from python_backend.core.delta_transfer import (BASE_REFUSED, DELTA, FULL, TO_DECODE, TO_PREFILL, BaseRefused,
                                           DecodeTransfers, base_of, cache_bytes, decode_delta, encode_delta,
                                           rebuild)
from python_backend.core.fnv import BASE
from python_backend.triton.front import Relay
from python_backend.core.seal import DECODE, PREFILL, RETURNED, Sealer, decode_fields, prefill_fields, returned_fields
from python_backend.core.routing import RouteDecision
from python_backend.core.scheduler import Scheduler, Turn
from python_backend.core.settings import ROOT
from python_backend.core.store import ConversationStore
from python_backend.core.transfer import TransferError, _read_metadata, decode_state, encode_state
from python_backend.triton.triton_io import RequestError

SEALER = Sealer(bytes(range(32)))
CONFIG = CEDConfig.from_name("tiny")  # the `engine` fixture's
TURNS = [("hello there, decode server", "A1"), ("and a second turn", None), ("third, under A1 again", "A1"),
         ("four", None), ("the fifth turn is here", "A1")]


def exact(state_or_bytes) -> tuple:
    """A state as every tensor's dtype, shape and bytes and every metadata field: equal means bitwise equal.
    (Not the encoded bytes themselves: safetensors writes the metadata fields in no fixed order.)"""
    data = state_or_bytes if isinstance(state_or_bytes, bytes) else encode_state(state_or_bytes, CONFIG)
    tensors = {name: (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
               for name, t in load(data).items()}
    return _read_metadata(data), tensors


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


def _text(value: np.ndarray) -> str:
    item = value.reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else str(item)


class ByteTokenizer(ChatTokenizer):
    """The demo tokenizer, but a turn's text is its UTF-8 bytes as ids: ids in this small model's vocabulary."""

    def __init__(self):
        super().__init__(ROOT / "models" / "demo" / "model")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class Result:
    def __init__(self, **outputs):
        self.outputs = outputs

    def as_numpy(self, name):
        return self.outputs.get(name)


class Collect:
    """A handed turn's end, for the in-process decode server."""

    error = None

    def token(self, token, turn):
        pass

    def finished(self, turn):
        pass

    def failed(self, error, turn):
        self.error = error

    def cancelled(self):
        return False


class Pair:
    """A prefill server's relay and a decode server, in process: prefill and decode run the real engine and
    the scheduler (its decode turns handed, as the decode model hands them), every internal request sealed and
    checked as the models do; counts are kept per (side, name, labels)."""

    def __init__(self, engine, adapter_set, root, cache_bytes: int = 256 << 20, batched: bool = True):
        self.engine, self.adapter_set = engine, adapter_set
        self.store = ConversationStore(root, engine.config)
        self.prefill_store = ConversationStore(root, engine.config)  # the prefill model's: another process's view
        self.counts: Counter = Counter()
        self.transfers = DecodeTransfers(engine.config, cache_bytes, self.counter("decode"))
        self.scheduler = Scheduler(BatchedEngine(engine) if batched else RowEngine(engine),
                                   ConversationStore(root / "decode", engine.config), type("T", (), {"stop_ids": ()})(),
                                   self.adapter_of, lambda: [], prefix_cache_bytes=0)
        self.relay = Relay(self.call, self.store, "router", "decode:1", "decode", SEALER, self.decode,
                           self.counter("relay"), tokenizer=ByteTokenizer())
        self.generated: list[int] = []  # the ids the last turn's decode generated
        self.sent: list[tuple[str, int, bytes]] = []  # (kind, bytes to decode, the full state prefill made)
        self.received: list[tuple] = []  # the state decode received (exact), per attempt it accepted
        self.next_id = 0

    def adapter_of(self, decision: RouteDecision) -> str | None:
        return None if decision.adapter_hash == BASE else self.adapter_set.by_hash(decision.adapter_hash).name

    def counter(self, side: str):
        def count(name, value=1.0, **labels):
            self.counts[(side, name, *sorted(labels.items()))] += value
        return count

    def call(self, model, inputs, outputs):
        if model == "prefill":
            conversation_id = _text(inputs["conversation_id"]) if "conversation_id" in inputs else None
            SEALER.check(PREFILL, _text(inputs["_seal"]), **prefill_fields(conversation_id, False,
                                                                            inputs["_text_ids"]))
            if conversation_id is None:
                self.next_id += 1
                conversation_id, state = f"c{self.next_id}", self.engine.new_conversation()
            else:
                state = self.prefill_store.load(conversation_id)
            self.engine.prefill(state, inputs["_text_ids"].tolist())
            full = encode_state(state, self.engine.config)
            self.full = full
            return {"_h19": np.zeros(4, np.float32), "_state": np.frombuffer(full, np.uint8),
                    "_transfer_meta": np.array([state.length, BASE]), "_conversation_id": text(conversation_id),
                    "_prompt_tokens": np.array([inputs["_text_ids"].size], np.int32)}
        if model == "router":
            adapter = _text(inputs["adapter"]) if "adapter" in inputs else None
            adapter_hash = BASE if adapter is None else self.adapter_set.by_name(adapter).hash
            return {"_routed_meta": np.array([int(inputs["_transfer_meta"][0]), adapter_hash]),
                    "_route_scores": text("{}"), "_route_adapter": text(adapter or "base")}
        raise AssertionError(f"unexpected call to {model}: the relay detokenizes decode's ids itself")

    def decode(self, url, model, inputs):
        """The decode model's path: seal, then the state received (a refusal is the first thing the relay hears,
        as a RequestError worded as remote_decode words one), then the tokens and the sealed final state."""
        state = inputs["_state"].tobytes()
        conversation_id = _text(inputs["_conversation_id"])
        length, adapter_hash = (int(v) for v in inputs["_routed_meta"])
        end = bool(inputs["end_conversation"][0]) if "end_conversation" in inputs else False
        SEALER.check(DECODE, _text(inputs["_seal"]), **decode_fields(conversation_id, length, adapter_hash, state,
                                                                      True, end))
        self.sent.append((DELTA if state != self.full else FULL, len(state), self.full))
        try:
            received = self.transfers.receive(conversation_id, state)
        except (TransferError, ValueError) as error:
            raise RequestError(f"decode server {url}: {error}") from None
        self.received.append(exact(received.state))
        sink, decision = Collect(), RouteDecision("", adapter_hash)
        turn = Turn(conversation_id, [], lambda pooled: decision, sink, int(inputs["max_tokens"][0]),
                    end_conversation=end, explicit=True, handed=received.state, returns_state=True)
        self.scheduler.submit(turn)
        self.scheduler.drain()
        assert sink.error is None, sink.error
        ids = self.generated = turn.generated
        yield Result(_ids=np.array(ids), _fresh=np.array([len(ids)], np.int32), _last=np.array([True]),
                     applied_adapter=text("x"), replayed_tokens=np.array([0], np.int32),
                     output_tokens=np.array([len(ids)], np.int32), route_scores=text("{}"),
                     conversation_id_out=text(conversation_id))
        if end:  # the last turn: no state goes back (the decode model's HandedSink)
            assert turn.final_state is None
            self.transfers.forget(conversation_id)
            return
        final_state = self.transfers.reply(conversation_id, received, turn.final_state, end)
        yield Result(_state_out=np.frombuffer(final_state, np.uint8), _state_seal=text(SEALER.seal(
            RETURNED, **returned_fields(conversation_id, final_state))))

    def turn(self, words: str, adapter: str | None, conversation_id: str | None = None, end: bool = False,
             max_tokens: int = 6) -> tuple[str, list[int]]:
        fields = {"text_input": text(words), "max_tokens": np.array([max_tokens], np.int32)}
        if adapter:
            fields["adapter"] = text(adapter)
        if conversation_id:
            fields["conversation_id"] = text(conversation_id)
        if end:
            fields["end_conversation"] = np.array([True])
        answers = []
        self.relay.run(fields, lambda outputs, final: answers.append(outputs))
        answer = answers[-1]
        return _text(answer["conversation_id_out"]), self.generated

    def conversation(self, turns, between=lambda pair, conversation_id, number: None):
        conversation_id, answers = None, []
        for number, (words, adapter) in enumerate(turns):
            if conversation_id:
                between(self, conversation_id, number)
            conversation_id, ids = self.turn(words, adapter, conversation_id)
            answers.append(ids)
        return conversation_id, answers

    def stored(self, conversation_id: str) -> tuple:
        return exact(self.store.load(conversation_id))


@pytest.fixture()
def adapter_set(engine, adapter_dirs, tmp_path):
    path = tmp_path / "set.json"
    path.write_text(json.dumps({"adapters": [{"name": "A1", "path": adapter_dirs["A1"], "description": "one"}]}))
    adapter_set = parse_adapter_set(path)
    sync_registry(engine.adapters, adapter_set, {}, {})
    return adapter_set


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "serial"])
def test_a_delta_pair_answers_and_stores_bitwise_as_the_full_pair(engine, adapter_set, tmp_path, batched):
    full = Pair(engine, adapter_set, tmp_path / "full", cache_bytes=0, batched=batched)  # keeps nothing: all whole
    delta = Pair(engine, adapter_set, tmp_path / "delta", batched=batched)
    full_id, full_answers = full.conversation(TURNS)
    delta_id, delta_answers = delta.conversation(TURNS)
    assert delta_answers == full_answers and any(delta_answers)
    assert delta.stored(delta_id) == full.stored(full_id)  # the committed state, bitwise
    assert [kind for kind, _, _ in full.sent] == [FULL] * len(TURNS)
    assert [kind for kind, _, _ in delta.sent] == [FULL] + [DELTA] * (len(TURNS) - 1)
    # Each way, the state rebuilt from a delta is bitwise the state the full bytes decode to.
    for (_, _, whole), received in zip(delta.sent, delta.received):
        assert received == exact(decode_state(whole, engine.config))
    assert delta.received == full.received
    for (_, sent, whole), (_, full_sent, _) in zip(delta.sent[1:], full.sent[1:]):
        assert sent < full_sent and full_sent == len(whole)
    assert delta.counts[("relay", "mol2_transfer_bytes_total", ("direction", TO_PREFILL), ("kind", DELTA))] > 0
    assert not any(name == "mol2_transfer_fallbacks_total" for _, name, *_ in delta.counts)


def test_delta_bytes_do_not_grow_with_the_history(engine):
    """The same short turn after 64 and after 2048 tokens of history: the delta is the same size (to a few header
    digits); the full state is not."""
    sizes = {}
    for history in (64, 2048):
        state = engine.new_conversation()
        engine.prefill(state, [(7 * i) % 300 + 1 for i in range(history)])
        base = base_of(state, engine.config, "v")
        engine.prefill(state, list(range(20, 32)))
        delta = encode_delta(state, base, engine.config, TO_DECODE)
        sizes[history] = len(delta), len(encode_state(state, engine.config))
    (delta_short, full_short), (delta_long, full_long) = sizes[64], sizes[2048]
    assert abs(delta_long - delta_short) <= 64, sizes
    assert full_long > 4 * full_short and delta_long < full_long / 4, sizes


def test_delta_bytes_per_turn_through_the_relay_stay_flat(engine, adapter_set, tmp_path):
    """Through the relay: after a long first turn, every later short turn sends about the same bytes each way."""
    pair = Pair(engine, adapter_set, tmp_path)
    conversation_id, _ = pair.turn(" ".join(["a long history"] * 80), "A1")
    for words in ("one more", "and one more", "again here"):
        pair.turn(words, None, conversation_id)
    later = [size for kind, size, _ in pair.sent[1:]]
    assert [kind for kind, _, _ in pair.sent] == [FULL, DELTA, DELTA, DELTA]
    assert max(later) - min(later) < 0.1 * max(later) and max(later) < pair.sent[0][1] / 2


@pytest.mark.parametrize("break_base", ["decode restarted", "decode holds another version", "evicted",
                                        "relay remembers another version"])
def test_a_missing_or_wrong_base_falls_back_to_the_full_state(engine, adapter_set, tmp_path, break_base):
    def between(pair, conversation_id, number):
        if number != 3:
            return
        if break_base == "decode restarted":
            pair.transfers.forget(conversation_id)
        elif break_base == "decode holds another version":
            cached = pair.transfers._states[conversation_id]
            cached.base = dataclasses.replace(cached.base, version="0" * 16)
        elif break_base == "evicted":  # another conversation's state pushed it out
            limit, pair.transfers.limit_bytes = pair.transfers.limit_bytes, 1
            pair.transfers._keep("other", pair.transfers._states[conversation_id])
            pair.transfers.limit_bytes = limit
        else:
            bases = pair.relay.transfers._bases
            bases[conversation_id] = dataclasses.replace(bases[conversation_id], version="f" * 16)

    full = Pair(engine, adapter_set, tmp_path / "full", cache_bytes=0)
    delta = Pair(engine, adapter_set, tmp_path / "delta")
    full_id, expected = full.conversation(TURNS)
    delta_id, answers = delta.conversation(TURNS, between)
    assert answers == expected
    assert delta.stored(delta_id) == full.stored(full_id)
    kinds = [kind for kind, _, _ in delta.sent]
    # turn 4 (index 3): the delta refused, the same turn sent whole; the next turn is a delta again
    assert kinds == [FULL, DELTA, DELTA, DELTA, FULL, DELTA]
    assert delta.counts[("relay", "mol2_transfer_fallbacks_total", ("reason", "refused"))] == 1
    reason = "missing" if break_base in ("decode restarted", "evicted") else "mismatch"
    assert delta.counts[("decode", "mol2_transfer_fallbacks_total", ("reason", reason))] == 1


def test_a_journal_written_elsewhere_is_sent_whole(engine, adapter_set, tmp_path):
    """Another process (another relay of the same store) wrote the conversation since this relay's commit: its
    history may not be the one decode holds, so the turn goes whole, and still answers as the full pair."""
    def between(pair, conversation_id, number):
        if number == 2:  # the same state, written again by another store object (another process's view)
            other = ConversationStore(pair.store.root, engine.config)
            other.compact(conversation_id)

    full = Pair(engine, adapter_set, tmp_path / "full", cache_bytes=0)
    delta = Pair(engine, adapter_set, tmp_path / "delta")
    full_id, expected = full.conversation(TURNS[:4])
    delta_id, answers = delta.conversation(TURNS[:4], between)
    assert answers == expected and delta.stored(delta_id) == full.stored(full_id)
    assert [kind for kind, _, _ in delta.sent] == [FULL, DELTA, FULL, DELTA]
    assert delta.counts[("relay", "mol2_transfer_fallbacks_total", ("reason", "store_changed"))] == 1


def test_the_end_of_a_conversation_forgets_it_on_both_sides(engine, adapter_set, tmp_path):
    pair = Pair(engine, adapter_set, tmp_path)
    conversation_id, _ = pair.turn("hello", "A1")
    assert conversation_id in pair.transfers._states and conversation_id in pair.relay.transfers._bases
    pair.turn("bye", None, conversation_id, end=True)
    assert not pair.store.exists(conversation_id)
    assert pair.transfers.held_bytes == 0 and not pair.relay.transfers._bases


def test_the_decode_cache_is_bounded_by_bytes(engine, adapter_set, tmp_path):
    pair = Pair(engine, adapter_set, tmp_path)
    ids = [pair.turn(f"conversation {n}", "A1")[0] for n in range(3)]
    one = pair.transfers._states[ids[0]].nbytes
    pair.transfers.limit_bytes = 2 * one + one // 2
    pair.turn("touch the first", None, ids[0])  # now the most recently used
    pair.turn("a fourth", "A1")
    assert set(pair.transfers._states) == {ids[0], "c4"}  # the least recently used went first
    assert pair.transfers.held_bytes == sum(c.nbytes for c in pair.transfers._states.values())
    pair.transfers.limit_bytes = 10  # no state fits: none kept, and the relay is told so (no version)
    conversation_id, _ = pair.turn("too big to keep", "A1")
    assert conversation_id not in pair.transfers._states and conversation_id not in pair.relay.transfers._bases


def _a_delta(engine, direction=TO_DECODE):
    state = engine.new_conversation()
    engine.turn(state, list(range(1, 40)), "A1")
    base = base_of(state, engine.config, "0123456789abcdef")
    before = encode_state(state, engine.config)
    engine.prefill(state, list(range(50, 61)))
    return decode_state(before, engine.config), base, state, encode_delta(state, base, engine.config, direction)


def test_a_delta_rebuilds_its_state_bitwise_and_leaves_the_base_alone(engine):
    base_state, base, state, data = _a_delta(engine)
    before = exact(base_state)
    delta = decode_delta(data, engine.config, TO_DECODE)
    assert delta.base == base
    rebuilt = rebuild(base_state, delta, engine.config)
    assert exact(rebuilt) == exact(state) and exact(base_state) == before


def test_the_answer_comes_back_without_the_windows_the_store_drops(engine, tmp_path):
    """decode's reply leaves the adapter-bound windows behind: the relay's store keeps none (every turn rebuilds
    them by replay), so what it stores is bitwise what it stores from the full state."""
    sent = engine.new_conversation()
    engine.prefill(sent, list(range(1, 30)))
    final = decode_state(encode_state(sent, engine.config), engine.config)
    engine.turn(final, list(range(40, 47)), "A1")
    assert final.bound.length == final.length  # replayed: the bound windows are full
    data = encode_delta(final, base_of(sent, engine.config), engine.config, TO_PREFILL, bound_windows=False)
    rebuilt = rebuild(sent, decode_delta(data, engine.config, TO_PREFILL), engine.config)
    assert len(data) < len(encode_delta(final, base_of(sent, engine.config), engine.config, TO_PREFILL))
    assert rebuilt.bound.adapter == "A1" and rebuilt.bound.length == 0
    assert all(len(window) == 0 for window in rebuilt.bound.windows.values())
    by_delta, by_full = ConversationStore(tmp_path / "a", CONFIG), ConversationStore(tmp_path / "b", CONFIG)
    by_delta.save("c", rebuilt)
    by_full.save("c", decode_state(encode_state(final, engine.config), engine.config))
    assert exact(by_delta.load("c")) == exact(by_full.load("c"))


def test_a_damaged_or_foreign_delta_is_refused(engine):
    _, _, _, data = _a_delta(engine)
    header = int.from_bytes(data[:8], "little")
    with pytest.raises(TransferError, match="checksum"):  # a flipped bit in a tensor
        decode_delta(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:], engine.config, TO_DECODE)
    edited = data.replace(b'"base_tokens":"39"', b'"base_tokens":"38"')  # a metadata field, same length
    assert edited != data and len(edited) == len(data) and header
    with pytest.raises(TransferError, match="checksum"):
        decode_delta(edited, engine.config, TO_DECODE)
    with pytest.raises(TransferError, match="to_decode delta was sent to_prefill"):
        decode_delta(data, engine.config, TO_PREFILL)
    with pytest.raises(TransferError, match="another model config"):
        decode_delta(data, CEDConfig.from_name("tiny", window=8), TO_DECODE)
    with pytest.raises(TransferError, match="not a readable safetensors record"):
        decode_delta(data[:100], engine.config, TO_DECODE)


def test_decode_refuses_a_delta_on_a_state_it_does_not_hold(engine):
    base_state, base, _, data = _a_delta(engine)
    transfers = DecodeTransfers(engine.config)
    with pytest.raises(BaseRefused, match=f"^{re.escape(BASE_REFUSED)}.*holds no state"):
        transfers.receive("c1", data)
    with pytest.raises(TransferError, match="checksum"):  # damaged: refused as such, never as a missing base
        transfers.receive("c1", data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])



def test_the_cache_size_comes_from_the_parameter_else_the_environment(monkeypatch):
    monkeypatch.delenv("MOL2_TRANSFER_CACHE_MB", raising=False)
    assert cache_bytes("auto") == 256 << 20 and cache_bytes("0") == 0 and cache_bytes("1.5") == 3 << 19
    monkeypatch.setenv("MOL2_TRANSFER_CACHE_MB", "64")
    assert cache_bytes("auto") == 64 << 20 and cache_bytes("8") == 8 << 20
    for bad in ("lots", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="transfer_cache_mb must be"):
            cache_bytes(bad)
