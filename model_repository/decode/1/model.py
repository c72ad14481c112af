"""Decoupled decode on a split server (replay W under the transfer's adapter, stream token ids): the logic is
python_backend/triton/decode_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.decode_model import DecodeModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = DecodeModel(pb, json.loads(args["model_config"]))

    def execute(self, requests):
        self.model.execute(requests)  # responses go through each request's sender

    def finalize(self):
        self.model.finalize()  # drops the counters while Triton can still take them
