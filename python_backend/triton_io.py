"""Reading request tensors and building responses, with the Triton utils module passed in (mockable in tests)."""

from __future__ import annotations

import json

import numpy as np


def optional(pb, request, name: str):
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def required(pb, request, name: str):
    value = optional(pb, request, name)
    if value is None:
        raise ValueError(f"missing input {name!r}")
    return value


def as_text(value, name: str) -> str | None:
    if value is None or value.size == 0:
        return None
    if value.size != 1:
        raise ValueError(f"{name} must hold one string, got shape {value.shape}")
    item = value.reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def as_scalar(value, name: str, kind: type, default):
    if value is None or value.size == 0:
        return default
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got shape {value.shape}")
    return kind(value.reshape(-1)[0])


def text_tensor(pb, name: str, text: str):
    return pb.Tensor(name, np.array([text.encode("utf-8")], dtype=object))


def json_tensor(pb, name: str, value) -> object:
    return text_tensor(pb, name, json.dumps(value, sort_keys=True))


def requested_outputs(request) -> frozenset[str]:
    """The outputs a request asked for (all of the model's when it named none)."""
    return frozenset(request.requested_output_names())


def response(pb, tensors: list, wanted: frozenset[str]):
    """A response that holds only the outputs its request asked for. A decoupled model must never send others:
    Triton's Python backend (24.10) drops them inside `send` after it has released the GIL, so their numpy arrays
    are freed without it, and that corrupts the heap while another thread runs Python (the engine's scheduler).
    The soak found it: the engine's process died with a segfault every few minutes behind the `mol2` ensemble, which
    asks the engine for 6 of its 9 outputs. Tensors dropped here are freed by Python, with the GIL held."""
    return pb.InferenceResponse([tensor for tensor in tensors if tensor.name() in wanted])


def error_response(pb, message: str, code: str = "INVALID_ARG"):
    """A response that carries only an error. `code` is a TritonError code: INVALID_ARG (HTTP 400) for a bad
    request, the default; INTERNAL (500) for a failure on the server's side."""
    code_value = getattr(pb.TritonError, code, None)  # absent from stubs older than the codes
    error = pb.TritonError(message) if code_value is None else pb.TritonError(message, code_value)
    return pb.InferenceResponse(output_tensors=[], error=error)
