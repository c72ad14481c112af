"""MoL2 routing on pooled H19: an explicit adapter always wins, per request. The decision (the adapter path's
31-bit FNV-1a hash) is written into the transfer metadata that travels with this request's state. A route-only
request (the `route` model) is counted apart, as a decision not written. The router reads and writes no
conversation (the caller that prefilled holds the turn lock and ends it), so a direct call can change nothing."""

import json
import traceback

import torch
import triton_python_backend_utils as pb

from python_backend.metrics import Counters
from python_backend.routing import load_scorer
from python_backend.serving import Served, ServingSettings, triton_parameters
from python_backend.stages import RequestError, RouterStage, TransferMeta
from python_backend.triton_io import as_scalar, as_text, error_response, json_tensor, optional, required, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.served = Served.open(settings, with_adapters=False)
        self.stage = RouterStage(load_scorer(settings, self.served))
        self.counters = Counters(pb, "router")
        self.hidden_size = self.served.engine.config.hidden_size  # the size of pooled H19

    def execute(self, requests):
        self.served.watcher.poll()
        responses = []
        for request in requests:
            try:
                responses.append(self._route(request))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
            except Exception as error:  # ours: logged in full; this request fails, the others of the batch do not
                pb.Logger.log_error(f"router failed: {traceback.format_exc()}")
                responses.append(error_response(pb, f"router failed: {type(error).__name__}: {error}", "INTERNAL"))
        return responses

    def finalize(self):
        self.counters.close()

    def _route(self, request):
        route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
        meta = TransferMeta.from_tensor(required(pb, request, "_transfer_meta").reshape(-1))
        h19 = torch.from_numpy(required(pb, request, "_h19").reshape(-1).copy())
        if h19.numel() != self.hidden_size:
            raise RequestError(f"_h19 must hold {self.hidden_size} values (H19 pooled by prefill), got {h19.numel()}")
        decision = self.stage.run(self.served.watcher.current, h19, as_text(optional(pb, request, "adapter"), "adapter"))
        meta.adapter_hash = decision.adapter_hash
        self.counters.add("mol2_route_only_decisions" if route_only else "mol2_routes_written", decision.adapter)
        if decision.routed:
            self.counters.add("mol2_router_decision_ms_total", decision.adapter, decision.decision_ms)
        return pb.InferenceResponse([pb.Tensor("_routed_meta", meta.to_tensor().numpy()),
                                     json_tensor(pb, "_route_scores", decision.scores),
                                     text_tensor(pb, "_route_adapter", decision.adapter)])
