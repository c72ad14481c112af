"""text_input -> token ids of the user's text: the logic is python_backend/triton/tokenize_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.tokenize_model import TokenizeModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = TokenizeModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        return self.model.execute(requests)
