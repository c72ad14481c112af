"""The `decode` Triton model (decoupled): maps the transfer's adapter hash through this server's registry, replays W
positions under that adapter, then streams token ids (a response per token with `stream`, or one for the several
that came while its responder was busy, or within `stream_interval_ms` of a turn's last response; else one aggregated
response) for the relay on the prefill server to turn into text (python_backend/triton/front.py). A streamed turn
that names its relay's open token link gets its tokens there instead, with every other turn's of that relay in one
response a responder pass (`TokenLink`, below; the relay's side: python_backend/triton/token_link.py).

Every request is a handed turn of the scheduler (python_backend/core/scheduler.py), which replays and decodes all
of them together, each under its own adapter (in one batch on torch and ONNX Runtime, a row at a time on TensorRT):
`execute` checks and hands over, the scheduler's thread queues each turn's responses and a responder thread sends
them (a send waits for Triton's process: 16 of those a step held up the decode step).

With `_return_state` (a disaggregated prefill server's relay) the final state comes back in `_state_out`, in a last
response of its own, sealed in `_state_seal` (not on a conversation's last turn: the relay would only drop it), and
the store is not touched: the prefill server owns it. A turn of no conversation (`_conversation_id` empty: the relay's
stateless OpenAI requests) is neither stored nor returned. `_state` and `_state_out` are deltas where they can be
(python_backend/core/delta_transfer.py): this model keeps each conversation's final state, up to
`transfer_cache_mb`, and a delta on a state it does not hold is refused first.
Internal: a request without its caller's seal over the conversation, the transfer and the state
(python_backend/core/seal.py) is refused before anything is read, written, locked or unlocked. `pb` is passed in, so it
is tested without a server.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from ced.engine import SamplingParams

from ..core.delta_transfer import DecodeTransfers, Received, cache_bytes
from ..core.detokenize import window
from ..core.engine_core import token_logprobs
from ..core.inputs import RequestError, generation
from ..core.routing import BASE_NAME, RouteDecision
from ..core.scheduler import CancelledTurn, Scheduler, Turn
from ..core.seal import DECODE, LINK, RETURNED, Sealer, decode_fields, link_fields, returned_fields
from ..core.serving import Served
from ..core.settings import ServingSettings, stream_interval_s, triton_parameters
from ..core.transfer import TransferMeta
from .metrics import Counters
from .triton_io import (Every, Outputs, as_scalar, as_text, failure_response, optional, requested_outputs,
                        require_decoupled, required, response)


@dataclass
class DecodeRequest:
    conversation_id: str
    state: bytes  # the transfer: a full state, or a delta on one this server keeps
    meta: TransferMeta
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_conversation: bool = False
    return_state: bool = False  # disaggregated: the prefill server owns the store and the turn lock
    ignore_eos: bool = False  # generate past the tokenizer's stop tokens (benchmarks)
    link: int = 0  # the relay's token link its streamed tokens go on (0: its own stream), and its turn number there
    link_turn: int = 0
    received: Received | None = None  # the state `state` carries, once resolved (DecodeTransfers.receive)


@dataclass
class ParsedDecode:
    request: DecodeRequest
    stream: bool
    scores: str  # the router's scores (JSON), passed on to the client
    ids: list[int] = field(default_factory=list)  # generated so far
    replayed: int = 0


LINK_CHECK_S = 1.0  # an idle responder looks this often for token links whose relay has gone


class DecodeModel:
    def __init__(self, pb, model_config: dict):
        require_decoupled(pb, model_config, "decode")
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.served = Served.open(ServingSettings.from_parameters(triton_parameters(model_config)))
        self.counters = Counters(pb, "decode")
        self.transfers = DecodeTransfers(self.served.engine.config,
                                         cache_bytes(triton_parameters(model_config).get("transfer_cache_mb", "auto")),
                                         self.counters.count)
        self.sealer = Sealer.from_environment()
        self.stream_interval_s = stream_interval_s(triton_parameters(model_config).get("stream_interval_ms", "auto"))
        self._answered = threading.Condition()
        self._outstanding = 0  # handed turns not answered yet
        # what HandedSink queues: each turn's responses, sent in order by the one responder thread
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._responder = threading.Thread(target=self._respond, name="mol2-decode-responder", daemon=True)
        self._responder.start()
        self.links: dict[int, TokenLink] = {}  # open token links by id (`_link_open`)
        self.scheduler = Scheduler(self.served.serving_engine(), self.served.store, self.served.tokenizer,
                                   self._engine_adapter, self.served.sync_current, prefix_cache_bytes=0).start()

    def finalize(self) -> None:
        self.scheduler.stop()
        self._responses.put(None)
        self._responder.join(timeout=60)
        self.counters.close()

    def _respond(self) -> None:
        while True:
            try:
                work = self._responses.get(timeout=LINK_CHECK_S)
            except queue.Empty:  # idle: end the links whose relay has gone, or Triton waits for them to stop
                work = self._end_closed_links
            if work is None:
                return
            try:
                work()
            except Exception:  # noqa: BLE001 - a client gone mid-stream must not stop the others' responses
                self.pb.Logger.log_error(f"decode: a response could not be sent: {traceback.format_exc()}")

    def _end_closed_links(self) -> None:
        for link in [link for link in self.links.values() if link.sender.is_cancelled()]:
            link.close()

    def idle(self, timeout_s: float = 60.0) -> bool:
        """Whether every handed turn has been answered within `timeout_s` (tests)."""
        with self._answered:
            return self._answered.wait_for(lambda: self._outstanding == 0, timeout_s)

    def _count_outstanding(self, change: int) -> None:
        with self._answered:
            self._outstanding += change
            self._answered.notify_all()

    def _engine_adapter(self, decision: RouteDecision) -> str | None:
        return self.served.adapter_for(self.served.watcher.current, decision.adapter_hash)

    def execute(self, requests) -> None:
        self.served.watcher.poll()  # the scheduler takes a changed set between its steps
        for request in requests:
            sender = request.get_response_sender()
            if optional(self.pb, request, "_link_open") is not None:
                self.open_link(request, sender)
                continue
            try:  # refused here, the request has touched nothing: no lock is taken or released
                parsed = self.parse(request)
            except Exception as error:  # noqa: BLE001 - this request's error response, the others go on
                sender.send(failure_response(self.pb, error, "decode"), flags=self.final)
                continue
            try:
                self.hand_over(parsed, sender, requested_outputs(request))
            except Exception as error:  # noqa: BLE001 - refused before the scheduler took it (and the lock)
                sender.send(failure_response(self.pb, error, "decode"), flags=self.final)

    def parse(self, request) -> ParsedDecode:
        """The request, its seal checked (a SealError is the client's 400, as any ValueError)."""
        pb = self.pb
        get = lambda name, kind, default: as_scalar(optional(pb, request, name), name, kind, default)  # noqa: E731
        max_tokens, sampling = generation(get, optional(pb, request, "stop_token_ids"))
        decode_request = DecodeRequest(
            as_text(required(pb, request, "_conversation_id"), "_conversation_id"),
            required(pb, request, "_state").tobytes(),
            TransferMeta.from_tensor(required(pb, request, "_routed_meta").reshape(-1)), max_tokens, sampling,
            bool(get("end_conversation", bool, False)), bool(get("_return_state", bool, False)),
            bool(get("ignore_eos", bool, False)), int(get("_link", int, 0)), int(get("_link_turn", int, 0)))
        parsed = ParsedDecode(decode_request, bool(get("stream", bool, False)),
                              as_text(optional(pb, request, "_route_scores"), "_route_scores") or "{}")
        self.sealer.check(DECODE, as_text(optional(pb, request, "_seal"), "_seal"), **decode_fields(
            decode_request.conversation_id, decode_request.meta.length, decode_request.meta.adapter_hash,
            decode_request.state, decode_request.return_state, decode_request.end_conversation, decode_request.link,
            decode_request.link_turn))
        return parsed

    def open_link(self, request, sender) -> None:
        """A relay's token link: kept open, its stream carries the tokens of the streamed turns that name it. A
        request without the relay's seal over its id is refused, as any internal input."""
        try:
            link = int(as_scalar(optional(self.pb, request, "_link_open"), "_link_open", int, 0))
            self.sealer.check(LINK, as_text(optional(self.pb, request, "_seal"), "_seal"), **link_fields(link))
            if link == 0 or link in self.links:
                raise RequestError(f"_link_open: link {link} is {'in use' if link else 'not a link id'}")
        except Exception as error:  # noqa: BLE001 - this request's error response, the others go on
            sender.send(failure_response(self.pb, error, "decode"), flags=self.final)
            return
        self.links[link] = TokenLink(self, sender, requested_outputs(request))

    def hand_over(self, parsed: ParsedDecode, sender, wanted: frozenset[str]) -> None:
        """Checks what can be refused before any work (a delta on a state not held here, a length that does not
        match), then gives the turn to the scheduler (which refuses an adapter this server does not have)."""
        decode_request = parsed.request
        received = decode_request.received = self.transfers.receive(decode_request.conversation_id,
                                                                    decode_request.state)
        if received.state.length != decode_request.meta.length:
            raise RequestError(f"transfer says {decode_request.meta.length} tokens, the state holds "
                               f"{received.state.length}")
        self.counters.add("mol2_routes_read", str(decode_request.meta.adapter_hash))
        # Named from the set this request polled; whether it is loaded is asked on the scheduler's thread, once the
        # registry has taken that set (a just-added adapter is not loaded yet here).
        entry = self.served.watcher.current.by_hash(decode_request.meta.adapter_hash)
        decision = RouteDecision(entry.name if entry is not None else BASE_NAME, decode_request.meta.adapter_hash)
        sampling = decode_request.sampling
        stateless = not decode_request.conversation_id  # a relayed OpenAI request: its end state is dropped
        budget = min(decode_request.max_tokens, self.served.engine.config.max_context - received.state.length)
        # a streamed turn's tokens go on its relay's link where that is open here (else, or if it closes: its own)
        link = self.links.get(decode_request.link) if parsed.stream and decode_request.link else None
        self._count_outstanding(+1)
        self.scheduler.submit(Turn(
            decode_request.conversation_id, [], lambda pooled: decision, HandedSink(self, parsed, sender, wanted, link),
            max(budget, 1), sampling, ignore_eos=decode_request.ignore_eos,
            end_conversation=decode_request.end_conversation, explicit=True,
            handed=received.state, returns_state=decode_request.return_state or stateless))

    def respond(self, parsed: ParsedDecode, fresh: int, last: bool, wanted: frozenset[str], adapter: str,
                finish_reason: str = "", logprobs: list | None = None):
        """The newest `fresh` ids (after a few earlier ones, for the relay's detokenizing) and the turn's metadata,
        with the finish reason on the last and, when the request asked, the logprobs of these tokens (JSON, as the
        engine model sends them); only the outputs the request asked for (triton_io.response)."""
        extra = {} if logprobs is None else {"logprobs": json.dumps(logprobs)}
        return response(self.pb, self.outputs.tensors(
            _ids=window(parsed.ids, fresh), _fresh=fresh, _last=last, applied_adapter=adapter,
            replayed_tokens=parsed.replayed, output_tokens=len(parsed.ids), route_scores=parsed.scores,
            conversation_id_out=parsed.request.conversation_id, finish_reason=finish_reason, **extra), wanted)


class HandedSink:
    """A handed turn's responses, made on the scheduler's thread and sent on the model's responder: a response per
    token when streaming (or per run of tokens that waited for the responder), then the last one (and, to a prefill
    server, the state it gets back)."""

    def __init__(self, model: DecodeModel, parsed: ParsedDecode, sender, wanted: frozenset[str],
                 link: TokenLink | None = None):
        self.model, self.parsed, self.sender, self.wanted, self.link = model, parsed, sender, wanted, link
        self._lock = threading.Lock()  # over `_unsent` and `_final` (`cancelled` must not ask a sender once final)
        self._final = False
        self._unsent: list[tuple[int, list | None]] = []  # (token, its logprobs entry) not sent yet
        self._flush_queued = False
        self._hold_until = 0.0  # tokens before then wait for the next response (`stream_interval_s`)
        self._ask = Every()  # Triton is asked at most every CANCEL_CHECK_S

    # The scheduler's thread calls these; what they send is queued for the model's responder (DecodeModel._respond),
    # with what they read of the turn taken now. Tokens wait in `_unsent` until the responder sends them: one
    # response for all that came while it was busy, so a responder that falls behind sends fewer, fuller responses.
    # With a stream interval a turn's tokens also wait that long after its last response: fewer messages a token
    # on both hops of a pair, each token up to the interval later.

    def token(self, token: int, turn: Turn) -> None:
        with self._lock:
            self._unsent.append((token, token_logprobs(turn, turn.logprobs[-1:])))
            if self._flush_queued or (self.model.stream_interval_s and time.monotonic() < self._hold_until):
                return
            self._flush_queued = True
            self._hold_until = time.monotonic() + self.model.stream_interval_s
        self._queue_flush(turn)

    def finished(self, turn: Turn) -> None:
        with self._lock:  # tokens held by the stream interval go before the end
            held, self._flush_queued = bool(self._unsent) and not self._flush_queued, True
        if held:
            self._queue_flush(turn)
        self.model._responses.put(lambda: self._finished(turn))

    def _queue_flush(self, turn: Turn) -> None:
        self.model._responses.put(lambda: self._send_tokens(turn.decision.adapter, turn.replayed))

    def failed(self, error: Exception, turn: Turn) -> None:
        self.model._responses.put(lambda: self._failed(error))

    def _send_tokens(self, adapter: str, replayed: int) -> None:
        with self._lock:
            unsent, self._unsent, self._flush_queued = self._unsent, [], False
        parsed, counters = self.parsed, self.model.counters
        if not parsed.ids:
            parsed.replayed = replayed
            counters.add("mol2_routes_applied", adapter)
            counters.add("mol2_replayed_tokens", adapter, replayed)
        first = not parsed.ids
        parsed.ids.extend(token for token, _ in unsent)
        if parsed.stream:
            logprobs = [entry for _, entries in unsent for entry in entries or ()] or None
            if self.link is not None:
                self.link.add(self._link_entry(len(unsent), first, adapter, logprobs))
            else:
                self.sender.send(self.model.respond(parsed, len(unsent), False, self.wanted, adapter,
                                                    logprobs=logprobs))

    def _link_entry(self, fresh: int, first: bool, adapter: str, logprobs: list | None) -> dict:
        """What `respond` would send for these tokens, as an entry of the link's batch: the ids and their count; the
        turn's fixed outputs with its first tokens only (the relay keeps them for the rest)."""
        parsed = self.parsed
        entry = {"turn": parsed.request.link_turn, "ids": window(parsed.ids, fresh), "fresh": fresh,
                 "output_tokens": len(parsed.ids)}
        if first:
            entry["meta"] = {"applied_adapter": adapter, "replayed_tokens": parsed.replayed,
                             "route_scores": parsed.scores, "conversation_id_out": parsed.request.conversation_id}
        if logprobs is not None:
            entry["logprobs"] = json.dumps(logprobs)
        return entry

    def _finished(self, turn: Turn) -> None:
        model, parsed, request = self.model, self.parsed, self.parsed.request
        model.counters.add("mol2_requests", turn.decision.adapter)
        try:
            # Streamed: the last response adds no ids, it flushes a character left unfinished (and carries FINAL).
            last = [model.respond(parsed, 0 if parsed.stream else len(parsed.ids), True, self.wanted,
                                  turn.decision.adapter, turn.finish_reason,
                                  None if parsed.stream else token_logprobs(turn, turn.logprobs))]
            if request.return_state and request.end_conversation:  # the relay drops it: nothing goes back
                model.transfers.forget(request.conversation_id)
            elif request.return_state:
                state = model.transfers.reply(request.conversation_id, request.received, turn.final_state,
                                                    request.end_conversation)
                seal = model.sealer.seal(RETURNED, **returned_fields(request.conversation_id, state))
                last.append(response(model.pb, model.outputs.tensors(_state_out=state, _state_seal=seal),
                                     self.wanted))
        except Exception as error:  # noqa: BLE001 - the reply could not be made: this turn fails, the loop goes on
            self._failed(error)
            return
        for earlier in last[:-1]:
            self.sender.send(earlier)
        self._send_final(last[-1])

    def _failed(self, error: Exception) -> None:
        if isinstance(error, CancelledTurn):  # the client went away: nothing more to say, the turn is dropped
            self._send_final(None)
        else:
            self._send_final(failure_response(self.model.pb, error, "decode"))

    def cancelled(self) -> bool:
        if not self._ask.due():
            return False
        if self.link is not None and not self.link.alive:  # its tokens have nowhere to go: the relay is gone
            return True
        with self._lock:
            return not self._final and self.sender.is_cancelled()

    def _send_final(self, last) -> None:
        with self._lock:
            self._final = True
        try:
            if last is None:
                self.sender.send(flags=self.model.final)
            else:
                self.sender.send(last, flags=self.model.final)
        finally:
            self.model._count_outstanding(-1)


class TokenLink:
    """A relay's stream for the tokens of all its streamed turns (`_link_open`). What the responder sends for
    every turn on it in one pass goes out as one response, a JSON list of each turn's new ids (`_link_batch`), where
    it was a response for each turn: at 16 streams one message a decode step instead of 16, on every hop between
    here and the relay (this stub's send, Triton's gRPC, the decode server's guard, the relay's client). The
    turn's own stream keeps its first error, its last answer and its state."""

    def __init__(self, model: DecodeModel, sender, wanted: frozenset[str]):
        self.model, self.sender, self.wanted = model, sender, wanted
        self.alive = True
        self._entries: list[dict] = []  # touched on the responder thread only
        self._ask = Every()

    def add(self, entry: dict) -> None:
        """On the responder thread: the entry goes out with the others of this pass (its flush queued behind them)."""
        if not self._entries:
            self.model._responses.put(self._flush)
        self._entries.append(entry)

    def _flush(self) -> None:
        entries, self._entries = self._entries, []
        if not self.alive:
            return
        try:
            if self._ask.due() and self.sender.is_cancelled():
                raise ConnectionError("the relay closed its token link")
            self.sender.send(response(self.model.pb, self.model.outputs.tensors(_link_batch=json.dumps(entries)),
                                      self.wanted))
            self.model.counters.count("mol2_link_tokens_total", sum(entry["fresh"] for entry in entries))
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """The relay is gone: its turns are cancelled (HandedSink.cancelled), the link forgotten and ended."""
        self.alive = False
        for link, open_link in list(self.model.links.items()):
            if open_link is self:
                del self.model.links[link]
        try:
            self.sender.send(flags=self.model.final)
        except Exception:  # noqa: BLE001 - already ended by Triton (the client cancelled it)
            pass
