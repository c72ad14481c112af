"""tokenize -> prefill (route-only) -> router through BLS, for a client that routes for itself: the logic is
python_backend/triton/route_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.route_model import RouteModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = RouteModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        return self.model.execute(requests)
