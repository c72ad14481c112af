"""The adapter-free stage: the new user turn through the encoder and the first decoder layer's attention.
Outputs H19 pooled over the turn (for the router) and the conversation's state for the transfer to decode.
With `_route_only` (the `route` model's requests) it prefills a copy and writes nothing. Internal: every request
carries the caller's seal (python_backend/seal.py), checked before the store is touched."""

import json
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb

from python_backend.seal import PREFILL, Sealer, prefill_fields
from python_backend.serving import Served, ServingSettings, triton_parameters
from python_backend.stages import PrefillStage
from python_backend.triton_io import as_scalar, as_text, error_response, optional, required, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.served = Served.open(settings, with_adapters=False)  # prefill never runs an adapter
        self.stage = PrefillStage(self.served.engine, self.served.store, self.served.tokenizer)
        self.sealer = Sealer.from_environment()
        self.last_expiry = time.monotonic()

    def execute(self, requests):
        now = time.monotonic()
        if now - self.last_expiry > 60:  # idle conversations expire (never one with a turn in progress)
            self.last_expiry = now
            for conversation_id in self.served.store.expire():
                pb.Logger.log_info(f"conversation {conversation_id} expired")
        responses = []
        for request in requests:
            try:
                ids = required(pb, request, "_text_ids").reshape(-1)
                route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
                conversation_id = as_text(optional(pb, request, "conversation_id"), "conversation_id")
                self.sealer.check(PREFILL, as_text(optional(pb, request, "_seal"), "_seal"),
                                  **prefill_fields(conversation_id, route_only, ids))
                result = self.stage.run(conversation_id, ids.tolist(), route_only)
                responses.append(pb.InferenceResponse([
                    pb.Tensor("_h19", result.h19_pooled.numpy().astype(np.float32)),
                    pb.Tensor("_state", np.frombuffer(result.state, dtype=np.uint8)),
                    pb.Tensor("_transfer_meta", result.meta.to_tensor().numpy()),
                    text_tensor(pb, "_conversation_id", result.conversation_id)]))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
            except Exception as error:  # ours: logged in full; this request fails, the others of the batch do not
                pb.Logger.log_error(f"prefill failed: {traceback.format_exc()}")
                responses.append(error_response(pb, f"prefill failed: {type(error).__name__}: {error}", "INTERNAL"))
        return responses
