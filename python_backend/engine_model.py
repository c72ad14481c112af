"""The `engine` Triton model: one decoupled model that runs a whole turn (prefill -> route -> replay -> decode) on
conversations resident in its own pool, every active turn batched by the scheduler. `pb` is passed in, so the
request parsing and the responses are tested without a server.

The router still runs between the adapter-free stage and the decoder inside the request: the scheduler routes a
turn on its pooled H19 when its prefill ends. Requests are only parsed and queued here (`execute` returns at
once); the responder's thread sends every response and asks Triton about cancellations (Responder). With
`--engine onnxruntime` (or tensorrt) the same turn runs serially through the Triton-free stages instead
(python_backend/stages.py), one turn at a time.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
import uuid

import numpy as np

from ced.batched import BatchedEngine
from ced.engine import SamplingParams
from ced.tokenization import check_messages

from .detokenize import check_ids, text_delta, window
from .metrics import Counters
from .scheduler import CancelledTurn, Scheduler, Turn
from .adapter_set import sync_registry
from .serving import Served
from .stages import BASE_NAME, DecodeStage, RouterStage
from .store import check_id
from .triton_io import RequestError, as_scalar, as_text, error_response, optional, required, requested_outputs


class EngineModel:
    def __init__(self, pb, served: Served, scorer, parameters: dict[str, str]):
        self.pb, self.served = pb, served
        self.router = RouterStage(scorer)
        self.decode = DecodeStage(served.engine, served.store, served.tokenizer, served.load_errors)
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.responder = Responder(pb)
        # Increments are round trips to the server process: made on the responder's thread, in order with the
        # responses (a turn's counts are in before its last response goes out), never on the scheduler's.
        self.counters = Counters(pb, "engine", post=self.responder.put)
        self._synced = served.watcher.current  # the set the engine's registry holds (Served.open synced it)
        if served.settings.engine == "torch":
            chunk_threads = engine_setting(parameters, "chunk_threads", len(os.sched_getaffinity(0)))
            prefix_cache_bytes = engine_setting(parameters, "prefix_cache_mb", 1024) << 20
            engine = BatchedEngine(served.engine, chunk_threads=chunk_threads, capacity_bytes=prefix_cache_bytes)
            self.scheduler = Scheduler(engine, served.store, served.tokenizer, self._engine_adapter,
                                       self._sync_adapters, token_budget=int(parameters.get("token_budget", "512")),
                                       max_resident=int(parameters.get("max_resident", "64")),
                                       prefix_cache_bytes=prefix_cache_bytes).start()
            self.serial = None
        else:  # exported graphs: CEDEngine's interface, one conversation per call
            self.scheduler = None
            self.serial = SerialTurns(self)

    def finalize(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        self.responder.flush()  # increments still queued hold their metrics: done before the metrics are dropped
        self.counters.close()

    def _sync_adapters(self) -> list[str]:
        """On the thread that runs the engine, between steps: bring the registry to the set `execute` last read."""
        current = self.served.watcher.current
        if current is self._synced:
            return []
        self._synced = current
        return sync_registry(self.served.engine.adapters, current, self.served.fingerprints, self.served.load_errors)

    def _engine_adapter(self, decision) -> str | None:
        self.counters.add("mol2_routes_read", str(decision.adapter_hash))
        return self.decode.adapter_for(self.served.watcher.current, decision.adapter_hash)

    # -- requests ------------------------------------------------------------------------------------------------

    def execute(self, requests) -> None:
        self.served.watcher.poll()  # the adapter-set file changed: this request already sees the new set
        for request in requests:
            sender = request.get_response_sender()
            try:
                turn = self.parse(request, sender)
            except ValueError as error:
                sender.send(error_response(self.pb, str(error)), flags=self.final)
                continue
            except Exception as error:  # noqa: BLE001 - ours: logged, one line to the client
                self.pb.Logger.log_error(f"engine: {traceback.format_exc()}")
                sender.send(error_response(self.pb, f"engine failed: {type(error).__name__}: {error}", "INTERNAL"),
                            flags=self.final)
                continue
            self.responder.watch(turn.sink)
            if self.scheduler is not None:
                self.scheduler.submit(turn)
            else:
                self.serial.submit(turn)

    def parse(self, request, sender) -> Turn:
        pb = self.pb
        get = lambda name, kind, default: as_scalar(optional(pb, request, name), name, kind, default)  # noqa: E731
        prompt, route_start = self._stateless_prompt(request)
        text_ids = [] if prompt is not None else required(pb, request, "_text_ids").reshape(-1).tolist()
        check_ids(text_ids, self.served.engine.config.vocab_size, "_text_ids")  # a client may send ids directly
        if prompt is None and not text_ids:
            raise RequestError("text_input is empty")
        max_tokens = get("max_tokens", int, 64)
        if not 1 <= max_tokens <= 4096:
            raise RequestError(f"max_tokens must be between 1 and 4096, got {max_tokens}")
        sampling = SamplingParams(temperature=get("temperature", float, 0.0), top_k=get("top_k", int, 0),
                                  top_p=get("top_p", float, 1.0), seed=get("seed", int, None))
        explicit = as_text(optional(pb, request, "adapter"), "adapter")
        adapter_set = self.served.watcher.current
        if explicit:
            self.router.run(adapter_set, None, explicit)  # an unknown name is refused here, before any work
        given = as_text(optional(pb, request, "conversation_id"), "conversation_id")
        if prompt is not None and given:
            raise RequestError("conversation_id cannot be given with messages or prompt: those carry the whole "
                               "history (stateless, served from the prefix cache)")
        conversation_id = "" if prompt is not None else check_id(given) if given else uuid.uuid4().hex
        if given and not self.served.store.exists(conversation_id):
            raise RequestError(f"unknown conversation_id {given!r} (ended, expired or never started)")
        sink = ResponseSink(self, sender, bool(get("stream", bool, False)), requested_outputs(request))
        turn = Turn(conversation_id, text_ids, self._router_for(adapter_set, explicit), sink, max_tokens, sampling,
                    bool(get("ignore_eos", bool, False)), bool(get("end_conversation", bool, False)),
                    explicit=bool(explicit), new=not given and prompt is None, prompt=prompt,
                    route_start=route_start)
        if prompt is None:
            self.served.store.begin_turn(conversation_id)  # a second turn on it is refused until this one ends
        return turn

    def _stateless_prompt(self, request) -> tuple[list[int] | None, int]:
        """A whole chat (`messages`, JSON) or a raw `prompt`, rendered to tokens; (None, 0) for a stateful turn."""
        tokenizer = self.served.tokenizer
        messages = as_text(optional(self.pb, request, "messages"), "messages")
        prompt = as_text(optional(self.pb, request, "prompt"), "prompt")
        if messages is not None and prompt is not None:
            raise RequestError("give messages or prompt, not both")
        if messages is not None:
            try:
                parsed = json.loads(messages)
            except json.JSONDecodeError as error:
                raise RequestError(f"messages is not valid JSON: {error}") from None
            return tokenizer.render(check_messages(parsed))
        if prompt is not None:
            if not prompt:
                raise RequestError("prompt is empty")
            return tokenizer.completion_prompt(prompt), 0
        return None, 0

    def _router_for(self, adapter_set, explicit: str | None):
        def route(pooled):
            decision = self.router.run(adapter_set, pooled, explicit)
            self.counters.add("mol2_routes_written", decision.adapter)
            if decision.routed:
                self.counters.add("mol2_router_decision_ms_total", decision.adapter, decision.decision_ms)
            return decision
        return route


def engine_setting(parameters: dict[str, str], name: str, default: int) -> int:
    """A serving-engine setting from the model's config; `auto` (or absent): MOL2_<NAME>, else `default`."""
    value = parameters.get(name, "auto")
    return int(os.environ.get(f"MOL2_{name.upper()}", default) if value == "auto" else value)


CANCEL_CHECK_S = 0.05


class ResponseSink:
    """Sends a turn's responses: one per token when streaming (the text each adds), else one at the end."""

    def __init__(self, model: EngineModel, sender, stream: bool, wanted: frozenset[str]):
        self.model, self.sender, self.stream, self.wanted = model, sender, stream, wanted
        self.decode = model.served.tokenizer.decode
        self._cancelled = False  # set by the responder (Responder._check_cancelled)
        self._constant: dict[str, np.ndarray] | None = None  # the turn's outputs that never change

    def _send(self, turn: Turn, fresh: int, last: bool, flags: int = 0) -> None:
        """The response for the `fresh` newest ids, built and sent on the responder thread: what it needs of the
        turn is taken now, while the scheduler goes on stepping. Only the outputs the request asked for are built
        (see triton_io.response); what stays the same for the whole turn is encoded once, at its first response."""
        ids, count, pb = window(turn.generated, fresh), len(turn.generated), self.model.pb
        if self._constant is None:
            self._constant = self._turn_outputs(turn)
        finish = turn.finish_reason if last else ""
        dynamic = {"output_tokens": lambda: np.array([count], dtype=np.int32), "finish_reason": lambda: _text(finish)}
        names, constant = self.wanted, self._constant

        def send():
            outputs = {name: constant[name] for name in names if name in constant}
            outputs.update({name: make() for name, make in dynamic.items() if name in names})
            if "text_output" in names:
                outputs["text_output"] = _text(text_delta(self.decode, ids, fresh, last))
            self.sender.send(pb.InferenceResponse([pb.Tensor(name, array) for name, array in outputs.items()]),
                             flags=flags)
        self.model.responder.put(send)

    @staticmethod
    def _turn_outputs(turn: Turn) -> dict[str, np.ndarray]:
        decision = turn.decision
        return {"applied_adapter": _text(decision.adapter if decision else BASE_NAME),
                "route_scores": _text(json.dumps(decision.scores if decision else {}, sort_keys=True)),
                "replayed_tokens": np.array([turn.replayed], dtype=np.int32),
                "conversation_id_out": _text(turn.conversation_id),
                "prompt_tokens": np.array([turn.prompt_tokens], dtype=np.int32),
                "cached_tokens": np.array([turn.cached], dtype=np.int32)}

    def token(self, token: int, turn: Turn) -> None:
        if len(turn.generated) == 1:
            adapter = turn.decision.adapter
            self.model.counters.add("mol2_routes_applied", adapter)
            self.model.counters.add("mol2_replayed_tokens", adapter, turn.replayed)
        if self.stream:
            self._send(turn, 1, False)

    def finished(self, turn: Turn) -> None:
        counters, adapter = self.model.counters, turn.decision.adapter
        counters.add("mol2_requests", adapter)
        counters.add("mol2_state_bytes_written", adapter, turn.bytes_written)
        counters.add("mol2_state_bytes_moved", adapter, turn.bytes_moved)
        self.done()  # before the last response is posted (Responder)
        # Streamed: the last response adds no ids, it flushes a character left unfinished (and carries FINAL).
        self._send(turn, 0 if self.stream else len(turn.generated), True, self.model.final)

    def failed(self, error: Exception, turn: Turn) -> None:
        pb, final = self.model.pb, self.model.final
        self.done()  # before the last response is posted (Responder)
        if isinstance(error, CancelledTurn):
            self.model.responder.put(lambda: self.sender.send(flags=final))
        elif isinstance(error, ValueError):
            message = str(error)
            self.model.responder.put(lambda: self.sender.send(error_response(pb, message), flags=final))
        else:
            pb.Logger.log_error(f"engine: turn failed: {''.join(traceback.format_exception(error))}")
            message = f"engine failed: {type(error).__name__}: {error}"
            self.model.responder.put(lambda: self.sender.send(error_response(pb, message, "INTERNAL"), flags=final))

    def cancelled(self) -> bool:
        """What the responder last heard from Triton: never a round trip on the scheduler's thread."""
        return self._cancelled

    def client_left(self) -> None:
        self._cancelled = True

    def done(self) -> None:
        self.model.responder.forget(self)


def _text(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=object)


class Responder:
    """One thread that builds and sends responses in the order they were posted, so detokenizing and the IPC of
    each response overlap the next step's arithmetic (which runs without the GIL) instead of adding to it.

    The same thread asks Triton, every CANCEL_CHECK_S, whether the client of each watched turn went away. Asked from
    the scheduler's thread, for every active row, those round trips took 6 % of its time at 16 streams (py-spy).
    Here they never overlap a turn's last response: a sink is forgotten before that response is posted, and asking
    a sender after its last response crashes tritonserver (its response factory is gone)."""

    def __init__(self, pb):
        self.pb, self.queue = pb, queue.Queue()
        self._watched: set[ResponseSink] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="mol2-responder", daemon=True).start()

    def put(self, send) -> None:
        self.queue.put(send)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything posted so far has run."""
        done = threading.Event()
        self.queue.put(done.set)
        done.wait(timeout_s)

    def watch(self, sink: "ResponseSink") -> None:
        with self._lock:
            self._watched.add(sink)

    def forget(self, sink: "ResponseSink") -> None:
        with self._lock:
            self._watched.discard(sink)

    def _run(self) -> None:
        next_check = time.monotonic() + CANCEL_CHECK_S
        while True:
            try:
                send = self.queue.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                send = None
            if send is not None:
                try:
                    send()
                except Exception:  # noqa: BLE001 - a client gone mid-stream must not stop the others' responses
                    self.pb.Logger.log_error(f"engine: a response could not be sent: {traceback.format_exc()}")
            if time.monotonic() >= next_check:
                self._check_cancelled()
                next_check = time.monotonic() + CANCEL_CHECK_S

    def _check_cancelled(self) -> None:
        with self._lock:
            sinks = list(self._watched)
        for sink in sinks:
            try:
                cancelled = sink.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - no answer: asked again next time
                continue
            if cancelled:
                sink.client_left()
                self.forget(sink)


class SerialTurns:
    """A worker thread that runs queued turns one at a time through the serial stages (non-torch engines)."""

    def __init__(self, model: EngineModel):
        self.model, self.queue = model, queue.Queue()
        threading.Thread(target=self._run, name="mol2-serial", daemon=True).start()

    def submit(self, turn: Turn) -> None:
        self.queue.put(turn)

    def _run(self) -> None:
        while True:
            turn = self.queue.get()
            try:
                self._serve(turn)
            except Exception as error:  # noqa: BLE001
                turn.sink.failed(error, turn)
            finally:
                if not turn.stateless:
                    self.model.served.store.end_turn(turn.conversation_id)

    def _serve(self, turn: Turn) -> None:
        served, model = self.model.served, self.model
        changes = model._sync_adapters()
        if changes:
            model.pb.Logger.log_info(f"adapter set changed: {'; '.join(changes)}")
        fresh = turn.new or turn.stateless  # a stateless turn is served whole, without a prefix cache here
        state = served.engine.new_conversation() if fresh else served.store.load(turn.conversation_id)
        tokens = turn.prompt if turn.stateless else served.tokenizer.user_turn(turn.text_ids, first=state.length == 0)
        turn.tokens = tokens
        served.store.limits.check_prompt(len(tokens))  # max_prompt_tokens (python_backend/limits.py)
        if state.length + len(tokens) >= served.engine.config.max_context:
            raise RequestError(f"the conversation would reach {state.length + len(tokens)} tokens, over the "
                               f"context limit of {served.engine.config.max_context}")
        h19 = served.engine.prefill(state, tokens)
        skip = turn.route_start if turn.stateless else 1 if turn.new and served.tokenizer.trained else 0
        turn.decision = turn.route(None if turn.explicit else h19[skip:].mean(0))
        adapter = model._engine_adapter(turn.decision)
        logits, turn.replayed = served.engine.replay(state, adapter)
        budget = min(turn.max_tokens, served.engine.config.max_context - state.length)
        stop = () if turn.ignore_eos else served.tokenizer.stop_ids
        for token in served.engine.generate(state, adapter, logits, budget, turn.sampling, stop):
            if turn.sink.cancelled():
                turn.sink.failed(CancelledTurn("cancelled by the client"), turn)
                return
            turn.generated.append(token)
            turn.sink.token(token, turn)
        stopped = bool(turn.generated) and turn.generated[-1] in stop
        turn.finish_reason = "stop" if stopped else "length"
        if turn.stateless:
            turn.sink.finished(turn)
            return
        before = served.store.bytes_written
        if turn.end_conversation:
            served.store.delete(turn.conversation_id)
        else:
            served.store.save(turn.conversation_id, state)
        turn.bytes_written = served.store.bytes_written - before
        turn.sink.finished(turn)
