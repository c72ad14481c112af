"""The disaggregated relay: a prefill server that prefills and routes a turn through BLS (python_backend/triton/bls.py),
hands decode to another Triton server over gRPC and keeps the conversation's one stored copy. A stateless request (a
whole chat or prompt: the OpenAI API's, which streams to a relay as to a single server's `engine`) is rendered here,
prefilled and routed as a turn of no conversation, decoded there, and stored nowhere.

`pb` (triton_python_backend_utils) is passed in, so the logic is tested without a server.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import numpy as np

from ced.tokenization import ChatTokenizer

from ..core.detokenize import check_ids, text_delta
from ..core.delta_transfer import BASE_REFUSED, DELTA, Count, Outgoing, RelayTransfers, no_count
from ..core.engine_core import stateless_prompt
from ..core.inputs import as_text, text_size
from ..core.seal import DECODE, RETURNED, Sealer, decode_fields, returned_fields
from ..core.store import ConversationStore, check_id
from ..core.transfer import TransferError
from .bls import Call, prefill_request, route_request, text_array
from .token_link import LinkAnswer, LinkTurn, TokenLinks
from .triton_io import RequestError

# The request fields a relay passes on to decode unchanged, with the dtypes decode's config declares: one value
# each, but for the lists.
PASSED_ON = {"max_tokens": np.int32, "stream": np.bool_, "temperature": np.float32, "top_p": np.float32,
             "top_k": np.int32, "seed": np.uint64, "end_conversation": np.bool_, "ignore_eos": np.bool_,
             "min_p": np.float32, "repetition_penalty": np.float32, "presence_penalty": np.float32,
             "frequency_penalty": np.float32, "min_tokens": np.int32, "stop_token_ids": np.int32,
             "structured_output": np.object_, "logprobs": np.int32}
LISTS = frozenset({"stop_token_ids"})
STATELESS = ("messages", "prompt")  # a whole chat or prompt (the OpenAI API's requests): no conversation
ANSWER_OUTPUTS = ("applied_adapter", "replayed_tokens", "output_tokens", "route_scores", "conversation_id_out",
                  "finish_reason", "logprobs")


_clients = threading.local()  # each relay thread's gRPC client per decode server, kept from turn to turn


def _client(url: str):
    """This thread's client of the decode server at `url`: its channel (a connection) made once, not every turn."""
    import tritonclient.grpc as grpcclient

    clients = _clients.__dict__.setdefault("by_url", {})
    if url not in clients:
        clients[url] = grpcclient.InferenceServerClient(url)
    return clients[url]


def remote_decode(url: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 600.0,
                  turn: LinkTurn | None = None) -> Iterator:
    """Stream one request to a decode server over Triton gRPC; yields its responses (tritonclient InferResult, or
    LinkAnswer for those that came on the relay's token link when the turn is `turn` there, token_link.py). The
    turn's last answer and what follows it wait until the link has brought every token that answer counts."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    grpc_inputs = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        grpc_inputs.append(tensor)
    responses: queue.Queue = turn.queue if turn is not None else queue.Queue()
    client = _client(url)
    finished = False
    received, counted, held = 0, None, []  # tokens come so far, the count the last answer gives, answers held
    try:
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            client.async_stream_infer(model, grpc_inputs, enable_empty_final_response=True)
        except InferenceServerException as error:  # the same message whichever side notices first
            raise RequestError(f"decode server {url}: {error.message()}") from None
        while not finished or held:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestError(f"the decode server at {url} sent nothing for {timeout_s:.0f} s") from None
            if error is not None:
                raise RequestError(f"decode server {url}: {error.message() if hasattr(error, 'message') else error}")
            if isinstance(result, LinkAnswer):
                received += result.fresh
                yield result
            else:
                response = result.get_response()
                finished = response.parameters["triton_final_response"].bool_param
                if response.outputs:
                    if (fresh := result.as_numpy("_fresh")) is not None:
                        received += int(fresh[0])
                    if (last := result.as_numpy("_last")) is not None and last[0]:
                        counted = int(result.as_numpy("output_tokens")[0])
                    held.append(result)
                if finished and turn is not None and counted is None:  # decode dropped it (its link closed)
                    raise RequestError(f"the decode server at {url} ended the turn without its last answer")
            if held and (counted is None or received >= counted):
                yield from held
                held.clear()
    finally:  # closed before the end (the client cancelled, or an error): cancel the turn on the decode server too
        if turn is not None:
            turn.close()
        try:
            client.stop_stream(cancel_requests=not finished)
        except Exception:  # a stream that did not close would refuse the next: this thread makes a new client
            _clients.by_url.pop(url, None)
            raise


class Relay:
    """One turn on a prefill server: prefill and route here, decode there (its ids detokenized here), the final
    state committed here (a conversation's last turn gets none back: the conversation is deleted here).

    `send(outputs, final)` hands one response to the client. The relay holds the turn lock (an OS lock, in its
    own process: from before prefill, or, for a new conversation, from the moment prefill names it) until the
    state is committed (or the turn fails), exactly as on a single server. Every internal request is sealed
    (python_backend/core/seal.py), and the state that comes back is stored only when decode's seal on it checks out.

    The state travels as a delta where it can (python_backend/core/delta_transfer.py): only what the decode server
    lacks goes, and only what the relay lacks comes back; a delta decode refuses is sent again whole, once.
    `count(name, value, **labels)` counts the bytes and the fallbacks (Counters.count). `tokenizer` renders stateless
    requests and turns decode's ids into text.
    """

    def __init__(self, call: Call, store: ConversationStore, router_model: str, decode_url: str, decode_model: str,
                 sealer: Sealer, decode: Callable[..., Iterator] = remote_decode, count: Count = no_count,
                 *, tokenizer: ChatTokenizer, links: TokenLinks | None = None):
        self.call, self.store, self.router_model, self.sealer = call, store, router_model, sealer
        self.tokenizer = tokenizer
        self.decode_url, self.decode_model, self.decode = decode_url, decode_model, decode
        self.links = links  # streamed turns' tokens come on a token link (token_link.py); None: on their own streams
        self.transfers = RelayTransfers(store, store.config, count)

    def run(self, fields: dict[str, np.ndarray], send: Callable[[dict[str, np.ndarray] | None, bool], None],
            cancelled: Callable[[], bool] = lambda: False) -> None:
        """`cancelled()` says the client went away: the remote turn is cancelled and nothing is stored."""
        if any(name in fields for name in STATELESS):
            self._run_stateless(fields, send, cancelled)
            return
        if fields.get("text_input") is None and fields.get("_text_ids") is None:
            raise RequestError("missing input: text_input (a turn of a conversation), or messages or prompt (a "
                               "whole chat or prompt, stateless)")
        conversation_id = _text(fields.get("conversation_id"))
        if conversation_id:
            self.store.begin_turn(check_id(conversation_id))  # a second turn on it is refused until this one ends
        pending = None
        try:
            ids = fields.get("_text_ids")
            if ids is None:
                ids = self._tokenize(fields["text_input"])
            prefilled = prefill_request(self.call, self.sealer, None, conversation_id, route_only=False, ids=ids)
            if not conversation_id:  # a new conversation: its id exists from now (refused here at the store's limits)
                conversation_id = _text(prefilled["_conversation_id"])
                self.store.begin_turn(conversation_id)
            routed = route_request(self.call, prefilled, _text(fields.get("adapter")), self.router_model, False)
            inputs = self._decode_inputs(fields, prefilled, routed)
            inputs["_return_state"] = np.array([True])
            end = _flag(inputs.get("end_conversation"))
            sent = self.transfers.outgoing(conversation_id, prefilled["_state"].tobytes())
            sent, results = self._start_decode(conversation_id, inputs, sent, routed["_routed_meta"], end)
            committed = False

            def commit(state: bytes, seal: str | None) -> None:
                nonlocal committed
                self._commit(conversation_id, sent, state, seal, end)
                committed = True

            pending = self._answers(results, send, cancelled, commit, _count(prefilled["_prompt_tokens"]))
            if pending is None:
                return
            if end and not committed:  # the last turn: decode sends no state back (only to be dropped here)
                self.store.delete(conversation_id)
                self.transfers.forget(conversation_id)
            elif not committed:
                raise RequestError(f"the decode server at {self.decode_url} ended the turn without its final state")
        finally:
            if conversation_id:
                self.store.end_turn(conversation_id)  # only the lock this relay took
        send(pending, True)  # only now: a client may send the next turn the moment it has this answer

    def _tokenize(self, text_input: np.ndarray) -> np.ndarray:
        """The turn's text as the `tokenize` model makes it ids, here: a BLS call to it was a round trip between
        processes on every turn (and a queue at its one instance)."""
        self.store.limits.check_text("text_input", text_size(text_input), self.tokenizer.max_token_bytes)
        text = as_text(text_input, "text_input")
        if not text:
            raise RequestError("text_input is empty")
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def _run_stateless(self, fields: dict[str, np.ndarray], send: Callable, cancelled: Callable[[], bool]) -> None:
        """A whole chat or prompt (the OpenAI API's requests): rendered here as the single server's engine renders
        it, prefilled from scratch (this server keeps no prefix cache), decoded there, stored nowhere."""
        if fields.get("conversation_id") is not None:
            raise RequestError("conversation_id cannot be given with messages or prompt: those carry the whole "
                               "history (stateless)")
        ids, route_start = stateless_prompt(fields, self.tokenizer, self.store.limits)
        prefilled = prefill_request(self.call, self.sealer, None, None, route_only=False,
                                    ids=np.asarray(ids, dtype=np.int64), route_start=route_start)
        routed = route_request(self.call, prefilled, _text(fields.get("adapter")), self.router_model, False)
        inputs = self._decode_inputs(fields, prefilled, routed)
        sent = self.transfers.outgoing("", prefilled["_state"].tobytes())  # no conversation: always whole
        end = _flag(inputs.get("end_conversation"))
        _, results = self._start_decode("", inputs, sent, routed["_routed_meta"], end)

        def unexpected(state: bytes, seal: str | None) -> None:
            raise RequestError(f"the decode server at {self.decode_url} returned a state for a stateless request")

        pending = self._answers(results, send, cancelled, unexpected, _count(prefilled["_prompt_tokens"]))
        if pending is not None:
            send(pending, True)

    def _decode_inputs(self, fields: dict[str, np.ndarray], prefilled: dict, routed: dict) -> dict[str, np.ndarray]:
        inputs = {"_state": prefilled["_state"], "_routed_meta": routed["_routed_meta"],
                  "_conversation_id": prefilled["_conversation_id"], "_route_scores": routed["_route_scores"]}
        inputs.update({name: fields[name].astype(dtype).reshape(-1 if name in LISTS else 1)
                       for name, dtype in PASSED_ON.items() if fields.get(name) is not None})
        return inputs

    def _answers(self, results: Iterator, send: Callable, cancelled: Callable[[], bool],
                 on_state: Callable[[bytes, str | None], None], prompt_tokens: int) -> dict | None:
        """Decode's answers passed on to the client, their ids detokenized here, all but the last: that one is
        returned, for the caller to send once the turn is over (None: the client went away, its stream is ended).
        A final state in the answers goes to `on_state`."""
        pending = None
        for result in results:
            if cancelled():
                getattr(results, "close", lambda: None)()  # remote_decode cancels the remote turn on close
                send(None, True)
                return None
            state = result.as_numpy("_state_out")
            if state is not None:
                on_state(state.tobytes(), _text(result.as_numpy("_state_seal")))
                continue
            if pending is not None:  # one behind, so the FINAL flag rides the last answer, as decode sends it
                send(pending, False)
            pending = {name: value for name in ANSWER_OUTPUTS if (value := result.as_numpy(name)) is not None}
            # this server prefills every turn from scratch: nothing of the prompt comes from a cache
            pending.update(prompt_tokens=prompt_tokens, cached_tokens=0)
            pending["text_output"] = np.array([self._text_of(result).encode("utf-8")], dtype=object)
        return pending

    def _text_of(self, result) -> str:
        """The text a decode answer adds, detokenized here (python_backend/core/detokenize.py): a BLS call to the
        `detokenize` model per streamed token cost a round trip between processes for every token of every stream."""
        ids = check_ids(result.as_numpy("_ids").reshape(-1).tolist(), self.store.config.vocab_size)
        fresh, last = int(result.as_numpy("_fresh").reshape(-1)[0]), bool(result.as_numpy("_last").reshape(-1)[0])
        return text_delta(self.tokenizer.decode, ids, fresh, last)

    def _start_decode(self, conversation_id: str, inputs: dict[str, np.ndarray], sent: Outgoing,
                      routed_meta: np.ndarray, end: bool) -> tuple[Outgoing, Iterator]:
        """decode's responses to the turn, `sent` as its state; a delta refused for its base (decode restarted,
        evicted it, or holds another turn) goes again whole. The refusal comes before any answer."""
        length, adapter_hash = (int(v) for v in routed_meta.reshape(-1))
        while True:
            turn = self.links.turn(self.decode_url, self.decode_model) \
                if self.links is not None and _flag(inputs.get("stream")) else None
            link = {} if turn is None else {"link": turn.link.id, "link_turn": turn.number}
            inputs.update({f"_{name}": np.array([value], dtype=np.int64) for name, value in link.items()})
            inputs["_state"] = np.frombuffer(sent.data, np.uint8)
            inputs["_seal"] = text_array(self.sealer.seal(DECODE, **decode_fields(
                conversation_id, length, adapter_hash, sent.data, _flag(inputs.get("_return_state")), end, **link)))
            results = self.decode(self.decode_url, self.decode_model, inputs, **({"turn": turn} if turn else {}))
            try:
                first = next(results)
            except StopIteration:
                return sent, iter(())
            except (RequestError, TransferError) as error:
                if sent.kind != DELTA or BASE_REFUSED not in str(error):
                    raise
                sent = self.transfers.whole(sent)
                continue
            return sent, _prepend(first, results)

    def _commit(self, conversation_id: str, sent: Outgoing, returned: bytes, seal: str | None, end: bool) -> None:
        """Store the turn's final state, from decode's sealed answer (a delta on what was sent, or whole); the
        relay then knows which state decode holds for the next turn's delta."""
        try:
            self.sealer.check(RETURNED, seal, **returned_fields(conversation_id, returned))
            state, version = self.transfers.incoming(sent, returned)
            self.store.commit(conversation_id, state, end)
        except BaseException:
            self.transfers.forget(conversation_id)
            raise
        self.transfers.remember(conversation_id, "" if end else version, state)


def _prepend(first, rest: Iterator) -> Iterator:
    """`first`, then the rest; closing it closes `rest` (remote_decode then cancels the remote turn)."""
    try:
        yield first
        yield from rest
    finally:
        getattr(rest, "close", lambda: None)()


def _text(value: np.ndarray | None) -> str | None:
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return (item.decode("utf-8") if isinstance(item, bytes) else str(item)) or None


def _count(value: np.ndarray) -> int:
    return int(value.reshape(-1)[0])


def _flag(value: np.ndarray | None) -> bool:
    return bool(value is not None and value.size and value.reshape(-1)[0])
