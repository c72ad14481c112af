"""MoL2 routing on pooled H19, the decision written into the transfer: the logic is python_backend/triton/router_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.router_model import RouterModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = RouterModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()  # drops the counters while Triton can still take them
