"""route: tokenize -> prefill (route-only) -> router through BLS; returns the adapter a routed turn would get."""

import json
import traceback

import triton_python_backend_utils as pb

from python_backend.front import bls_call, prefill_and_route
from python_backend.seal import Sealer
from python_backend.serving import triton_parameters
from python_backend.triton_io import as_text, error_response, optional, required


class TritonPythonModel:
    def initialize(self, args):
        self.router_model = triton_parameters(json.loads(args["model_config"]))["router_model"]
        self.call = bls_call(pb)
        self.sealer = Sealer.from_environment()  # prefill takes only sealed requests

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                routed = prefill_and_route(self.call, self.sealer, required(pb, request, "text_input"),
                                           as_text(optional(pb, request, "conversation_id"), "conversation_id"),
                                           self.router_model)
                responses.append(pb.InferenceResponse([pb.Tensor("adapter", routed["_route_adapter"]),
                                                       pb.Tensor("route_scores", routed["_route_scores"])]))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
            except Exception as error:  # ours: logged in full; this request fails, the others of the batch do not
                pb.Logger.log_error(f"route failed: {traceback.format_exc()}")
                responses.append(error_response(pb, f"route failed: {type(error).__name__}: {error}", "INTERNAL"))
        return responses
