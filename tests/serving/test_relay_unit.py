"""The disaggregated relay's bookkeeping without a server: the state that comes back is committed and the turn
lock released; a failed or truncated remote decode, or a returned state without decode's seal, releases the lock
and writes nothing; every internal request it sends is sealed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ced.tokenization import ChatTokenizer
from python_backend.core.settings import ROOT
from python_backend.triton.bls import StageFailure, bls_call
from python_backend.triton.front import Relay
from python_backend.core.seal import DECODE, PREFILL, RETURNED, SealError, Sealer, decode_fields, prefill_fields, \
    returned_fields
from python_backend.triton.triton_io import RequestError
from python_backend.core.store import ConversationStore
from python_backend.core.transfer import encode_state


class Result:
    """What tritonclient hands back for one streamed response."""

    def __init__(self, **outputs):
        self.outputs = outputs

    def as_numpy(self, name):
        return self.outputs.get(name)


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


SEALER = Sealer(bytes(range(32)))
TOKENIZER = ChatTokenizer(ROOT / "models" / "demo" / "model")  # any tokenizer: the relay turns decode's ids into text


def sealed_state(state_bytes: np.ndarray, sealer: Sealer = SEALER) -> Result:
    """decode's last response: the final state and its seal."""
    return Result(_state_out=state_bytes, _state_seal=text(sealer.seal(RETURNED, **returned_fields(
        "c1", state_bytes.tobytes()))))


@pytest.fixture()
def relay_parts(engine, tmp_path):
    store = ConversationStore(tmp_path, engine.config)
    state = engine.new_conversation()
    engine.turn(state, list(range(12)), "A1")

    def call(model, inputs, outputs):
        if model == "prefill":  # checks the seal as the prefill model does (the relay takes the turn lock)
            SEALER.check(PREFILL, inputs["_seal"][0].decode(), **prefill_fields(None, False, inputs["_text_ids"]))
            return {"_h19": np.zeros(4, np.float32), "_state": np.zeros(1, np.uint8),
                    "_transfer_meta": np.array([12, 0]), "_conversation_id": text("c1"),
                    "_prompt_tokens": np.array([3], np.int32)}
        if model == "router":
            return {"_routed_meta": np.array([12, 0]), "_route_scores": text("{}"), "_route_adapter": text("base")}
        raise AssertionError(f"unexpected call to {model}: the relay detokenizes decode's ids itself")

    answer = dict(_ids=np.array([5]), _fresh=np.array([1], np.int32), _last=np.array([False]),
                  applied_adapter=text("base"), replayed_tokens=np.array([12], np.int32),
                  output_tokens=np.array([1], np.int32), route_scores=text("{}"), conversation_id_out=text("c1"))
    final_state = np.frombuffer(encode_state(state, engine.config), np.uint8)
    return store, call, answer, final_state


def test_the_returned_state_is_committed_and_the_lock_released(relay_parts):
    store, call, answer, final_state = relay_parts
    sent = []

    def decode(url, model, inputs):  # checks the seal as the decode model does
        SEALER.check(DECODE, inputs["_seal"][0].decode(), **decode_fields(
            "c1", 12, 0, inputs["_state"].tobytes(), bool(inputs["_return_state"][0]), False))
        return iter([Result(**answer), Result(**answer), sealed_state(final_state)])

    Relay(call, store, "router", "host:1", "decode", SEALER, decode, tokenizer=TOKENIZER).run(
        {"text_input": text("hi")}, lambda out, final: sent.append((final, (store.root / "c1.lock").exists())))
    # The FINAL flag rides the last answer, sent once the state is stored and the lock released: a client may
    # send its next turn the moment it has the answer.
    assert sent == [(False, True), (True, False)]
    assert store.load("c1").length == 12 and not (store.root / "c1.lock").exists()


@pytest.mark.parametrize("responses, message", [
    ("error", "decode server host:1: boom"),
    ("truncated", "ended the turn without its final state"),
])
def test_a_failed_remote_decode_releases_the_lock_and_writes_nothing(relay_parts, responses, message):
    store, call, answer, _ = relay_parts

    def decode(url, model, inputs):
        yield Result(**answer)
        if responses == "error":
            raise RequestError("decode server host:1: boom")

    with pytest.raises(RequestError, match=message):
        relay = Relay(call, store, "router", "host:1", "decode", SEALER, decode, tokenizer=TOKENIZER)
        relay.run({"text_input": text("hi")}, lambda *a: None)
    assert not store.exists("c1") and not (store.root / "c1.lock").exists()


@pytest.mark.parametrize("returned", ["unsealed", "other secret", "other state"])
def test_a_returned_state_without_decodes_seal_is_not_stored(relay_parts, engine, returned):
    """The state that comes back is stored only under a seal of this secret over exactly its bytes."""
    store, call, answer, final_state = relay_parts
    if returned == "unsealed":
        last = Result(_state_out=final_state)
    elif returned == "other secret":
        last = sealed_state(final_state, Sealer(bytes(32)))
    else:
        other = engine.new_conversation()
        engine.turn(other, [1, 2, 3], "A1")
        last = Result(_state_out=np.frombuffer(encode_state(other, engine.config), np.uint8),
                      _state_seal=sealed_state(final_state).outputs["_state_seal"])
    decode = lambda url, model, inputs: iter([Result(**answer), last])  # noqa: E731
    with pytest.raises(SealError):
        relay = Relay(call, store, "router", "host:1", "decode", SEALER, decode, tokenizer=TOKENIZER)
        relay.run({"text_input": text("hi")}, lambda *a: None)
    assert not store.exists("c1") and not (store.root / "c1.lock").exists()


@pytest.mark.parametrize("message, error", [("text_input is empty", RequestError),
                                            ("tokenize failed: KeyError: 'x'", StageFailure)])
def test_a_stage_error_stays_the_clients_or_ours(message, error):
    """Through BLS a model's refusal stays a refusal (400) and its failure a failure (500)."""

    class Response:
        def has_error(self):
            return True

        def error(self):
            return SimpleNamespace(message=lambda: message)

    pb = SimpleNamespace(Tensor=lambda name, value: (name, value),
                         InferenceRequest=lambda **kwargs: SimpleNamespace(exec=Response))
    with pytest.raises(error, match=message.split(":")[0]):
        bls_call(pb)("tokenize", {"text_input": text("hi")}, ["_text_ids"])


class Streamed(Result):
    """A response on a turn's own gRPC stream, as remote_decode reads it (`get_response()`)."""

    def __init__(self, final=False, **outputs):
        super().__init__(**outputs)
        flag = SimpleNamespace(bool_param=final)
        self.response = SimpleNamespace(outputs=list(outputs), parameters={"triton_final_response": flag})

    def get_response(self):
        return self.response


def test_remote_decode_holds_the_last_answer_until_the_link_brought_every_token(monkeypatch):
    """A linked turn's tokens come on the token link, its last answer and state on its own stream, which may be
    first: what follows the last answer waits until the link has brought as many tokens as it counts, so the relay
    reads the answer in order. A turn whose own stream ends with no last answer fails instead of hanging."""
    import python_backend.triton.front as front
    from python_backend.triton.token_link import LinkAnswer, LinkTurn

    def client_sending(own_stream, link=(), turn=None):
        """The turn's own stream's answers come first, the link's after them."""
        def start_stream(callback):
            for result in own_stream:
                callback(result, None)
        def request(*args, **kwargs):
            for answer in link:
                turn.queue.put((answer, None))
        return SimpleNamespace(start_stream=start_stream, async_stream_infer=request,
                               stop_stream=lambda cancel_requests: None)

    last = Streamed(_ids=np.array([5], np.int64), _fresh=np.array([0], np.int32), _last=np.array([True]),
                    output_tokens=np.array([3], np.int32))
    state = Streamed(final=True, _state_out=np.frombuffer(b"state", np.uint8))
    turn = LinkTurn(SimpleNamespace(forget=lambda turn: None), 1)
    meta = {"applied_adapter": "chat"}
    link = [LinkAnswer({"turn": 1, "ids": ids, "fresh": fresh, "output_tokens": count}, meta)
            for ids, fresh, count in (([1, 2], 2, 2), ([1, 2, 3], 1, 3))]
    monkeypatch.setattr(front, "_client", lambda url: client_sending((last, state), link, turn))
    answers = list(front.remote_decode("decode:1", "decode", {}, timeout_s=5, turn=turn))
    assert [type(answer).__name__ for answer in answers] == ["LinkAnswer", "LinkAnswer", "Streamed", "Streamed"]
    assert answers[1].as_numpy("_ids").tolist() == [1, 2, 3] and answers[1].as_numpy("output_tokens").tolist() == [3]
    assert answers[0].as_numpy("applied_adapter")[0] == b"chat" and answers[0].as_numpy("_last").tolist() == [False]
    assert answers[2] is last and answers[3] is state

    dropped = LinkTurn(SimpleNamespace(forget=lambda turn: None), 2)  # decode cancelled it: an empty final
    monkeypatch.setattr(front, "_client", lambda url: client_sending([Streamed(final=True)]))
    with pytest.raises(RequestError, match="without its last answer"):
        list(front.remote_decode("decode:1", "decode", {}, timeout_s=5, turn=dropped))


def test_a_token_link_hands_each_entry_to_its_turn_and_fails_them_all_when_it_breaks():
    """The link's responses (decode's `_link_batch`) go entry by entry to the turns they name, each with the fixed
    outputs of its first; an entry of a turn that has ended is dropped. An error on the link fails every turn
    waiting on it, and the link is not used again (TokenLinks opens another)."""
    import json
    import threading

    from python_backend.triton.token_link import TokenLink

    link = TokenLink.__new__(TokenLink)  # its stream is not opened: the responses are handed in below
    link.id, link.alive, link._turns, link._lock, link.on_idle = 7, True, {}, threading.Lock(), lambda link: None
    link._numbers = iter(range(1, 10))
    first, second = link.turn(), link.turn()
    gone = link.turn()
    gone.close()
    batch = [{"turn": 1, "ids": [4, 5], "fresh": 2, "output_tokens": 2, "meta": {"applied_adapter": "chat"}},
             {"turn": 2, "ids": [6], "fresh": 1, "output_tokens": 1, "meta": {"applied_adapter": "coding"}},
             {"turn": 3, "ids": [9], "fresh": 1, "output_tokens": 1},
             {"turn": 1, "ids": [4, 5, 8], "fresh": 1, "output_tokens": 3}]
    link._on_response(Streamed(_link_batch=np.array([json.dumps(batch).encode()], dtype=object)), None)
    answers = [first.queue.get_nowait()[0] for _ in range(2)]
    assert [answer.as_numpy("_ids").tolist() for answer in answers] == [[4, 5], [4, 5, 8]]
    assert [answer.as_numpy("applied_adapter")[0] for answer in answers] == [b"chat", b"chat"]
    assert second.queue.get_nowait()[0].as_numpy("applied_adapter")[0] == b"coding"
    assert gone.queue.empty() and first.queue.empty()

    link._on_response(None, "connection reset")
    assert not link.alive
    for turn in (first, second):
        result, error = turn.queue.get_nowait()
        assert result is None and "its token link failed: connection reset" in error

    closed = TokenLink.__new__(TokenLink)  # closed by its relay: the cancellation that follows fails nothing
    closed.alive, closed._turns, closed._lock, closed.on_idle = False, {}, threading.Lock(), lambda link: None
    closed._numbers = iter(range(1, 10))
    waiting = closed.turn()
    closed._on_response(None, "Locally cancelled by application!")
    assert waiting.queue.empty()


def test_token_links_close_a_link_that_has_had_no_turn_for_a_while(monkeypatch):
    """A decode server holds a relay's link as a request in flight, which a stopping tritonserver waits for: the
    relay closes a link once its last turn has been gone LINK_IDLE_S, never one a turn is on."""
    import time

    import python_backend.triton.token_link as token_link

    monkeypatch.setattr(token_link, "LINK_IDLE_S", 0.01)
    closed = []

    class Link:  # what TokenLinks asks of a link
        alive = True

        def __init__(self, turns):
            self.turns = turns

        def idle(self):
            return self.turns == 0

        def close(self):
            closed.append(self)

    links = token_link.TokenLinks(SEALER)
    busy, idle = Link(1), Link(0)
    links._links = {("a:1", "decode"): busy, ("b:1", "decode"): idle}
    for link in (busy, idle):
        links._when_idle(link)  # as each one's last turn ended; `busy` has a turn again since
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the other timer has fired too
    assert closed == [idle] and list(links._links.values()) == [busy]
