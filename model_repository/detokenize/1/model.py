"""The text a decode response adds: its newest ids decoded in the context of a few earlier ones (stateless, so it
follows the decoupled decode in the ensemble, one call per streamed response)."""

import json

import triton_python_backend_utils as pb

from ced.tokenization import ChatTokenizer
from python_backend.detokenize import text_delta
from python_backend.serving import ServingSettings, triton_parameters
from python_backend.triton_io import as_scalar, error_response, required, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.tokenizer = ChatTokenizer(settings.model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = required(pb, request, "_ids").reshape(-1).tolist()
                text = text_delta(self.tokenizer.decode, ids, as_scalar(required(pb, request, "_fresh"), "_fresh", int, 0),
                                  as_scalar(required(pb, request, "_last"), "_last", bool, True))
                responses.append(pb.InferenceResponse([text_tensor(pb, "text_output", text)]))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
        return responses
