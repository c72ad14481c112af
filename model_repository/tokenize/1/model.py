"""text_input -> token ids of the user's text (the chat markers are added by prefill, which knows the history)."""

import traceback

import numpy as np
import triton_python_backend_utils as pb

from python_backend.serving import ServingSettings, triton_parameters
from ced.tokenization import ChatTokenizer
from python_backend.triton_io import as_text, error_response, required


class TritonPythonModel:
    def initialize(self, args):
        import json

        settings = ServingSettings.from_parameters(triton_parameters(json.loads(args["model_config"])))
        self.tokenizer = ChatTokenizer(settings.model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = as_text(required(pb, request, "text_input"), "text_input")
                if not text:
                    raise ValueError("text_input is empty")
                ids = np.array(self.tokenizer.encode(text), dtype=np.int64)
                responses.append(pb.InferenceResponse([pb.Tensor("_text_ids", ids)]))
            except ValueError as error:
                responses.append(error_response(pb, str(error)))
            except Exception as error:  # ours: logged in full; this request fails, the others of the batch do not
                pb.Logger.log_error(f"tokenize failed: {traceback.format_exc()}")
                responses.append(error_response(pb, f"tokenize failed: {type(error).__name__}: {error}", "INTERNAL"))
        return responses
