"""The engine's core: a process of its own, started by the `engine` model's stub (python_backend/triton/engine_model.py),
that parses its requests and runs every turn (prefill -> route -> replay -> decode) on conversations resident in its
pool, all active turns batched by the scheduler.

Why a process: the stub builds and sends every response (six tensors each, ~0.3 ms of Python a response) and asks
Triton about cancellations. In one process with the scheduler those share a GIL, and a 16-row decode step paid for
them almost one for one: 24.5 ms alone, 29 ms beside a thread doing 16 x 0.25 ms of Python a step, 24-25 ms beside
a process doing the same (measured in-process). Here the scheduler's Python runs while the stub's runs on the other
core, and they exchange one message per step (vLLM's V1 engine core does the same).

The stub sends ("requests", [(request id, {input name: array})]), ("cancel", id) and ("stop",);
the core answers with lists of typed events (python_backend/core/events.py: Token, Final, Failed, Count), one list
per decode step and per iteration (Outbox).
The router still runs between the adapter-free stage and the decoder inside the request: the scheduler routes a
turn on its pooled H19 when its prefill ends. With `--engine onnxruntime` (or tensorrt) the scheduler is the same;
it drives ONNX Runtime's pool graphs batched (ced/ort_batched.py), TensorRT's a row at a time (ced/row_engine.py).

Run as `python -m python_backend.core.engine_core FD_IN FD_OUT` (the stub's pipes); the first message is
("init", the model's parameters), answered by ("ready", model dir) or ("failed", traceback).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import sys
import threading
import traceback
import uuid
from multiprocessing.connection import Connection

import numpy as np

from ced.tokenization import check_messages

from .detokenize import check_ids
from .events import Count, Event, Failed, Final, Token
from .inputs import RequestError, as_scalar, as_text, generation, text_size
from .routing import BASE_NAME, RouterStage, load_scorer
from .scheduler import CancelledTurn, Scheduler, Turn
from .server_errors import ENGINE_FAILED, STATE_DAMAGED, STORAGE_FULL
from .serving import Served
from .settings import ServingSettings
from .store import StoreDamaged, check_id

log = logging.getLogger("mol2.engine")


class Outbox:
    """Events to the stub, sent as one message per `flush`."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def post(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def flush(self) -> None:
        with self._lock:
            if not self._events:
                return
            events, self._events = self._events, []
            try:  # pickle's own: Connection.send's ForkingPickler copies its reducer tables on every message
                self.connection.send_bytes(pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # the stub is gone: the main thread sees its pipe close and ends the process
                pass

    def count(self, name: str, adapter: str, value: float = 1.0) -> None:
        self.post(Count(name, adapter, value))


class EngineCore:
    def __init__(self, served: Served, scorer, parameters: dict[str, str], outbox: Outbox):
        self.served, self.outbox = served, outbox
        self.router = RouterStage(scorer)
        self.sinks: dict[int, EventSink] = {}  # request id -> its turn's sink, until its last event
        chunk_threads = engine_setting(parameters, "chunk_threads", len(os.sched_getaffinity(0)))
        prefix_cache_bytes = engine_setting(parameters, "prefix_cache_mb", 1024) << 20
        engine = served.serving_engine(chunk_threads, capacity_bytes=prefix_cache_bytes)
        self.scheduler = Scheduler(engine, served.store, served.tokenizer, self._engine_adapter,
                                   served.sync_current, token_budget=int(parameters.get("token_budget", "512")),
                                   max_resident=int(parameters.get("max_resident", "64")),
                                   prefix_cache_bytes=prefix_cache_bytes, publish=outbox.flush).start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.outbox.flush()

    def _engine_adapter(self, decision) -> str | None:
        self.outbox.count("mol2_routes_read", str(decision.adapter_hash))
        return self.served.adapter_for(self.served.watcher.current, decision.adapter_hash)

    # -- requests ------------------------------------------------------------------------------------------------

    def execute(self, requests: list[tuple[int, dict[str, np.ndarray]]]) -> None:
        self.served.watcher.poll()  # the adapter-set file changed: this request already sees the new set
        for request_id, inputs in requests:
            try:
                turn = self.parse(request_id, inputs)
            except Exception as error:  # noqa: BLE001 - the client's, the server's or ours: error_event says which
                self.outbox.post(error_event(request_id, error))
                continue
            self.sinks[request_id] = turn.sink
            self.scheduler.submit(turn)
        self.outbox.flush()

    def cancel(self, request_id: int) -> None:
        sink = self.sinks.get(request_id)
        if sink is not None:
            sink.client_left()

    def parse(self, request_id: int, inputs: dict[str, np.ndarray]) -> Turn:
        get = lambda name, kind, default: as_scalar(inputs.get(name), name, kind, default)  # noqa: E731
        prompt, route_start = stateless_prompt(inputs, self.served.tokenizer, self.served.store.limits)
        if prompt is None and "_text_ids" not in inputs:
            raise ValueError("missing input '_text_ids'")
        if prompt is None and inputs["_text_ids"].size > self.served.store.limits.max_prompt_tokens:
            self.served.store.limits.check_prompt(inputs["_text_ids"].size)  # before a list of them is made
        text_ids = [] if prompt is not None else inputs["_text_ids"].reshape(-1).tolist()
        check_ids(text_ids, self.served.engine.config.vocab_size, "_text_ids")  # a client may send ids directly
        if prompt is None and not text_ids:
            raise RequestError("text_input is empty")
        max_tokens, sampling = generation(get, inputs.get("stop_token_ids"))
        explicit = as_text(inputs.get("adapter"), "adapter")
        adapter_set = self.served.watcher.current
        if explicit:
            self.router.run(adapter_set, None, explicit)  # an unknown name is refused here, before any work
        given = as_text(inputs.get("conversation_id"), "conversation_id")
        if prompt is not None and given:
            raise RequestError("conversation_id cannot be given with messages or prompt: those carry the whole "
                               "history (stateless, served from the prefix cache)")
        conversation_id = "" if prompt is not None else check_id(given) if given else uuid.uuid4().hex
        if given and not self.served.store.exists(conversation_id):
            raise RequestError(f"unknown conversation_id {given!r} (ended, expired or never started)")
        sink = EventSink(self, request_id, bool(get("stream", bool, False)))
        turn = Turn(conversation_id, text_ids, self._router_for(adapter_set, explicit), sink, max_tokens, sampling,
                    bool(get("ignore_eos", bool, False)), bool(get("end_conversation", bool, False)),
                    explicit=bool(explicit), new=not given and prompt is None, prompt=prompt,
                    route_start=route_start)
        return turn

    def _router_for(self, adapter_set, explicit: str | None):
        def route(pooled):
            decision = self.router.run(adapter_set, pooled, explicit)
            self.outbox.count("mol2_routes_written", decision.adapter)
            if decision.routed:
                self.outbox.count("mol2_router_decision_ms_total", decision.adapter, decision.decision_ms)
            return decision
        return route


def stateless_prompt(inputs: dict[str, np.ndarray], tokenizer, limits) -> tuple[list[int] | None, int]:
    """A whole chat (`messages`, JSON) or a raw `prompt`, rendered to tokens, and where the router's turn starts in
    them; (None, 0) for a stateful turn. The one rendering: the engine's, and a disaggregated relay's
    (python_backend/triton/front.py)."""
    # sizes before any decoding or tokenizing; JSON may spend 6 bytes on one of text (\u00XX) and ~40 on a message
    limits.check_text("messages", text_size(inputs.get("messages")), 6 * tokenizer.max_token_bytes + 64)
    limits.check_text("prompt", text_size(inputs.get("prompt")), tokenizer.max_token_bytes)
    messages = as_text(inputs.get("messages"), "messages")
    prompt = as_text(inputs.get("prompt"), "prompt")
    if messages is not None and prompt is not None:
        raise RequestError("give messages or prompt, not both")
    if messages is not None:
        try:
            parsed = check_messages(json.loads(messages))
        except json.JSONDecodeError as error:
            raise RequestError(f"messages is not valid JSON: {error}") from None
        except RecursionError:
            raise RequestError("messages nests too deeply to be a list of {role, content} objects") from None
        limits.check_text("messages", sum(len(m["content"].encode("utf-8")) for m in parsed),
                          tokenizer.max_token_bytes)
        return tokenizer.render(parsed)
    if prompt is not None:
        if not prompt:
            raise RequestError("prompt is empty")
        return tokenizer.completion_prompt(prompt), 0
    return None, 0


def engine_setting(parameters: dict[str, str], name: str, default: int) -> int:
    """A serving-engine setting from the model's config; `auto` (or absent): MOL2_<NAME>, else `default`."""
    value = parameters.get(name, "auto")
    return int(os.environ.get(f"MOL2_{name.upper()}", default) if value == "auto" else value)


def error_event(request_id: int, error: Exception) -> Failed:
    """The event for a failed request, with the Triton code that sets its HTTP status and, for the
    server's own conditions, the marker of server_errors.py its message starts with (not every path keeps the
    code). A full disk (or quota) is UNAVAILABLE (503): retry once there is room. Stored state found damaged is
    INTERNAL (500), its message saying what was lost. Any other ValueError is the client's: INVALID_ARG (400). The
    rest is a failure of ours: INTERNAL, logged with its traceback."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        log.error("engine: %s", error)
        return Failed(request_id, f"{STORAGE_FULL} {error}", "UNAVAILABLE")
    if isinstance(error, StoreDamaged):
        return Failed(request_id, f"{STATE_DAMAGED} {error}", "INTERNAL")  # the store logged what it moved
    if isinstance(error, ValueError):
        return Failed(request_id, str(error), "INVALID_ARG")
    log.error("engine: %s", "".join(traceback.format_exception(error)))
    return Failed(request_id, f"{ENGINE_FAILED} {type(error).__name__}: {error}", "INTERNAL")


class EventSink:
    """A turn's events for the stub: a token event per token when streaming, one last event either way."""

    def __init__(self, core: EngineCore, request_id: int, stream: bool):
        self.core, self.request_id, self.stream = core, request_id, stream
        self._cancelled = False  # set from the stub's cancel message (EngineCore.cancel)

    def token(self, token: int, turn: Turn) -> None:
        first = len(turn.generated) == 1
        if first:
            adapter = turn.decision.adapter
            self.core.outbox.count("mol2_routes_applied", adapter)
            self.core.outbox.count("mol2_replayed_tokens", adapter, turn.replayed)
        if self.stream:
            self.core.outbox.post(Token(self.request_id, token, turn_outputs(turn) if first else None,
                                        token_logprobs(turn, turn.logprobs[-1:])))

    def finished(self, turn: Turn) -> None:
        outbox, adapter = self.core.outbox, turn.decision.adapter
        outbox.count("mol2_requests", adapter)
        outbox.count("mol2_state_bytes_written", adapter, turn.bytes_written)
        outbox.count("mol2_state_bytes_moved", adapter, turn.bytes_moved)
        self.core.sinks.pop(self.request_id, None)
        ids = None if self.stream else list(turn.generated)  # streamed: the stub has them
        outbox.post(Final(self.request_id, ids, len(turn.generated), turn.finish_reason, turn_outputs(turn),
                          None if self.stream else token_logprobs(turn, turn.logprobs)))

    def failed(self, error: Exception, turn: Turn) -> None:
        self.core.sinks.pop(self.request_id, None)
        cancelled = isinstance(error, CancelledTurn)
        self.core.outbox.post(Failed(self.request_id, None, None) if cancelled else error_event(self.request_id, error))

    def cancelled(self) -> bool:
        return self._cancelled

    def client_left(self) -> None:
        self._cancelled = True


def token_logprobs(turn: Turn, logprobs: list) -> list | None:
    """The `logprobs` output of these tokens, when the request asked: [id, logprob, [[id, logprob], ...]] each."""
    if turn.sampling.logprobs is None:
        return None
    return [[entry.token, entry.logprob, [list(pair) for pair in entry.top]] for entry in logprobs]


def turn_outputs(turn: Turn) -> dict[str, object]:
    """The outputs that stay the same for the whole turn."""
    decision = turn.decision
    return {"applied_adapter": decision.adapter if decision else BASE_NAME,
            "route_scores": json.dumps(decision.scores if decision else {}, sort_keys=True),
            "replayed_tokens": turn.replayed, "conversation_id_out": turn.conversation_id,
            "prompt_tokens": turn.prompt_tokens, "cached_tokens": turn.cached}


def main(fd_in: int, fd_out: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="engine core: %(levelname)s %(message)s")
    inbox, outbox = Connection(fd_in, writable=False), Outbox(Connection(fd_out, readable=False))
    try:
        _, parameters = inbox.recv()
        settings = ServingSettings.from_parameters(parameters)
        served = Served.open(settings)
        core = EngineCore(served, load_scorer(settings, served.engine.model, served.tokenizer), parameters, outbox)
    except BaseException:  # noqa: BLE001 - reported to the stub, which fails the model's load with it
        outbox.connection.send([("failed", traceback.format_exc())])
        sys.exit(1)
    outbox.connection.send([("ready", str(settings.model_dir))])
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):  # the stub is gone (killed with its server): the journal holds what was stored
            os._exit(0)
        if message[0] == "requests":
            core.execute(message[1])
        elif message[0] == "cancel":
            core.cancel(message[1])
        elif message[0] == "stop":
            core.stop()
            os._exit(0)  # daemon threads and torch's teardown need not run: nothing is left to store
        message = None  # not kept until the next one: a refused request's inputs (a prompt of MBs) are freed now


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
