"""HeteroFold (BLS): KV blocks from `heterofold_sender` (or the client) -> the fitted map -> the receiver's cache
-> greedy continuation with no receiver prefill; the response names the map used (heterofold/serving.py)."""

import json

import triton_python_backend_utils as pb

from heterofold.serving import Receiver, Settings, heterofold_execute
from python_backend.triton.triton_io import Outputs


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.receiver, self.outputs = Receiver(Settings.from_parameters(parameters)), Outputs(pb, config)

    def execute(self, requests):
        return heterofold_execute(pb, self.receiver, requests, self.outputs)
