"""The `route` Triton model: tokenize -> prefill (route-only, on a copy: nothing written, no lock) -> router through
BLS (python_backend/triton/front.py); returns the adapter a routed turn would get, for a client that routes for itself.
`pb` is passed in, so it is tested without a server."""

from __future__ import annotations

from ..core.seal import Sealer
from ..core.settings import triton_parameters
from .bls import bls_call, prefill_and_route
from .triton_io import Outputs, as_text, optional, required, respond_each


class RouteModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        self.router_model = triton_parameters(model_config)["router_model"]
        self.call = bls_call(pb)
        self.sealer = Sealer.from_environment()  # prefill takes only sealed requests

    def execute(self, requests) -> list:
        return respond_each(self.pb, requests, self.route, "route")

    def route(self, request):
        pb = self.pb
        routed = prefill_and_route(self.call, self.sealer, required(pb, request, "text_input"),
                                   as_text(optional(pb, request, "conversation_id"), "conversation_id"),
                                   self.router_model)
        return pb.InferenceResponse(self.outputs.tensors(adapter=routed["_route_adapter"],
                                                         route_scores=routed["_route_scores"]))
