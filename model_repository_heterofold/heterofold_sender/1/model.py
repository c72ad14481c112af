"""HeteroFold's sender: prefill the text on a sender family and export its KV blocks (heterofold/serving.py)."""

import json

import triton_python_backend_utils as pb

from heterofold.serving import Sender, Settings, sender_execute


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.sender = Sender(Settings.from_parameters({k: v["string_value"] for k, v in parameters.items()}))

    def execute(self, requests):
        return sender_execute(pb, self.sender, requests)
