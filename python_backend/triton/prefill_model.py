"""The `prefill` Triton model: the new user turn through the adapter-free stage (python_backend/core/stages.py), H19
pooled over the turn for the router and the conversation's state for the transfer to decode. With `_route_only`
(the `route` model's requests) it prefills a copy and writes nothing. Internal: every request carries its caller's
seal (python_backend/core/seal.py), checked before the store is touched. `pb` is passed in, so it is tested without a
server."""

from __future__ import annotations

import time

from ..core.seal import PREFILL, Sealer, prefill_fields
from ..core.serving import Served
from ..core.settings import ServingSettings, triton_parameters
from ..core.stages import PrefillStage
from .triton_io import Outputs, as_scalar, as_text, optional, required, respond_each

EXPIRY_EVERY_S = 60


class PrefillModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        settings = ServingSettings.from_parameters(triton_parameters(model_config))
        self.served = Served.open(settings, with_adapters=False)  # prefill never runs an adapter
        self.stage = PrefillStage(self.served.engine, self.served.store, self.served.tokenizer)
        self.sealer = Sealer.from_environment()
        self.last_expiry = time.monotonic()

    def execute(self, requests) -> list:
        now = time.monotonic()
        if now - self.last_expiry > EXPIRY_EVERY_S:  # idle conversations expire (never one with a turn in progress)
            self.last_expiry = now
            for conversation_id in self.served.store.expire():
                self.pb.Logger.log_info(f"conversation {conversation_id} expired")
        return respond_each(self.pb, requests, self.prefill, "prefill")

    def prefill(self, request):
        pb = self.pb
        ids = required(pb, request, "_text_ids").reshape(-1)
        route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
        conversation_id = as_text(optional(pb, request, "conversation_id"), "conversation_id")
        self.sealer.check(PREFILL, as_text(optional(pb, request, "_seal"), "_seal"),
                          **prefill_fields(conversation_id, route_only, ids))
        result = self.stage.run(conversation_id, ids.tolist(), route_only)
        return pb.InferenceResponse(self.outputs.tensors(
            _h19=result.h19_pooled.numpy(), _state=result.state, _transfer_meta=result.meta.to_tensor().numpy(),
            _conversation_id=result.conversation_id))
