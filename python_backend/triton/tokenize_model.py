"""The `tokenize` Triton model: text_input -> token ids of the user's text (the chat markers are added by prefill,
which knows the history). `pb` is passed in, so it is tested without a server."""

from __future__ import annotations

from ced.tokenization import ChatTokenizer

from ..core.settings import ServingSettings, triton_parameters
from .triton_io import Outputs, as_text, required, respond_each, text_size


class TokenizeModel:
    def __init__(self, pb, model_config: dict):
        self.pb, self.outputs = pb, Outputs(pb, model_config)
        settings = ServingSettings.from_parameters(triton_parameters(model_config))
        self.tokenizer, self.limits = ChatTokenizer(settings.model_dir), settings.limits

    def execute(self, requests) -> list:
        return respond_each(self.pb, requests, self.tokenize, "tokenize")

    def tokenize(self, request):
        value = required(self.pb, request, "text_input")
        self.limits.check_text("text_input", text_size(value), self.tokenizer.max_token_bytes)  # before any work
        text = as_text(value, "text_input")
        if not text:
            raise ValueError("text_input is empty")
        return self.pb.InferenceResponse([self.outputs.tensor("_text_ids", self.tokenizer.encode(text))])
