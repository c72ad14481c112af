"""The prefill side of a turn driven from Python models through BLS: the `route` model (a client with its own
router asks for a decision only) and the disaggregated relay (a prefill server that hands decode to another
Triton server over gRPC and keeps the conversation's one stored copy).

`pb` (triton_python_backend_utils) is passed in, so the logic is tested without a server.
"""

from __future__ import annotations

import queue
import re
from typing import Callable, Iterator

import numpy as np

from .seal import DECODE, PREFILL, RETURNED, Sealer, decode_fields, prefill_fields, returned_fields
from .stages import RequestError, commit_turn
from .store import ConversationStore, check_id
from .transfer import decode_state

# The request fields a relay passes on to decode unchanged, with the dtypes decode's config declares.
PASSED_ON = {"max_tokens": np.int32, "stream": np.bool_, "temperature": np.float32, "top_p": np.float32,
             "top_k": np.int32, "seed": np.uint64, "end_conversation": np.bool_}
ANSWER_OUTPUTS = ("applied_adapter", "replayed_tokens", "output_tokens", "route_scores", "conversation_id_out")
IDS = ("_ids", "_fresh", "_last")  # what decode sends for `detokenize` to turn into text_output

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


def prefill_request(call: Call, sealer: Sealer, text_input: np.ndarray, conversation_id: str | None,
                    route_only: bool) -> dict[str, np.ndarray]:
    """tokenize -> prefill, the prefill request sealed. Prefill takes no lock: a caller that will commit the turn
    holds the conversation's turn lock itself (Relay.run)."""
    ids = call("tokenize", {"text_input": text_input}, ["_text_ids"])["_text_ids"]
    seal = sealer.seal(PREFILL, **prefill_fields(conversation_id, route_only, ids))
    inputs = {"_text_ids": ids, "_seal": text_array(seal)}
    if conversation_id:
        inputs["conversation_id"] = text_array(conversation_id)
    if route_only:
        inputs["_route_only"] = np.array([True])
    return call("prefill", inputs, ["_h19", "_state", "_transfer_meta", "_conversation_id"])


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


# -- the disaggregated relay ------------------------------------------------------------------------------------


def remote_decode(url: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 600.0) -> Iterator:
    """Stream one request to a decode server over Triton gRPC; yields its responses (tritonclient InferResult)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    grpc_inputs = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        grpc_inputs.append(tensor)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            client.async_stream_infer(model, grpc_inputs, enable_empty_final_response=True)
        except InferenceServerException as error:  # the same message whichever side notices first
            raise RequestError(f"decode server {url}: {error.message()}") from None
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestError(f"the decode server at {url} sent nothing for {timeout_s:.0f} s") from None
            if error is not None:
                raise RequestError(f"decode server {url}: {error.message() if hasattr(error, 'message') else error}")
            response = result.get_response()
            if response.outputs:
                yield result
            if response.parameters["triton_final_response"].bool_param:
                finished = True
                return
    finally:  # closed before the end (the client cancelled, or an error): cancel the turn on the decode server too
        client.stop_stream(cancel_requests=not finished)
        client.close()


class Relay:
    """One turn on a prefill server: prefill and route here, decode there (its ids detokenized here), the final
    state committed here.

    `send(outputs, final)` hands one response to the client. The relay holds the turn lock (an OS lock, in its
    own process: from before prefill, or, for a new conversation, from the moment prefill names it) until the
    state is committed (or the turn fails), exactly as on a single server. Every internal request is sealed
    (python_backend/seal.py), and the state that comes back is stored only when decode's seal on it checks out.
    """

    def __init__(self, call: Call, store: ConversationStore, router_model: str, decode_url: str, decode_model: str,
                 sealer: Sealer, decode: Callable[..., Iterator] = remote_decode):
        self.call, self.store, self.router_model, self.sealer = call, store, router_model, sealer
        self.decode_url, self.decode_model, self.decode = decode_url, decode_model, decode

    def run(self, fields: dict[str, np.ndarray], send: Callable[[dict[str, np.ndarray] | None, bool], None],
            cancelled: Callable[[], bool] = lambda: False) -> None:
        """`cancelled()` says the client went away: the remote turn is cancelled and nothing is stored."""
        conversation_id = _text(fields.get("conversation_id"))
        if conversation_id:
            self.store.begin_turn(check_id(conversation_id))  # a second turn on it is refused until this one ends
        try:
            prefilled = prefill_request(self.call, self.sealer, fields["text_input"], conversation_id,
                                        route_only=False)
            if not conversation_id:  # a new conversation: its id exists from now (refused here at the store's limits)
                conversation_id = _text(prefilled["_conversation_id"])
                self.store.begin_turn(conversation_id)
            routed = route_request(self.call, prefilled, _text(fields.get("adapter")), self.router_model, False)
            inputs = {"_state": prefilled["_state"], "_routed_meta": routed["_routed_meta"],
                      "_conversation_id": prefilled["_conversation_id"], "_route_scores": routed["_route_scores"],
                      "_return_state": np.array([True])}
            inputs.update({name: fields[name].astype(dtype).reshape(1)
                           for name, dtype in PASSED_ON.items() if fields.get(name) is not None})
            end = _flag(inputs.get("end_conversation"))
            length, adapter_hash = (int(v) for v in routed["_routed_meta"].reshape(-1))
            inputs["_seal"] = text_array(self.sealer.seal(DECODE, **decode_fields(
                conversation_id, length, adapter_hash, prefilled["_state"].tobytes(), True, end)))
            pending, committed = None, False
            results = self.decode(self.decode_url, self.decode_model, inputs)
            for result in results:
                if cancelled():
                    getattr(results, "close", lambda: None)()  # remote_decode cancels the remote turn on close
                    send(None, True)
                    return
                state = result.as_numpy("_state_out")
                if state is not None:
                    state = state.tobytes()
                    self.sealer.check(RETURNED, _text(result.as_numpy("_state_seal")),
                                      **returned_fields(conversation_id, state))
                    commit_turn(self.store, conversation_id, decode_state(state, self.store.config), end)
                    committed = True
                    continue
                if pending is not None:  # one behind, so the FINAL flag rides the last answer, as decode sends it
                    send(pending, False)
                pending = {name: result.as_numpy(name) for name in ANSWER_OUTPUTS}
                pending.update(self.call("detokenize", {name: result.as_numpy(name) for name in IDS}, ["text_output"]))
            if not committed:
                raise RequestError(f"the decode server at {self.decode_url} ended the turn without its final state")
        finally:
            if conversation_id:
                self.store.end_turn(conversation_id)  # only the lock this relay took
        send(pending, True)  # only now: a client may send the next turn the moment it has this answer


def _text(value: np.ndarray | None) -> str | None:
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return (item.decode("utf-8") if isinstance(item, bytes) else str(item)) or None


def _flag(value: np.ndarray | None) -> bool:
    return bool(value is not None and value.size and value.reshape(-1)[0])
