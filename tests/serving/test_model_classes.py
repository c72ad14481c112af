"""Each Triton model's class without a server (a fake `triton_python_backend_utils`): a good request gets its outputs
in the dtypes its config.pbtxt declares; a client's error is that request's 400 and an error of ours that request's
logged 500, while the others of the batch are served."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from python_backend.triton.decode_model import DecodeModel
from python_backend.triton.prefill_model import PrefillModel
from python_backend.triton.relay_model import RelayModel
from python_backend.server.roles import relay_config
from python_backend.triton.route_model import RouteModel
from python_backend.triton.router_model import RouterModel
from python_backend.core.seal import DECODE, LINK, PREFILL, SECRET_VARIABLE, Sealer, create_secret_file, \
    decode_fields, link_fields, prefill_fields
from python_backend.core.settings import ROOT
from python_backend.triton.tokenize_model import TokenizeModel
from python_backend.triton.triton_io import Outputs

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code="UNKNOWN"):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.tensors, self._error = {t.name(): t.as_numpy() for t in output_tensors}, error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class Sender:
    def __init__(self):
        self.sent = []  # (response or None, flags)

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


def array(value) -> np.ndarray:
    return np.array([value.encode()], dtype=object) if isinstance(value, str) else np.asarray(value)


class Request:
    def __init__(self, wanted=(), **inputs):
        self.inputs = {name: Tensor(name, array(value)) for name, value in inputs.items()}
        self.wanted, self.sender = wanted, Sender()

    def requested_output_names(self):
        return list(self.wanted)

    def get_response_sender(self):
        return self.sender


class TritonModelException(Exception):
    pass


@pytest.fixture()
def pb():
    """The pieces of triton_python_backend_utils the models use. BLS calls reach the classes in `pb.models`."""
    logged, counts, models = [], Counter(), {}

    class MetricFamily:
        COUNTER = "counter"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):  # noqa: N802 - Triton's name
            # by adapter; a counter without one (the transfer's bytes) by its other labels
            key = labels.get("adapter") or tuple(sorted((k, v) for k, v in labels.items() if k != "stage"))
            return SimpleNamespace(increment=lambda value: counts.update({(self.name, key): value}))

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs):
            self.model_name, self.inputs = model_name, {t.name(): t.as_numpy() for t in inputs}

        def exec(self):
            return models[self.model_name].execute([Request(**self.inputs)])[0]

    return SimpleNamespace(
        Tensor=Tensor, TritonError=TritonError, InferenceResponse=InferenceResponse, InferenceRequest=InferenceRequest,
        MetricFamily=MetricFamily, TritonModelException=TritonModelException,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        Logger=SimpleNamespace(log_error=logged.append, log_info=lambda message: None),
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
        get_output_tensor_by_name=lambda response, name: Tensor(name, response.tensors[name]),
        using_decoupled_model_transaction_policy=lambda config: config["model_transaction_policy"]["decoupled"],
        logged=logged, counts=counts, models=models)


def config_of(text: str, **parameters) -> dict:
    """The parts of a model's config (as Triton passes it to `initialize`) the classes read, from config.pbtxt."""
    outputs = text.split("output [")[1].split("instance_group")[0]
    return {"output": [{"name": name, "data_type": kind}
                       for name, kind in re.findall(r'name: "(\w+)" data_type: (TYPE_\w+)', outputs)],
            "model_transaction_policy": {"decoupled": "decoupled: true" in text},
            "parameters": {name: {"string_value": str(value)} for name, value in parameters.items()}}


@pytest.fixture()
def config(served_dir, tmp_path, monkeypatch):
    """name -> that model's config, its settings pointing at the tiny served model and a fresh store."""
    monkeypatch.setenv(SECRET_VARIABLE, str(create_secret_file(tmp_path / "server.secret")))
    settings = dict(model_dir=served_dir / "model", adapter_set=served_dir / "adapter_set.json",
                    store_dir=tmp_path / "store", router_dir=served_dir / "router", engine="torch",
                    router_model="router")
    return lambda name: config_of((ROOT / "model_repository" / name / "config.pbtxt").read_text(), **settings)


def declared(config: dict) -> dict[str, type]:
    return {output["name"]: Outputs(None, config).dtypes[output["name"]] for output in config["output"]}


def assert_outputs(response, config: dict, names=None) -> None:
    """No error, the outputs asked for (all by default), each in the dtype its config declares."""
    assert not response.has_error(), response.error().message()
    dtypes = declared(config)
    assert set(response.tensors) == set(dtypes if names is None else names)
    for name, value in response.tensors.items():
        assert value.dtype == dtypes[name], name


def assert_refused(response, text: str) -> None:
    assert response.has_error() and response.error().code() == "INVALID_ARG"
    assert text in response.error().message(), response.error().message()


def assert_failed_here(response, pb, model: str) -> None:
    """Ours: a 500 naming the model (the wording bls_call tells failures by), its traceback logged."""
    assert response.has_error() and response.error().code() == "INTERNAL"
    assert response.error().message() == f"{model} failed: RuntimeError: boom"
    assert len(pb.logged) == 1 and "Traceback" in pb.logged[0] and "boom" in pb.logged[0]


def fail_when(target, method: str, when) -> None:
    """`target.method` raises RuntimeError("boom") (a bug of ours) on the calls `when(*args)` picks."""
    real = getattr(target, method)

    def replaced(*args, **kwargs):
        if when(*args):
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    setattr(target, method, replaced)


def test_tokenize(pb, config):
    model = TokenizeModel(pb, config("tokenize"))
    fail_when(model.tokenizer, "encode", lambda text: text == "bug")
    good, empty, bug = model.execute([Request(text_input="hello"), Request(text_input=""), Request(text_input="bug")])
    assert_outputs(good, config("tokenize"))
    assert good.tensors["_text_ids"].tolist() == model.tokenizer.encode("hello")
    assert_refused(empty, "text_input is empty")
    assert_failed_here(bug, pb, "tokenize")


def test_tokenize_refuses_oversized_and_invalid_text_before_tokenizing(pb, config):
    model = TokenizeModel(pb, config("tokenize"))
    fail_when(model.tokenizer, "encode", lambda text: True)  # any tokenizing is a failure here
    limit = model.limits.max_prompt_tokens * model.tokenizer.max_token_bytes
    huge = Request(text_input="x" * (limit + 1))
    surrogate = Request(text_input=np.array([b"ab\xed\xa0\x80"], dtype=object))  # "\ud800" as CESU bytes
    huge_answer, surrogate_answer = model.execute([huge, surrogate])
    assert_refused(huge_answer, f"text_input is {limit + 1:,} bytes")
    assert "max_prompt_tokens" in huge_answer.error().message()
    assert_refused(surrogate_answer, "text_input is not valid UTF-8 text")
    assert "ed a0 80" in surrogate_answer.error().message()
    assert not pb.logged  # refusals, not failures of ours


def sealed_prefill(ids, conversation_id=None, route_only=False) -> Request:
    seal = Sealer.from_environment().seal(PREFILL, **prefill_fields(conversation_id, route_only, ids))
    inputs = dict(_text_ids=np.asarray(ids, np.int64), _seal=seal, _route_only=[route_only])
    return Request(**inputs, **({"conversation_id": conversation_id} if conversation_id else {}))


def test_prefill(pb, config):
    model = PrefillModel(pb, config("prefill"))
    fail_when(model.scheduler.engine, "check", lambda row, chunk: 66 in chunk)  # a bug of ours on that turn alone
    unsealed = Request(_text_ids=np.array([104, 105]))
    good, refused, bug = model.execute([sealed_prefill([104, 105]), unsealed, sealed_prefill([66])])
    assert_outputs(good, config("prefill"))
    assert good.tensors["_transfer_meta"].tolist()[1] == 0 and good.tensors["_state"].size > 0
    assert_refused(refused, "prefill is an internal stage")
    assert_failed_here(bug, pb, "prefill")


def test_router(pb, config):
    model = RouterModel(pb, config("router"))
    fail_when(model.stage, "run", lambda adapter_set, h19, explicit: explicit == "coding")
    h19 = np.zeros(model.hidden_size, np.float32)
    meta = np.array([12, 0], np.int64)
    routed, named, unknown, bug = model.execute([Request(_h19=h19, _transfer_meta=meta),
                                                 Request(_h19=h19, _transfer_meta=meta, adapter="chat"),
                                                 Request(_h19=h19, _transfer_meta=meta, adapter="nope"),
                                                 Request(_h19=h19, _transfer_meta=meta, adapter="coding")])
    for response in (routed, named):
        assert_outputs(response, config("router"))
    assert named.tensors["_route_adapter"][0] == b"chat"
    assert named.tensors["_routed_meta"][0] == 12
    assert routed.tensors["_route_scores"][0].startswith(b"{")
    assert_refused(unknown, "unknown adapter 'nope'")
    assert_failed_here(bug, pb, "router")
    assert pb.counts[("mol2_routes_written", "chat")] >= 1
    model.finalize()


def test_route_through_bls(pb, config):
    """route -> tokenize -> prefill -> router, each the class its model.py wires, called through the fake BLS."""
    route = RouteModel(pb, config("route"))
    pb.models.update(tokenize=TokenizeModel(pb, config("tokenize")), prefill=PrefillModel(pb, config("prefill")),
                     router=RouterModel(pb, config("router")))
    fail_when(pb.models["tokenize"].tokenizer, "encode", lambda text: text == "bug")
    good, empty, bug = route.execute([Request(text_input="hello"), Request(text_input=""), Request(text_input="bug")])
    assert_outputs(good, config("route"))
    assert good.tensors["adapter"][0].decode() in ("chat", "coding")
    assert_refused(empty, "text_input is empty")  # tokenize's 400 stays the client's
    # tokenize's failure is ours twice over: logged there, and the route model's own 500
    assert bug.error().code() == "INTERNAL"
    assert bug.error().message().startswith("route failed: StageFailure: tokenize: tokenize failed: RuntimeError")
    assert len(pb.logged) == 2


def decode_request(pb, config, conversation_id: str, wanted=(), stream=False, return_state=False,
                   link: int = 0, link_turn: int = 0) -> Request:
    """A sealed decode request for a new turn, prefilled and routed (to `chat`) by the classes themselves; with
    `link`, as a relay sends a turn whose tokens go on its token link (turn `link_turn` there)."""
    prefilled = PrefillModel(pb, config("prefill")).execute([sealed_prefill([104, 105], None)])[0].tensors
    routed = RouterModel(pb, config("router")).execute([Request(_h19=prefilled["_h19"], adapter="chat",
                                                                _transfer_meta=prefilled["_transfer_meta"])])[0]
    meta = routed.tensors["_routed_meta"]
    seal = Sealer.from_environment().seal(DECODE, **decode_fields(
        conversation_id, meta[0], meta[1], prefilled["_state"].tobytes(), return_state, False, link, link_turn))
    linked = {"_link": np.array([link], np.int64), "_link_turn": np.array([link_turn], np.int64)} if link else {}
    return Request(wanted, _state=prefilled["_state"], _routed_meta=meta, _conversation_id=conversation_id,
                   _route_scores="{}", max_tokens=np.array([3], np.int32), stream=[stream], _seal=seal,
                   _return_state=[return_state], **linked)


def test_decode(pb, config):
    model = DecodeModel(pb, config("decode"))
    assert model.scheduler is not None  # the torch engine: every turn is a handed turn of one batched loop
    fail_when(model.served.store, "save", lambda conversation_id, state: conversation_id == "c3")  # after its tokens
    asked = ("_ids", "_fresh", "_last", "output_tokens")  # decoupled: only these may be sent
    # as the ensemble asks; `logprobs` comes only when the request asks for them, as the engine model's
    everything = tuple(set(declared(config("decode"))) - {"_state_out", "_state_seal", "logprobs", "_link_batch"})
    streamed, whole = decode_request(pb, config, "c1", asked, stream=True), decode_request(pb, config, "c2", everything)
    unsealed = decode_request(pb, config, "c9")
    unsealed.inputs.pop("_seal")
    bug = decode_request(pb, config, "c3")
    model.execute([streamed, unsealed, whole, bug])
    assert model.idle()  # the scheduler's thread sends the responses

    *tokens, (last, flags) = streamed.sender.sent
    # a response per token, or fewer carrying several where the responder fell behind (test_decode_coalesces...)
    assert sum(int(r.tensors["_fresh"][0]) for r, _ in tokens) == 3 and all(f == 0 for _, f in tokens)
    assert flags == FINAL
    for response, _ in streamed.sender.sent:
        assert_outputs(response, config("decode"), asked)
    assert last.tensors["output_tokens"].tolist() == [3] and last.tensors["_fresh"].tolist() == [0]
    (response, flags), = whole.sender.sent
    assert flags == FINAL
    assert_outputs(response, config("decode"), everything)
    assert response.tensors["applied_adapter"][0] == b"chat" and response.tensors["_fresh"].tolist() == [3]
    assert model.served.store.exists("c1") and model.served.store.exists("c2")

    (refused, flags), = unsealed.sender.sent
    assert flags == FINAL and not model.served.store.exists("c9")
    assert_refused(refused, "decode is an internal stage")
    (failed, flags), = bug.sender.sent
    assert flags == FINAL
    assert_failed_here(failed, pb, "decode")
    model.served.store.begin_turn("c3")  # its turn lock was released: a next turn may take it
    model.served.store.end_turn("c3")
    assert pb.counts[("mol2_requests", "chat")] == 2
    model.finalize()


def test_decode_returns_the_state_to_a_prefill_server(pb, config):
    model = DecodeModel(pb, config("decode"))
    wanted = tuple(declared(config("decode")))
    request = decode_request(pb, config, "c1", wanted, return_state=True)
    model.execute([request])
    assert model.idle()
    (answer, flags), (state, final) = request.sender.sent
    assert (flags, final) == (0, FINAL)
    assert_outputs(answer, config("decode"), set(wanted) - {"_state_out", "_state_seal", "logprobs", "_link_batch"})
    assert_outputs(state, config("decode"), {"_state_out", "_state_seal"})
    assert not model.served.store.exists("c1")  # the prefill server owns the store
    sent = request.inputs["_state"].as_numpy().nbytes  # a whole state came; a delta on it goes back; both counted
    assert pb.counts[("mol2_transfer_bytes_total", (("direction", "to_decode"), ("kind", "full")))] == sent
    returned = state.tensors["_state_out"].nbytes
    assert pb.counts[("mol2_transfer_bytes_total", (("direction", "to_prefill"), ("kind", "delta")))] == returned
    assert returned > 0
    model.finalize()


def test_decode_batches_the_turns_it_is_handed(pb, config):
    """A decode server's turns share the scheduler's decode steps (it served them one after another before): eight
    turns handed over together decode as one batch, each answered in full."""
    model = DecodeModel(pb, config("decode"))
    requests = [decode_request(pb, config, f"b{i}", ("_ids", "output_tokens"), return_state=True) for i in range(8)]
    steps_before = model.scheduler.stats.decode_steps
    model.execute(requests)
    assert model.idle()
    for request in requests:
        *_, (last, flags) = request.sender.sent
        assert flags == FINAL and not last.has_error()
    # one after another, 8 turns of 3 tokens take 24 steps of one row; together, a few steps of many rows (turns
    # handed over while the loop runs may join a step or two later)
    stats = model.scheduler.stats
    steps = stats.decode_steps - steps_before
    assert steps <= 8 and stats.decode_rows == 24 and stats.decode_rows / stats.decode_steps >= 3, stats
    model.finalize()


def test_decode_sends_a_relays_streamed_tokens_on_its_token_link(pb, config):
    """A relay's token link (`_link_open`, sealed): the streamed turns that name it get their tokens there, every
    turn's that the responder has in one response (`_link_batch`), each turn's ids in order, its fixed outputs with
    its first; its own stream carries only its last answer, which counts them. A turn naming a link that is not open
    streams on its own stream; an unsealed `_link_open` is refused; a link whose relay went is ended and forgotten
    (at once when the responder is idle)."""
    model = DecodeModel(pb, config("decode"))
    link = Request(("_link_batch",), _link_open=np.array([7], np.int64),
                   _seal=Sealer.from_environment().seal(LINK, **link_fields(7)))
    forged = Request(("_link_batch",), _link_open=np.array([8], np.int64), _seal="0" * 64)
    model.execute([link, forged])
    (refused, flags), = forged.sender.sent
    assert flags == FINAL and not link.sender.sent
    assert_refused(refused, "does not match")
    asked = ("_ids", "_fresh", "_last", "output_tokens", "applied_adapter")
    turns = [decode_request(pb, config, f"l{i}", asked, stream=True, link=7, link_turn=i + 1) for i in range(4)]
    alone = decode_request(pb, config, "l9", asked, stream=True, link=99, link_turn=1)
    held, gate = threading.Event(), threading.Event()  # the responder waits until every turn is decoded, so one
    model._responses.put(lambda: held.set() or gate.wait())  # pass has all their tokens
    assert held.wait(60)
    model.execute(turns + [alone])
    deadline = time.monotonic() + 60
    while model._responses.qsize() < 2 * len(turns + [alone]) and time.monotonic() < deadline:
        time.sleep(0.01)  # each turn's tokens, then its end
    gate.set()
    assert model.idle()
    drained = threading.Event()  # the link's response is queued behind the turns' last answers
    model._responses.put(drained.set)
    assert drained.wait(60)

    *tokens, (last, flags) = alone.sender.sent  # on its own stream
    assert flags == FINAL and all(flags == 0 for _, flags in tokens)
    alone_ids = [i for response, _ in tokens for i in response.tensors["_ids"][-int(response.tensors["_fresh"][0]):]]
    assert len(alone_ids) == 3
    (batch, flags), = link.sender.sent  # one response for the four turns' tokens
    entries = json.loads(batch.tensors["_link_batch"][0])
    assert flags == 0 and sorted(entry["turn"] for entry in entries) == [1, 2, 3, 4]
    for i, (entry, turn) in enumerate(zip(sorted(entries, key=lambda entry: entry["turn"]), turns)):
        (last, flags), = turn.sender.sent  # its last answer, sent before the batch here: the relay waits for it
        assert flags == FINAL and last.tensors["_last"].tolist() == [True]
        assert entry["fresh"] == entry["output_tokens"] == int(last.tensors["output_tokens"][0]) == 3
        assert entry["ids"][-3:] == alone_ids  # the same turn, greedy: the same tokens whichever way they go
        assert entry["meta"]["applied_adapter"] == "chat" and entry["meta"]["conversation_id_out"] == f"l{i}"
    assert pb.counts[("mol2_link_tokens_total", ())] == 12
    link.sender.is_cancelled = lambda: True  # its relay stopped: the idle responder ends the link (else Triton
    deadline = time.monotonic() + 10          # waits for that request to finish when it stops)
    while model.links and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not model.links and link.sender.sent[-1] == (None, FINAL)
    model.finalize()


def test_decode_holds_a_turns_tokens_for_its_stream_interval(pb, config, monkeypatch):
    """`mol2 serve --stream-interval-ms`: after a turn's first response its tokens wait out the interval, gathered
    into the next response; those still held when the turn ends go out before its last response. Nothing is lost."""
    monkeypatch.setenv("MOL2_STREAM_INTERVAL_MS", "60000")
    model = DecodeModel(pb, config("decode"))
    assert model.stream_interval_s == 60.0
    request = decode_request(pb, config, "h1", ("_ids", "_fresh", "_last", "output_tokens"), stream=True)
    model.execute([request])
    assert model.idle()
    *tokens, (last, final) = request.sender.sent
    # the first token's response, then one more at most: the tokens held (sent with the first where the responder
    # had not sent it yet when they came)
    assert 1 <= len(tokens) <= 2 and all(flags == 0 for _, flags in tokens) and final == FINAL
    assert sum(int(response.tensors["_fresh"][0]) for response, _ in tokens) == 3
    assert last.tensors["output_tokens"].tolist() == [3]
    model.finalize()
    monkeypatch.setenv("MOL2_STREAM_INTERVAL_MS", "-5")
    with pytest.raises(ValueError, match="stream_interval_ms must be a finite number >= 0"):
        DecodeModel(pb, config("decode"))


def test_decode_coalesces_the_tokens_that_wait_for_its_responder(pb, config):
    """The scheduler's thread only queues a handed turn's responses; the tokens that come while the responder is
    busy go out as one response (their `_fresh` count), so a responder that falls behind sends fewer, fuller ones."""
    model = DecodeModel(pb, config("decode"))
    busy, release = threading.Event(), threading.Event()
    model._responses.put(lambda: (busy.set(), release.wait(60)))  # the responder held up, as by a slow send
    assert busy.wait(60)
    request = decode_request(pb, config, "k1", ("_ids", "_fresh", "_last", "output_tokens"), stream=True)
    model.execute([request])
    deadline = time.monotonic() + 60
    while model._responses.qsize() < 2 and time.monotonic() < deadline:  # the turn's tokens and its end queued
        time.sleep(0.01)
    assert request.sender.sent == []
    release.set()
    assert model.idle()
    (tokens, flags), (last, final) = request.sender.sent
    assert (flags, final) == (0, FINAL)
    assert tokens.tensors["_fresh"].tolist() == [3] and tokens.tensors["output_tokens"].tolist() == [3]
    assert last.tensors["_fresh"].tolist() == [0]
    model.finalize()


def test_decode_must_be_decoupled(pb, config):
    coupled = dict(config("decode"), model_transaction_policy={"decoupled": False})
    with pytest.raises(TritonModelException, match="decode must be decoupled"):
        DecodeModel(pb, coupled)


def test_relay(pb, config, served_dir, tmp_path):
    ensemble = (ROOT / "model_repository" / "mol2" / "config.pbtxt").read_text()
    relay_settings = config("prefill")["parameters"] | {
        name: {"string_value": value} for name, value in
        dict(router_model="router", decode_model="decode", decode_url="host:1").items()}
    relay = dict(config_of(relay_config(ensemble, "mol2", "host:1")), parameters=relay_settings)
    model = RelayModel(pb, relay)

    def run(fields, send, cancelled):
        text = fields["text_input"][0].decode()
        if text == "bug":
            raise RuntimeError("boom")
        if not text:
            raise ValueError("text_input is empty")
        send({"text_output": np.array([b"hi"], object), "replayed_tokens": np.array([4], np.int64),
              "output_tokens": np.array([1], np.int64), "applied_adapter": np.array([b"chat"], object),
              "route_scores": np.array([b"{}"], object), "conversation_id_out": np.array([b"c1"], object)}, True)

    model.relay = SimpleNamespace(run=run)
    wanted = ("text_output", "replayed_tokens", "output_tokens")
    good, empty, bug = Request(wanted, text_input="hello"), Request(text_input=""), Request(text_input="bug")
    model.execute([good, empty, bug])
    model.finalize()  # waits for the relay's threads
    (response, flags), = good.sender.sent
    assert flags == FINAL
    assert_outputs(response, relay, wanted)  # int32, as the ensemble declares, whatever came back
    assert_refused(empty.sender.sent[0][0], "text_input is empty")
    assert_failed_here(bug.sender.sent[0][0], pb, "relay")


def test_outputs_follow_the_config():
    config = {"output": [{"name": "n", "data_type": "TYPE_INT64"}, {"name": "s", "data_type": "TYPE_STRING"},
                         {"name": "b", "data_type": "TYPE_UINT8"}]}
    outputs = Outputs(SimpleNamespace(Tensor=Tensor), config)
    n, s, j, b = (outputs.tensor(name, value) for name, value in (("n", 3), ("s", "é"), ("s", {"b": 1, "a": 2}),
                                                                   ("b", b"\x01\x02")))
    assert n.as_numpy().dtype == np.int64 and n.as_numpy().tolist() == [3]
    assert s.as_numpy().tolist() == ["é".encode()]
    assert j.as_numpy().tolist() == [b'{"a": 2, "b": 1}']
    assert b.as_numpy().dtype == np.uint8 and b.as_numpy().tolist() == [1, 2]
