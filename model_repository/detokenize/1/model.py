"""The text a decode response adds: the logic is python_backend/triton/detokenize_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.detokenize_model import DetokenizeModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = DetokenizeModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        return self.model.execute(requests)
