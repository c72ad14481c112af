"""The `router` Triton model: MoL2 routing on pooled H19, an explicit adapter always winning, per request
(python_backend/core/routing.py). The decision (the adapter path's 31-bit FNV-1a hash) is written into the transfer
metadata that travels with this request's state. A route-only request (the `route` model) is counted apart, as a
decision not written. The router reads and writes no conversation (the caller that prefilled holds the turn lock
and ends it), so a direct call can change nothing. `pb` is passed in, so it is tested without a server."""

from __future__ import annotations

import torch

from ced.families import read_config
from ced.tokenization import ChatTokenizer

from ..core.adapter_set import AdapterSetWatcher
from ..core.serving import start_model_process
from ..core.settings import ServingSettings, triton_parameters
from ..core.routing import RouterStage, load_scorer
from ..core.transfer import TransferMeta
from .metrics import Counters
from .triton_io import Outputs, RequestError, as_scalar, as_text, optional, required, respond_each


class RouterModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        settings = ServingSettings.from_parameters(triton_parameters(model_config))
        start_model_process(settings)
        # No engine: the head reads only the token embedding (loaded alone) and the adapter set.
        self.watcher = AdapterSetWatcher(settings.adapter_set)
        self.stage = RouterStage(load_scorer(settings, tokenizer=ChatTokenizer(settings.model_dir)))
        self.counters = Counters(pb, "router")
        self.hidden_size = read_config(settings.model_dir).hidden_size  # the size of pooled H19

    def execute(self, requests) -> list:
        self.watcher.poll()
        return respond_each(self.pb, requests, self.route, "router")

    def finalize(self) -> None:
        self.counters.close()

    def route(self, request):
        pb = self.pb
        route_only = as_scalar(optional(pb, request, "_route_only"), "_route_only", bool, False)
        meta = TransferMeta.from_tensor(required(pb, request, "_transfer_meta").reshape(-1))
        h19 = torch.from_numpy(required(pb, request, "_h19").reshape(-1).copy())
        if h19.numel() != self.hidden_size:
            raise RequestError(f"_h19 must hold {self.hidden_size} values (H19 pooled by prefill), got {h19.numel()}")
        explicit = as_text(optional(pb, request, "adapter"), "adapter")
        decision = self.stage.run(self.watcher.current, h19, explicit)
        meta.adapter_hash = decision.adapter_hash
        self.counters.add("mol2_route_only_decisions" if route_only else "mol2_routes_written", decision.adapter)
        if decision.routed:
            self.counters.add("mol2_router_decision_ms_total", decision.adapter, decision.decision_ms)
        return pb.InferenceResponse(self.outputs.tensors(_routed_meta=meta.to_tensor().numpy(),
                                                         _route_scores=decision.scores,
                                                         _route_adapter=decision.adapter))
