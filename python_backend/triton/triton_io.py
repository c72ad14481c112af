"""Reading request tensors and building responses, with the Triton utils module passed in (mockable in tests)."""

from __future__ import annotations

import json
import time
import traceback

import numpy as np

from ..core.inputs import RequestError, as_scalar, as_text, text_size  # noqa: F401 - the models read them here too


def optional(pb, request, name: str):
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def required(pb, request, name: str):
    value = optional(pb, request, name)
    if value is None:
        raise ValueError(f"missing input {name!r}")
    return value


def text_tensor(pb, name: str, text: str):
    return pb.Tensor(name, np.array([text.encode("utf-8")], dtype=object))


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


def required_text(pb, request, name: str) -> str:
    text = as_text(required(pb, request, name), name)
    if text is None:
        raise ValueError(f"missing input {name!r}")
    return text


# config.pbtxt data types of the outputs these models declare, as numpy dtypes
NUMPY_DTYPES = {"TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                "TYPE_UINT64": np.uint64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
                "TYPE_STRING": np.object_}


class Outputs:
    """Output tensors in the dtypes the model's config declares: the config is the contract a client reads, so a
    tensor follows it instead of a dtype written again in the code."""

    def __init__(self, pb, model_config: dict):
        self.pb = pb
        self.dtypes = {output["name"]: NUMPY_DTYPES[output["data_type"]] for output in model_config.get("output", [])}

    def tensor(self, name: str, value):
        """`value` for a string output: a str (one UTF-8 element), a dict (JSON) or an array; for a number output:
        a number (one element), an array, or bytes (the raw buffer)."""
        dtype = self.dtypes[name]  # an output the config does not declare is a bug of ours: KeyError, a 500
        if dtype is np.object_:
            if isinstance(value, dict):
                value = json.dumps(value, sort_keys=True)
            if isinstance(value, str):
                value = [value.encode("utf-8")]
            return self.pb.Tensor(name, np.asarray(value, dtype=object))
        if isinstance(value, bytes):
            return self.pb.Tensor(name, np.frombuffer(value, dtype=dtype))
        return self.pb.Tensor(name, np.atleast_1d(np.asarray(value, dtype=dtype)))

    def tensors(self, **values) -> list:
        return [self.tensor(name, value) for name, value in values.items()]


def require_decoupled(pb, model_config: dict, model: str) -> None:
    """Checked in `initialize`: a decoupled model's responses go through its sender, so the config must say so."""
    if not pb.using_decoupled_model_transaction_policy(model_config):
        raise pb.TritonModelException(f"{model} must be decoupled (model_transaction_policy {{ decoupled: true }})")


def failure_response(pb, error: Exception, model: str, client_errors: tuple = (ValueError,)):
    """The response for a request that raised `error`. One of `client_errors` (a ValueError: RequestError,
    LimitError, SealError) is the client's: a 400 with its message. Anything else is ours: logged with its
    traceback, a 500 with one line, worded "<model> failed: <type>: <message>" (how bls_call tells the two
    apart, since a BLS error loses its code)."""
    if isinstance(error, client_errors):
        return error_response(pb, str(error))
    pb.Logger.log_error(f"{model} failed: {''.join(traceback.format_exception(error))}")
    return error_response(pb, f"{model} failed: {type(error).__name__}: {error}", "INTERNAL")


def respond_each(pb, requests, serve, model: str, client_errors: tuple = (ValueError,)) -> list:
    """`serve(request) -> response` for each request of a batch; one that raises gets its own error response
    (failure_response) and the others of the batch are served all the same."""
    responses = []
    for request in requests:
        try:
            responses.append(serve(request))
        except Exception as error:  # noqa: BLE001 - mapped per request, never out of `execute`
            responses.append(failure_response(pb, error, model, client_errors))
    return responses


CANCEL_CHECK_S = 0.05  # how often a model asks Triton whether a client left (each ask crosses to Triton's process)


class Every:
    """`due()` is True at most once every `seconds`, the first time at once: what a per-token path asks before
    asking Triton something whose answer can wait (a client gone: `sender.is_cancelled()`)."""

    def __init__(self, seconds: float = CANCEL_CHECK_S):
        self.seconds, self._next = seconds, 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.seconds
        return True
