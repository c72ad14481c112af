"""The whole turn on resident conversations, batched: the logic is python_backend/engine_model.py."""

import json

import triton_python_backend_utils as pb

from python_backend.engine_model import EngineModel
from python_backend.routing import load_scorer
from python_backend.serving import Served
from python_backend.settings import ServingSettings, triton_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(config):
            raise pb.TritonModelException("engine must be decoupled (model_transaction_policy { decoupled: true })")
        parameters = triton_parameters(config)
        settings = ServingSettings.from_parameters(parameters)
        served = Served.open(settings)
        self.model = EngineModel(pb, served, load_scorer(settings, served.engine.model, served.tokenizer), parameters)

    def execute(self, requests):
        self.model.execute(requests)  # responses come from the scheduler's thread

    def finalize(self):
        self.model.finalize()
