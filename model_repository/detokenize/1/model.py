"""The text a decode response adds: its newest ids decoded in the context of a few earlier ones (stateless, so it
follows the decoupled decode in the ensemble, one call per streamed response)."""

import json
import traceback

import triton_python_backend_utils as pb

from ced.model import CEDForCausalLM
from ced.tokenization import ChatTokenizer
from python_backend.detokenize import check_ids, text_delta
from python_backend.serving import ServingSettings, triton_parameters
from python_backend.triton_io import as_scalar, error_response, required, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.tokenizer = ChatTokenizer(settings.model_dir)
        self.vocab_size = CEDForCausalLM.config_class.from_pretrained(settings.model_dir).ced.vocab_size

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = check_ids(required(pb, request, "_ids").reshape(-1).tolist(), self.vocab_size)
                text = text_delta(self.tokenizer.decode, ids, as_scalar(required(pb, request, "_fresh"), "_fresh", int, 0),
                                  as_scalar(required(pb, request, "_last"), "_last", bool, True))
                responses.append(pb.InferenceResponse([text_tensor(pb, "text_output", text)]))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
            except Exception as error:  # ours: logged in full; this request fails, the others of the batch do not
                pb.Logger.log_error(f"detokenize failed: {traceback.format_exc()}")
                responses.append(error_response(pb, f"detokenize failed: {type(error).__name__}: {error}", "INTERNAL"))
        return responses
