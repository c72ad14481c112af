"""The adapter-free stage (H19 pooled for the router, the state for decode): the logic is
python_backend/triton/prefill_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.prefill_model import PrefillModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = PrefillModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
