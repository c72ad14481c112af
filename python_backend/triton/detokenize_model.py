"""The `detokenize` Triton model: the text a decode response adds, its newest ids decoded in the context of a few
earlier ones (stateless, so it follows the decoupled decode, one call per streamed response;
python_backend/core/detokenize.py). `pb` is passed in, so it is tested without a server."""

from __future__ import annotations

from ced.families import read_config
from ced.tokenization import ChatTokenizer

from ..core.detokenize import check_ids, text_delta
from ..core.settings import ServingSettings, triton_parameters
from .triton_io import Outputs, as_scalar, required, respond_each


class DetokenizeModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        settings = ServingSettings.from_parameters(triton_parameters(model_config))
        self.tokenizer = ChatTokenizer(settings.model_dir)
        self.vocab_size = read_config(settings.model_dir).vocab_size

    def execute(self, requests) -> list:
        return respond_each(self.pb, requests, self.detokenize, "detokenize")

    def detokenize(self, request):
        pb = self.pb
        ids = check_ids(required(pb, request, "_ids").reshape(-1).tolist(), self.vocab_size)
        fresh = as_scalar(required(pb, request, "_fresh"), "_fresh", int, 0)
        last = as_scalar(required(pb, request, "_last"), "_last", bool, True)
        text = text_delta(self.tokenizer.decode, ids, fresh, last)
        return pb.InferenceResponse([self.outputs.tensor("text_output", text)])
