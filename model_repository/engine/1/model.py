"""The whole turn on resident conversations, batched: the stub's side is python_backend/triton/engine_model.py, the engine
itself runs in a core process of its own (python_backend/core/engine_core.py)."""

import json

import triton_python_backend_utils as pb

from python_backend.triton.engine_model import CoreFailed, EngineModel
from python_backend.core.settings import triton_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(config):
            raise pb.TritonModelException("engine must be decoupled (model_transaction_policy { decoupled: true })")
        try:
            self.model = EngineModel(pb, triton_parameters(config))
        except CoreFailed as error:
            raise pb.TritonModelException(str(error)) from None

    def execute(self, requests):
        self.model.execute(requests)  # responses come from the responder's thread

    def finalize(self):
        self.model.finalize()
