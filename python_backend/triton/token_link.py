"""The relay's side of a token link to a decode server (decode_model.py `TokenLink` is the other side).

A relay streams each turn's answer from decode. Sent on the turn's own stream, every token of every turn is a
message of its own on each hop (the decode stub's send, Triton's gRPC, the decode server's guard, this process's
gRPC client): at 16 streams, 16 messages a decode step. A link is one more stream per relay process and decode
server: the relay opens it once (sealed: `_link_open`), names it in each streamed turn (`_link`, `_link_turn`), and
decode sends there, in one message, the tokens its responder has for every turn on the link. The turn's own stream
still carries its errors, its last answer (finish reason, token count) and its state.

A link is one gRPC stream, so its messages come in order; a turn's own stream is another, so its last answer may
come before the link's last tokens of it: remote_decode (front.py) holds the last answer until the link has brought
as many tokens as it counts. A link that fails fails the turns waiting on it; the next turn opens a new one.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import secrets
import threading
from typing import Callable

import numpy as np

from ..core.seal import LINK, Sealer, link_fields

log = logging.getLogger("mol2.relay")
LINK_IDLE_S = 1.0  # a link with no turn this long is closed (TokenLinks)


class LinkAnswer:
    """A streamed answer that came on the link, read as a turn's own answers are (`as_numpy`, as tritonclient's
    InferResult): the entry's ids, with the turn's fixed outputs its first entry brought."""

    def __init__(self, entry: dict, meta: dict):
        self.fresh = int(entry["fresh"])
        self._entry, self._meta = entry, meta

    def as_numpy(self, name: str) -> np.ndarray | None:
        if name == "_ids":
            return np.asarray(self._entry["ids"], dtype=np.int64)
        if name == "_fresh":
            return np.array([self.fresh], dtype=np.int32)
        if name == "_last":
            return np.array([False])
        if name == "finish_reason":  # as decode's answers before the last: empty
            return np.array([b""], dtype=object)
        value = self._entry.get(name, self._meta.get(name))  # its own (output_tokens, logprobs), else the turn's
        if value is None:
            return None
        return np.array([value], dtype=np.int32) if isinstance(value, int) else np.array([value.encode()], dtype=object)


class LinkTurn:
    """One turn on a link: its number there, and the queue its answers come to (the link's and, put there by
    remote_decode, its own stream's: (result, error) pairs)."""

    def __init__(self, link: "TokenLink", number: int):
        self.link, self.number = link, number
        self.queue: queue.Queue = queue.Queue()
        self.meta: dict = {}  # the fixed outputs of its answers, from its first entry

    def close(self) -> None:
        self.link.forget(self)


class TokenLink:
    """An open link to one decode model: its stream, and the turns waiting on it."""

    def __init__(self, url: str, model: str, sealer: Sealer,
                 on_idle: Callable[["TokenLink"], None] = lambda link: None):
        import tritonclient.grpc as grpcclient

        self.on_idle = on_idle  # called when its last turn ends
        self.id = secrets.randbits(63) or 1
        self.alive = True
        self._turns: dict[int, LinkTurn] = {}
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        opened = grpcclient.InferInput("_link_open", [1], "INT64")
        opened.set_data_from_numpy(np.array([self.id], dtype=np.int64))
        seal = grpcclient.InferInput("_seal", [1], "BYTES")
        seal.set_data_from_numpy(np.array([sealer.seal(LINK, **link_fields(self.id)).encode()], dtype=object))
        self.client.async_stream_infer(model, [opened, seal], outputs=[grpcclient.InferRequestedOutput("_link_batch")])

    def turn(self) -> LinkTurn:
        turn = LinkTurn(self, next(self._numbers))
        with self._lock:
            self._turns[turn.number] = turn
        return turn

    def forget(self, turn: LinkTurn) -> None:
        with self._lock:
            self._turns.pop(turn.number, None)
            idle = not self._turns
        if idle:
            self.on_idle(self)

    def idle(self) -> bool:
        with self._lock:
            return not self._turns

    def _on_response(self, result, error) -> None:
        """On tritonclient's thread: each entry to its turn's queue."""
        if error is None and result.get_response().parameters["triton_final_response"].bool_param:
            error = "decode ended the link"
        if error is not None:
            self._failed(error)
            return
        batch = result.as_numpy("_link_batch")
        for entry in json.loads(batch.reshape(-1)[0]) if batch is not None else ():
            with self._lock:
                turn = self._turns.get(entry["turn"])
            if turn is not None:  # else a turn that ended (its client went away): its tokens are dropped
                turn.meta.update(entry.get("meta", ()))
                turn.queue.put((LinkAnswer(entry, turn.meta), None))

    def close(self) -> None:
        """This relay stops: the link's request is cancelled (decode then ends it) and its thread joined."""
        self.alive = False
        try:
            self.client.stop_stream(cancel_requests=True)
            self.client.close()
        except Exception as error:  # noqa: BLE001 - the stream had failed already
            log.debug("closing a token link: %s", error)

    def _failed(self, error) -> None:
        if not self.alive:  # closed here (idle, or the relay stops): its own cancellation is no failure
            return
        self.alive = False
        message = error.message() if hasattr(error, "message") else str(error)
        log.warning("token link to decode failed: %s", message)
        with self._lock:
            turns, self._turns = list(self._turns.values()), {}
        for turn in turns:
            turn.queue.put((None, f"its token link failed: {message}"))


class TokenLinks:
    """This relay process's links, one per decode server and model, opened on the first streamed turn and again
    after one fails or idles. A link with no turn for LINK_IDLE_S is closed: the decode server holds it as a request
    in flight, which a stopping tritonserver waits for (30 s) unless the relay has let it go."""

    def __init__(self, sealer: Sealer):
        self.sealer = sealer
        self._links: dict[tuple[str, str], TokenLink] = {}
        self._lock = threading.Lock()

    def turn(self, url: str, model: str) -> LinkTurn:
        with self._lock:  # a turn is on its link before that link can be closed as idle
            link = self._links.get((url, model))
            if link is None or not link.alive:
                link = self._links[(url, model)] = TokenLink(url, model, self.sealer, self._when_idle)
            return link.turn()

    def _when_idle(self, link: TokenLink) -> None:
        timer = threading.Timer(LINK_IDLE_S, self._close_if_idle, (link,))
        timer.daemon = True
        timer.start()

    def _close_if_idle(self, link: TokenLink) -> None:
        with self._lock:
            if not link.idle() or link not in self._links.values():
                return
            self._links = {key: open_link for key, open_link in self._links.items() if open_link is not link}
        link.close()

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
