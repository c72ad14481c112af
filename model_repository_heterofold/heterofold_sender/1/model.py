"""HeteroFold's sender: prefill the text on a sender family and export its KV blocks (heterofold/serving.py)."""

import json

import triton_python_backend_utils as pb

from heterofold.serving import Sender, Settings, sender_execute
from python_backend.triton.triton_io import Outputs


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.sender, self.outputs = Sender(Settings.from_parameters(parameters)), Outputs(pb, config)

    def execute(self, requests):
        return sender_execute(pb, self.sender, requests, self.outputs)
