"""MoL2 routing on pooled H19: an explicit adapter always wins, per request. The decision (the adapter path's
31-bit FNV-1a hash) is written into the transfer metadata that travels with this request's state. A route-only
request (the `route` model) has no transfer and no turn lock: it is counted apart, as a decision not written."""

import json

import torch
import triton_python_backend_utils as pb

from python_backend.metrics import Counters
from python_backend.routing import load_scorer
from python_backend.serving import Served, ServingSettings, triton_parameters
from python_backend.stages import RouterStage, TransferMeta
from python_backend.triton_io import as_scalar, as_text, error_response, json_tensor, optional, required, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.served = Served.open(settings, with_adapters=False)
        self.stage = RouterStage(load_scorer(settings, self.served))
        self.counters = Counters(pb, "router")

    def execute(self, requests):
        self.served.watcher.poll()
        responses = []
        for request in requests:
            conversation_id = as_text(required(pb, request, "_conversation_id"), "_conversation_id")
            route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
            try:
                meta = TransferMeta.from_tensor(required(pb, request, "_transfer_meta").reshape(-1))
                h19 = torch.from_numpy(required(pb, request, "_h19").copy())
                decision = self.stage.run(self.served.watcher.current, h19,
                                          as_text(optional(pb, request, "adapter"), "adapter"))
                meta.adapter_hash = decision.adapter_hash
                self.counters.add("mol2_route_only_decisions" if route_only else "mol2_routes_written",
                                  decision.adapter)
                if decision.routed:
                    self.counters.add("mol2_router_decision_ms_total", decision.adapter, decision.decision_ms)
                responses.append(pb.InferenceResponse([
                    pb.Tensor("_routed_meta", meta.to_tensor().numpy()),
                    json_tensor(pb, "_route_scores", decision.scores),
                    text_tensor(pb, "_route_adapter", decision.adapter)]))
            except ValueError as error:
                if not route_only:
                    self.served.store.end_turn(conversation_id)  # prefill took the turn lock; the turn ends here
                responses.append(error_response(pb, str(error)))
        return responses
