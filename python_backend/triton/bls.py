"""The prefill side of a turn as BLS calls from a Python model, for the `route` model (a client with its own router
asks for a decision only) and the disaggregated relay (python_backend/triton/front.py): tokenize -> prefill -> router,
every internal request sealed (the relay tokenizes a turn itself and calls prefill with its ids). Imports no torch:
the `route` model only calls the others.

`pb` (triton_python_backend_utils) is passed in, so the logic is tested without a server.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from ..core.seal import PREFILL, Sealer, prefill_fields
from .triton_io import RequestError

_FAILURE = re.compile(r"^[a-z_]+ failed: [A-Za-z_]\w*: ")  # "tokenize failed: KeyError: ...": a failure of ours


class StageFailure(RuntimeError):
    """An internal stage failed on its side (not the request's fault)."""


Call = Callable[[str, dict[str, np.ndarray], list[str]], dict[str, np.ndarray]]


def bls_call(pb) -> Call:
    """A synchronous BLS call: (model, inputs, output names) -> outputs. A model's refusal becomes a RequestError
    (the client's 400), its own failure a StageFailure (500), so neither is passed off as the other. (A BLS error
    does not keep its code, so a failure is told by how the models word one: "<stage> failed: ...".)"""

    def call(model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        request = pb.InferenceRequest(model_name=model, requested_output_names=outputs,
                                      inputs=[pb.Tensor(name, value) for name, value in inputs.items()])
        response = request.exec()
        if response.has_error():
            message = response.error().message()
            if _FAILURE.match(message):
                raise StageFailure(f"{model}: {message}")
            raise RequestError(message)
        return {name: pb.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}

    return call


def text_array(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=object)


def prefill_request(call: Call, sealer: Sealer, text_input: np.ndarray | None, conversation_id: str | None,
                    route_only: bool, ids: np.ndarray | None = None,
                    route_start: int | None = None) -> dict[str, np.ndarray]:
    """tokenize -> prefill, the prefill request sealed (`ids` given: the turn's ids as they are, not tokenized;
    with `route_start`, a whole stateless prompt, rendered by the caller). Prefill takes no lock: a caller that will
    commit the turn holds the conversation's turn lock itself (Relay.run)."""
    if ids is None:
        ids = call("tokenize", {"text_input": text_input}, ["_text_ids"])["_text_ids"]
    seal = sealer.seal(PREFILL, **prefill_fields(conversation_id, route_only, ids, route_start))
    inputs = {"_text_ids": np.asarray(ids, dtype=np.int64).reshape(-1), "_seal": text_array(seal)}
    if conversation_id:
        inputs["conversation_id"] = text_array(conversation_id)
    if route_only:
        inputs["_route_only"] = np.array([True])
    if route_start is not None:
        inputs["_route_start"] = np.array([route_start], dtype=np.int32)
    return call("prefill", inputs, ["_h19", "_state", "_transfer_meta", "_conversation_id", "_prompt_tokens"])


def route_request(call: Call, prefilled: dict[str, np.ndarray], adapter: str | None, router_model: str,
                  route_only: bool) -> dict[str, np.ndarray]:
    """The router on the prefilled turn: an explicit adapter wins, else the head on pooled H19."""
    inputs = {"_h19": prefilled["_h19"], "_transfer_meta": prefilled["_transfer_meta"]}
    if adapter:
        inputs["adapter"] = text_array(adapter)
    if route_only:
        inputs["_route_only"] = np.array([True])
    return call(router_model, inputs, ["_routed_meta", "_route_scores", "_route_adapter"])


def prefill_and_route(call: Call, sealer: Sealer, text_input: np.ndarray, conversation_id: str | None,
                      router_model: str) -> dict[str, np.ndarray]:
    """The route model's decision: tokenize -> prefill (route-only, on a copy: nothing written, no lock) ->
    router."""
    prefilled = prefill_request(call, sealer, text_input, conversation_id, route_only=True)
    return {**prefilled, **route_request(call, prefilled, None, router_model, route_only=True)}
