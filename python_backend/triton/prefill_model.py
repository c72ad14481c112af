"""The `prefill` Triton model: the new user turn through the adapter-free stage, H19 pooled over the turn for the
router and the conversation's state for the transfer to decode. Its turns run in the scheduler
(python_backend/core/scheduler.py), the loop every turn runs in, and leave it once prefilled: the router and the
decoder run in other models. With `_route_start` the ids are a whole stateless prompt (a chat or completion the
relay rendered as the single server's engine renders one), prefilled from scratch, of no conversation. With
`_route_only` (the `route` model's requests) the state is not sent, and either way nothing is written: the caller
holds the conversation's turn lock and commits the turn. Internal: every request carries its caller's seal
(python_backend/core/seal.py), checked before the store is read. `pb` is passed in, so it is tested without a
server."""

from __future__ import annotations

import threading
import uuid

from ..core.scheduler import Scheduler, Turn
from ..core.seal import PREFILL, Sealer, prefill_fields
from ..core.serving import Served
from ..core.settings import ServingSettings, triton_parameters
from ..core.transfer import TransferMeta, encode_state
from .triton_io import Outputs, RequestError, as_scalar, as_text, failure_response, optional, required


class PrefillModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        settings = ServingSettings.from_parameters(triton_parameters(model_config))
        self.served = Served.open(settings, with_adapters=False)  # prefill never runs an adapter
        self.sealer = Sealer.from_environment()
        self.scheduler = Scheduler(self.served.serving_engine(), self.served.store, self.served.tokenizer,
                                   engine_adapter=lambda decision: None, refresh=lambda: [], max_resident=0,
                                   prefix_cache_bytes=0).start()

    def finalize(self) -> None:
        self.scheduler.stop()

    def execute(self, requests) -> list:
        """Every request of the batch is submitted before any is waited for, so their prefills run together."""
        turns = []
        for request in requests:
            try:
                turns.append(self.submit(request))
            except Exception as error:  # noqa: BLE001 - refused before any work; the others go on
                turns.append(error)
        return [self.respond(turn) for turn in turns]

    def submit(self, request) -> tuple[Turn, bool]:
        pb = self.pb
        ids = required(pb, request, "_text_ids").reshape(-1)
        route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
        conversation_id = as_text(optional(pb, request, "conversation_id"), "conversation_id")
        route_start = as_scalar(optional(pb, request, "_route_start"), "_route_start", int, None)
        self.sealer.check(PREFILL, as_text(optional(pb, request, "_seal"), "_seal"),
                          **prefill_fields(conversation_id, route_only, ids, route_start))
        if ids.size == 0:
            raise RequestError("text_input is empty")
        if route_start is not None:  # a whole stateless prompt (the OpenAI API's chat or completion): no conversation
            turn = Turn("", [], route=None, sink=PrefillSink(), prompt=ids.tolist(), route_start=route_start,
                        leaves_prefilled=True, returns_state=True)
            self.scheduler.submit(turn)
            return turn, False
        new = not conversation_id
        turn = Turn(conversation_id or ("" if route_only else uuid.uuid4().hex), ids.tolist(), route=None,
                    sink=PrefillSink(), new=new, leaves_prefilled=True, returns_state=True)
        self.scheduler.submit(turn)
        return turn, route_only

    def respond(self, submitted: tuple[Turn, bool] | Exception):
        if isinstance(submitted, Exception):
            return failure_response(self.pb, submitted, "prefill")
        turn, route_only = submitted
        turn.sink.done.wait()
        if turn.sink.error is not None:
            return failure_response(self.pb, turn.sink.error, "prefill")
        state = turn.final_state
        encoded = b"" if route_only else encode_state(state, self.served.engine.config)
        return self.pb.InferenceResponse(self.outputs.tensors(
            _h19=turn.pooled.numpy(), _state=encoded, _transfer_meta=TransferMeta(state.length).to_tensor().numpy(),
            _conversation_id=turn.conversation_id, _prompt_tokens=turn.prompt_tokens))


class PrefillSink:
    """Where a prefill turn's end is waited for: it leaves the scheduler with its state, or fails."""

    def __init__(self):
        self.done, self.error = threading.Event(), None

    def token(self, token, turn) -> None:  # a prefill turn samples nothing
        raise AssertionError("a prefill turn has no tokens")

    def finished(self, turn: Turn) -> None:
        self.done.set()

    def failed(self, error: Exception, turn: Turn) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return False
