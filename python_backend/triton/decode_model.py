"""The `decode` Triton model (decoupled): maps the transfer's adapter hash through this server's registry, replays W
positions under that adapter, then streams token ids (one response per token with `stream`, else one aggregated
response) for the `detokenize` step to turn into text (python_backend/core/stages.py's DecodeStage).

With `_return_state` (a disaggregated prefill server's relay) the final state comes back in `_state_out`, in a last
response of its own, sealed in `_state_seal`, and the store is not touched: the prefill server owns it. `_state`
and `_state_out` are deltas where they can be (python_backend/core/delta_transfer.py): this model keeps each
conversation's final state, up to `transfer_cache_mb`, and a delta on a state it does not hold is refused first.
Internal: a request without its caller's seal over the conversation, the transfer and the state
(python_backend/core/seal.py) is refused before anything is read, written, locked or unlocked. `pb` is passed in, so it
is tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass

from ced.batched import BatchedEngine

from ..core.delta_transfer import DecodeTransfers, cache_bytes
from ..core.detokenize import window
from ..core.inputs import generation
from ..core.seal import DECODE, RETURNED, Sealer, decode_fields, returned_fields
from ..core.serving import Served
from ..core.settings import ServingSettings, triton_parameters
from ..core.stages import DecodeRequest, DecodeStage, TransferMeta
from .metrics import Counters
from .triton_io import (Outputs, as_scalar, as_text, failure_response, optional, requested_outputs, require_decoupled,
                        required, response)


@dataclass
class ParsedDecode:
    request: DecodeRequest
    stream: bool
    scores: str  # the router's scores (JSON), passed on to the client


class DecodeModel:
    def __init__(self, pb, model_config: dict):
        require_decoupled(pb, model_config, "decode")
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.served = Served.open(ServingSettings.from_parameters(triton_parameters(model_config)))
        batched = BatchedEngine(self.served.engine) if self.served.settings.engine == "torch" else None
        self.counters = Counters(pb, "decode")
        transfers = DecodeTransfers(self.served.engine.config,
                                    cache_bytes(triton_parameters(model_config).get("transfer_cache_mb", "auto")),
                                    self.counters.count)
        self.stage = DecodeStage(self.served.engine, self.served.store, self.served.tokenizer,
                                 self.served.load_errors, batched, transfers)
        self.sealer = Sealer.from_environment()

    def finalize(self) -> None:
        self.counters.close()

    def execute(self, requests) -> None:
        changes = self.served.refresh()  # live configuration: the adapter-set file changed
        if changes:
            self.pb.Logger.log_info(f"adapter set changed: {'; '.join(changes)}")
        for request in requests:
            sender = request.get_response_sender()
            try:  # refused here, the request has touched nothing: no lock is taken or released
                parsed = self.parse(request)
            except Exception as error:  # noqa: BLE001 - this request's error response, the others go on
                sender.send(failure_response(self.pb, error, "decode"), flags=self.final)
                continue
            try:
                self.serve(parsed, sender, requested_outputs(request))
            except Exception as error:  # noqa: BLE001
                self._end_turn_here(parsed.request)  # idempotent: the stage may have ended it already
                sender.send(failure_response(self.pb, error, "decode"), flags=self.final)

    def parse(self, request) -> ParsedDecode:
        """The request, its seal checked (a SealError is the client's 400, as any ValueError)."""
        pb = self.pb
        get = lambda name, kind, default: as_scalar(optional(pb, request, name), name, kind, default)  # noqa: E731
        max_tokens, sampling = generation(get)
        decode_request = DecodeRequest(
            as_text(required(pb, request, "_conversation_id"), "_conversation_id"),
            required(pb, request, "_state").tobytes(),
            TransferMeta.from_tensor(required(pb, request, "_routed_meta").reshape(-1)), max_tokens, sampling,
            bool(get("end_conversation", bool, False)), bool(get("_return_state", bool, False)))
        parsed = ParsedDecode(decode_request, bool(get("stream", bool, False)),
                              as_text(optional(pb, request, "_route_scores"), "_route_scores") or "{}")
        self.sealer.check(DECODE, as_text(optional(pb, request, "_seal"), "_seal"), **decode_fields(
            decode_request.conversation_id, decode_request.meta.length, decode_request.meta.adapter_hash,
            decode_request.state, decode_request.return_state, decode_request.end_conversation))
        return parsed

    def _end_turn_here(self, decode_request: DecodeRequest) -> None:
        """A sealed turn refused here ends here, unless a disaggregated prefill server holds its lock (it ends it
        there)."""
        if not decode_request.return_state:
            self.served.store.end_turn(decode_request.conversation_id)

    def serve(self, parsed: ParsedDecode, sender, wanted: frozenset[str]) -> None:
        decode_request = parsed.request
        self.stage.receive(decode_request)  # a delta on a state not held here is refused before anything counts
        self.counters.add("mol2_routes_read", str(decode_request.meta.adapter_hash))
        adapter = self.stage.adapter_for(self.served.watcher.current, decode_request.meta.adapter_hash) or "base"
        ids, replayed = [], 0

        def respond(fresh: int, last: bool):
            """The newest `fresh` ids (after a few earlier ones, for detokenize) and the turn's metadata; only the
            outputs the request asked for (triton_io.response)."""
            return response(self.pb, self.outputs.tensors(
                _ids=window(ids, fresh), _fresh=fresh, _last=last, applied_adapter=adapter, replayed_tokens=replayed,
                output_tokens=len(ids), route_scores=parsed.scores,
                conversation_id_out=decode_request.conversation_id), wanted)

        tokens = self.stage.run(self.served.watcher.current, decode_request)
        for token, replayed in tokens:
            if sender.is_cancelled():  # the client went away: stop now; the turn is dropped, nothing is stored
                tokens.close()
                sender.send(flags=self.final)
                return
            if not ids:
                self.counters.add("mol2_routes_applied", adapter)
                self.counters.add("mol2_replayed_tokens", adapter, replayed)
            ids.append(token)
            if parsed.stream:
                sender.send(respond(1, False))
        self.counters.add("mol2_requests", adapter)
        # Streamed: the last response adds no ids, it flushes a character left unfinished (and carries FINAL).
        last = [respond(0 if parsed.stream else len(ids), True)]
        if decode_request.return_state:
            state, conversation_id = decode_request.final_state, decode_request.conversation_id
            seal = self.sealer.seal(RETURNED, **returned_fields(conversation_id, state))
            last.append(response(self.pb, self.outputs.tensors(_state_out=state, _state_seal=seal), wanted))
        for earlier in last[:-1]:
            sender.send(earlier)
        sender.send(last[-1], flags=self.final)
