"""HeteroFold (BLS): KV blocks from `heterofold_sender` (or the client) -> the fitted map -> the receiver's cache
-> greedy continuation with no receiver prefill; the response names the map used (heterofold/serving.py)."""

import json

import triton_python_backend_utils as pb

from heterofold.serving import Receiver, Settings, heterofold_execute


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.receiver = Receiver(Settings.from_parameters({k: v["string_value"] for k, v in parameters.items()}))

    def execute(self, requests):
        return heterofold_execute(pb, self.receiver, requests)
