"""The front end's one connection to Triton: each OpenAI request is one gRPC stream to the decoupled `engine` model
(a response per token, or per run of tokens where a disaggregated decode server sent several at once; on a
disaggregated prefill server the `mol2` relay, which takes the same inputs), on a single
asyncio channel, so concurrent requests reach the engine together and its scheduler batches them.

The stream ends when the server has sent the request's last response (the request side is closed after the one
request). Leaving the stream early (a stop string matched, the HTTP client went away) cancels the gRPC call, which
the engine sees as a cancelled request and stops at the next token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from ...core.server_errors import STORAGE_FULL, server_condition
from .schema import APIError

ENGINE = "engine"
# How Triton answers a request for a model that is not loaded, still loading or unloaded: "... 'engine' is not
# found", "... has no available versions", "... version 1 is not at ready state"
ENGINE_GONE = "Request for unknown model"


@dataclass
class EngineRequest:
    adapter: str | None  # an adapter name, "base", or None: routed by MoL2 inside the engine
    max_tokens: int
    messages: list[dict] | None = None  # chat: the whole history, rendered by the engine's chat template
    prompt: str | None = None  # completions: raw text, no chat markers
    # a stateful turn (the Responses API's chains): the turn's token ids, which the engine wraps in the user-turn
    # markers, on `conversation_id` (None: the turn starts a conversation)
    text_ids: list[int] | None = None
    conversation_id: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    structured_output: str | None = None  # a GrammarSpec's JSON (python_backend/core/structured.py): the answer's grammar
    logprobs: int | None = None  # each token's logprob and this many alternatives (0..20); None: not asked


@dataclass
class EngineDelta:
    """One engine response: the text it adds and the counts so far."""

    text: str
    adapter: str  # applied_adapter: the adapter that answers ("base" for none)
    output_tokens: int
    replayed_tokens: int
    prompt_tokens: int | None  # None: the engine does not report it
    cached_tokens: int | None
    finish_reason: str  # "stop" | "length" on the last response, "" before
    conversation_id: str = ""  # conversation_id_out: the conversation a stateful turn was stored in
    logprobs: list | None = None  # when asked: [token id, logprob, [[token id, logprob], ...]] per token of this response


def engine_error(message: str) -> APIError:
    """An error the engine sent. Its RequestErrors (a bad request: Triton's INVALID_ARG) come as their message; the
    server's own conditions start with a marker of server_errors.py, since the stream carries the message only."""
    condition = server_condition(message)
    if condition == STORAGE_FULL:
        return APIError(507, message, code="storage_full")
    if condition is not None or "INTERNAL" in message[:40]:
        return APIError(500, message, code="engine_error")
    if message.startswith("unknown adapter"):
        return APIError(404, message, "model", "model_not_found")
    if message.startswith(ENGINE_GONE):  # Triton's own: the engine is not loaded (or not ready), not a bad request
        return APIError(503, f"the engine is not available now ({message}); retry shortly", code="engine_unavailable")
    return APIError(400, message, code="engine_refused")


def _tensor(name: str, value, datatype: str):
    if datatype == "INT32" and not -2**31 <= value < 2**31:  # numpy would wrap it (2**32 + 5 -> 5) without a word
        raise ValueError(f"{name}={value} does not fit the engine's INT32 input")
    array = np.array([value], dtype=object if datatype == "BYTES" else None)
    if datatype != "BYTES":
        array = array.astype({"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": bool}[datatype])
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _scalar(result, name: str, default=None):
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return default
    item = value.reshape(-1)[0]
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item


class EngineClient:
    def __init__(self, url: str, model: str = ENGINE):
        self.url, self.model = url, model  # the decoupled model each request streams to
        self.client: grpcaio.InferenceServerClient | None = None
        self.parameters: dict[str, str] = {}
        self.inputs: set[str] = set()

    async def connect(self) -> None:
        """Open the channel (on the running event loop) and read the engine's config: its inputs and settings."""
        self.client = grpcaio.InferenceServerClient(self.url)
        try:
            config = (await self.client.get_model_config(self.model, as_json=True))["config"]
        except (InferenceServerException, grpc.RpcError) as error:
            raise RuntimeError(f"the Triton server at {self.url} has no ready `{self.model}` model: {error}") from None
        self.inputs = {tensor["name"] for tensor in config.get("input", [])}
        self.parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        missing = {"messages", "prompt"} - self.inputs
        if missing:
            raise RuntimeError(f"the `{self.model}` model at {self.url} lacks the input(s) {sorted(missing)} the "
                               "OpenAI front end sends (whole histories, served through the engine's prefix cache)")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def _inputs(self, request: EngineRequest) -> list:
        inputs = []
        if request.messages is not None:
            inputs.append(_tensor("messages", json.dumps(request.messages).encode(), "BYTES"))
        elif request.text_ids is not None:
            ids = grpcclient.InferInput("_text_ids", [len(request.text_ids)], "INT64")
            ids.set_data_from_numpy(np.array(request.text_ids, dtype=np.int64))
            inputs.append(ids)
            if request.conversation_id is not None:
                inputs.append(_tensor("conversation_id", request.conversation_id.encode(), "BYTES"))
        else:
            inputs.append(_tensor("prompt", request.prompt.encode(), "BYTES"))
        if request.adapter is not None:
            inputs.append(_tensor("adapter", request.adapter.encode(), "BYTES"))
        inputs += [_tensor("max_tokens", request.max_tokens, "INT32"), _tensor("stream", True, "BOOL"),
                   _tensor("temperature", request.temperature, "FP32"), _tensor("top_p", request.top_p, "FP32"),
                   _tensor("top_k", request.top_k, "INT32"), _tensor("ignore_eos", request.ignore_eos, "BOOL")]
        if request.seed is not None:
            inputs.append(_tensor("seed", request.seed, "UINT64"))
        for name, default, datatype in (("presence_penalty", 0.0, "FP32"), ("frequency_penalty", 0.0, "FP32"),
                                        ("repetition_penalty", 1.0, "FP32"), ("min_p", 0.0, "FP32"),
                                        ("min_tokens", 0, "INT32")):
            if getattr(request, name) != default and name in self.inputs:  # an engine of an older repository lacks them
                inputs.append(_tensor(name, getattr(request, name), datatype))
        if request.structured_output is not None:
            inputs.append(_tensor("structured_output", request.structured_output.encode(), "BYTES"))
        if request.logprobs is not None:
            inputs.append(_tensor("logprobs", request.logprobs, "INT32"))
        if request.stop_token_ids:
            ids = grpcclient.InferInput("stop_token_ids", [len(request.stop_token_ids)], "INT32")
            ids.set_data_from_numpy(np.array(request.stop_token_ids, dtype=np.int32))
            inputs.append(ids)
        return inputs

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        """The engine's responses for one request, as they come; an engine error raises APIError."""
        if self.client is None:
            raise RuntimeError("EngineClient.connect first")
        inputs = self._inputs(request)

        async def one_request():
            yield {"model_name": self.model, "inputs": inputs}

        responses = self.client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise engine_error(str(error.message() if hasattr(error, "message") else error))
                yield EngineDelta(
                    text=_scalar(result, "text_output", ""), adapter=_scalar(result, "applied_adapter", "base"),
                    output_tokens=int(_scalar(result, "output_tokens", 0)),
                    replayed_tokens=int(_scalar(result, "replayed_tokens", 0)),
                    prompt_tokens=_maybe_int(_scalar(result, "prompt_tokens")),
                    cached_tokens=_maybe_int(_scalar(result, "cached_tokens")),
                    finish_reason=_scalar(result, "finish_reason", "") or "",
                    conversation_id=_scalar(result, "conversation_id_out", "") or "",
                    logprobs=_json(_scalar(result, "logprobs")))
        except (InferenceServerException, grpc.RpcError) as error:
            raise APIError(503, f"the Triton server at {self.url} failed the request: {error}",
                           code="engine_unavailable") from None
        finally:
            responses.cancel()  # a no-op once the call has ended; otherwise the engine stops this request


def _json(value: str | None):
    return None if not value else json.loads(value)


def _maybe_int(value) -> int | None:
    return None if value is None else int(value)
