"""Decoupled decode: maps the transfer's adapter hash through this server's registry, replays W positions under
that adapter, then streams token ids (one response per token with `stream`, else one aggregated response) for
the `detokenize` step to turn into text.
With `_return_state` (a disaggregated prefill server's relay) the final state comes back in `_state_out`, in a
last response of its own, sealed in `_state_seal`, and the store is not touched: the prefill server owns it.
Internal: a request without its caller's seal over the conversation, the transfer and the state
(python_backend/seal.py) is refused before anything is read, written, locked or unlocked."""

import json
import traceback

import numpy as np
import triton_python_backend_utils as pb

from ced.batched import BatchedEngine
from ced.engine import SamplingParams
from python_backend.detokenize import window
from python_backend.metrics import Counters
from python_backend.seal import DECODE, RETURNED, Sealer, decode_fields, returned_fields
from python_backend.serving import Served, ServingSettings, triton_parameters
from python_backend.stages import DecodeRequest, DecodeStage, TransferMeta
from python_backend.triton_io import (as_scalar, as_text, error_response, optional, required, requested_outputs,
                                     response, text_tensor)

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(config):
            raise pb.TritonModelException("decode must be decoupled (model_transaction_policy { decoupled: true })")
        self.served = Served.open(ServingSettings.from_parameters(triton_parameters(config)))
        batched = BatchedEngine(self.served.engine) if self.served.settings.engine == "torch" else None
        self.stage = DecodeStage(self.served.engine, self.served.store, self.served.tokenizer,
                                 self.served.load_errors, batched)
        self.counters = Counters(pb, "decode")
        self.sealer = Sealer.from_environment()

    def _parse(self, request) -> tuple[DecodeRequest, bool, str]:
        get = lambda name, kind, default: as_scalar(optional(pb, request, name), name, kind, default)  # noqa: E731
        max_tokens = get("max_tokens", int, 64)
        if not 1 <= max_tokens <= 4096:
            raise ValueError(f"max_tokens must be between 1 and 4096, got {max_tokens}")
        seed = get("seed", int, None)
        sampling = SamplingParams(temperature=get("temperature", float, 0.0), top_k=get("top_k", int, 0),
                                  top_p=get("top_p", float, 1.0), seed=seed)
        conversation_id = as_text(required(pb, request, "_conversation_id"), "_conversation_id")
        decode_request = DecodeRequest(conversation_id, required(pb, request, "_state").tobytes(),
                                       TransferMeta.from_tensor(required(pb, request, "_routed_meta").reshape(-1)),
                                       max_tokens, sampling, bool(get("end_conversation", bool, False)),
                                       bool(get("_return_state", bool, False)))
        return decode_request, bool(get("stream", bool, False)), as_text(optional(pb, request, "_route_scores"),
                                                                          "_route_scores") or "{}"

    def _response(self, ids, fresh, last, adapter, replayed, scores, conversation_id, wanted):
        """The newest `fresh` ids (after a few earlier ones, for detokenize) and the turn's metadata."""
        return response(pb, [pb.Tensor("_ids", np.array(window(ids, fresh), dtype=np.int64)),
                             pb.Tensor("_fresh", np.array([fresh], dtype=np.int32)),
                             pb.Tensor("_last", np.array([last])), text_tensor(pb, "applied_adapter", adapter),
                             pb.Tensor("replayed_tokens", np.array([replayed], dtype=np.int32)),
                             pb.Tensor("output_tokens", np.array([len(ids)], dtype=np.int32)),
                             text_tensor(pb, "route_scores", scores),
                             text_tensor(pb, "conversation_id_out", conversation_id)], wanted)

    def execute(self, requests):
        changes = self.served.refresh()  # live configuration: the adapter-set file changed
        if changes:
            pb.Logger.log_info(f"adapter set changed: {'; '.join(changes)}")
        for request in requests:
            sender = request.get_response_sender()
            try:  # refused here, the request has touched nothing: no lock is taken or released
                parsed = self._parse(request)
                decode_request = parsed[0]
                self.sealer.check(DECODE, as_text(optional(pb, request, "_seal"), "_seal"), **decode_fields(
                    decode_request.conversation_id, decode_request.meta.length, decode_request.meta.adapter_hash,
                    decode_request.state, decode_request.return_state, decode_request.end_conversation))
            except ValueError as error:
                sender.send(error_response(pb, str(error)), flags=FINAL)
                continue
            try:
                self._serve(*parsed, sender, requested_outputs(request))
            except ValueError as error:
                self._end_turn_here(decode_request)  # idempotent: the stage may have ended it already
                sender.send(error_response(pb, str(error)), flags=FINAL)
            except Exception as error:  # a failure of ours: logged in full, the client gets one line, not a traceback
                pb.Logger.log_error(f"decode failed: {traceback.format_exc()}")
                self._end_turn_here(decode_request)
                sender.send(error_response(pb, f"decode failed: {type(error).__name__}: {error}", "INTERNAL"),
                            flags=FINAL)

    def finalize(self):
        self.counters.close()

    def _end_turn_here(self, decode_request: DecodeRequest) -> None:
        """A sealed turn refused here ends here, unless a disaggregated prefill server holds its lock (it ends it
        there)."""
        if not decode_request.return_state:
            self.served.store.end_turn(decode_request.conversation_id)

    def _serve(self, decode_request: DecodeRequest, stream: bool, scores: str, sender, wanted: frozenset[str]):
        self.counters.add("mol2_routes_read", str(decode_request.meta.adapter_hash))
        adapter = self.stage.adapter_for(self.served.watcher.current, decode_request.meta.adapter_hash) or "base"
        ids, replayed = [], 0
        respond = lambda fresh, last: self._response(ids, fresh, last, adapter, replayed, scores,  # noqa: E731
                                                     decode_request.conversation_id, wanted)
        tokens = self.stage.run(self.served.watcher.current, decode_request)
        for token, replayed in tokens:
            if sender.is_cancelled():  # the client went away: stop now; the turn is dropped, nothing is stored
                tokens.close()
                sender.send(flags=FINAL)
                return
            if not ids:
                self.counters.add("mol2_routes_applied", adapter)
                self.counters.add("mol2_replayed_tokens", adapter, replayed)
            ids.append(token)
            if stream:
                sender.send(respond(1, False))
        self.counters.add("mol2_requests", adapter)
        # Streamed: the last response adds no ids, it flushes a character left unfinished (and carries FINAL).
        last = [respond(0 if stream else len(ids), True)]
        if decode_request.return_state:
            state, conversation_id = decode_request.final_state, decode_request.conversation_id
            seal = self.sealer.seal(RETURNED, **returned_fields(conversation_id, state))
            last.append(response(pb, [pb.Tensor("_state_out", np.frombuffer(state, dtype=np.uint8)),
                                      text_tensor(pb, "_state_seal", seal)], wanted))
        for earlier in last[:-1]:
            sender.send(earlier)
        sender.send(last[-1], flags=FINAL)
