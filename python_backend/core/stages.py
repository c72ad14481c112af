"""The logic of one turn's three stages, free of Triton so it is tested without a server.

prefill: the new user turn through the adapter-free stage (never the history again), H19 pooled over the turn,
         the state serialized for the transfer. The caller (the relay) holds the conversation's turn lock until
         the turn's state is committed.
route:   an explicit adapter always wins; otherwise the MoL2 head scores the pooled H19. The decision is the
         31-bit FNV-1a hash of the adapter's path, written into the transfer's metadata.
decode:  maps the hash through its own registry (an unknown hash is an error), replays W positions under the
         adapter, streams tokens, and stores the state for the next turn; or, on a decode-only server
         (disaggregated), hands the final state back to the prefill server, which owns the store.
route-only (a client with its own router): prefill on a copy of the state, route, write nothing.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor

from ced.batched import BatchedEngine
from ced.engine import CEDEngine, SamplingParams
from ced.tokenization import ChatTokenizer

from .adapter_set import AdapterSet
from .delta_transfer import DecodeTransfers, Received
from .detokenize import check_ids
from .fnv import BASE
from .inputs import RequestError
from .limits import check_context
from .store import ConversationStore
from .transfer import encode_state

BASE_NAME = "base"  # the explicit `adapter` value that asks for no adapter


@dataclass
class TransferMeta:
    """The per-request row that travels with the state: [length, adapter hash]."""

    length: int
    adapter_hash: int = BASE

    def to_tensor(self) -> Tensor:
        return torch.tensor([self.length, self.adapter_hash], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values) -> "TransferMeta":
        values = [int(v) for v in values]
        if len(values) != 2:
            raise RequestError(f"transfer metadata has {len(values)} fields, expected 2")
        return cls(*values)


@dataclass
class PrefillResult:
    conversation_id: str
    h19_pooled: Tensor  # (C,)
    state: bytes  # empty for a route-only prefill
    meta: TransferMeta


class PrefillStage:
    def __init__(self, engine: CEDEngine, store: ConversationStore, tokenizer: ChatTokenizer):
        self.engine, self.store, self.tokenizer = engine, store, tokenizer

    def run(self, conversation_id: str | None, text_ids: list[int], route_only: bool = False) -> PrefillResult:
        """`route_only`: H19 for a routing decision only. Either way the stored state is read, never written or
        locked."""
        if not text_ids:
            raise RequestError("text_input is empty")
        check_ids(text_ids, self.engine.config.vocab_size, "_text_ids")
        new = not conversation_id
        conversation_id = conversation_id or ("" if route_only else uuid.uuid4().hex)
        state = self.engine.new_conversation() if new else self.store.load(conversation_id)
        first = state.length == 0
        tokens = self.tokenizer.user_turn(text_ids, first=first)
        skip = 1 if first and self.tokenizer.trained else 0  # pool the turn without <|bos|>, as the head was trained
        check_context(state.length, len(tokens), self.engine.config.max_context)
        self.store.limits.check_prompt(len(tokens))
        # The loaded state is a private copy: prefilling it changes nothing stored. The turn lock is the caller's
        # (the relay takes it in its own process, where the turn ends: an OS lock cannot change hands).
        h19 = self.engine.prefill(state, tokens)
        encoded = b"" if route_only else encode_state(state, self.engine.config)
        return PrefillResult(conversation_id, h19[skip:].mean(0), encoded, TransferMeta(state.length))


@dataclass
class RouteDecision:
    adapter: str  # a name from the adapter set, or "base"
    adapter_hash: int
    scores: dict[str, float] = field(default_factory=dict)
    routed: bool = False  # chosen by the head (not named by the client)
    decision_ms: float = 0.0


class RouterStage:
    """`score` maps pooled H19 (C,) to one score per adapter of the set, or is None when no head is loaded."""

    def __init__(self, score: Callable[[Tensor, AdapterSet], dict[str, float]] | None):
        self.score = score

    def run(self, adapter_set: AdapterSet, h19_pooled: Tensor, explicit: str | None) -> RouteDecision:
        if explicit:
            if explicit == BASE_NAME:
                return RouteDecision(BASE_NAME, BASE)
            entry = adapter_set.by_name(explicit)
            if entry is None:
                known = ", ".join([BASE_NAME, *(a.name for a in adapter_set.adapters)])
                raise RequestError(f"unknown adapter {explicit!r}; this server offers: {known}")
            return RouteDecision(entry.name, entry.hash)
        if self.score is None or not adapter_set.adapters:
            raise RequestError("no router head is loaded for this adapter set: name an adapter in `adapter`")
        started = time.perf_counter()
        scores = self.score(h19_pooled, adapter_set)
        chosen = max(scores, key=scores.get)
        elapsed = (time.perf_counter() - started) * 1e3
        return RouteDecision(chosen, adapter_set.by_name(chosen).hash, scores, True, elapsed)


@dataclass
class DecodeRequest:
    conversation_id: str
    state: bytes
    meta: TransferMeta
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    end_conversation: bool = False
    return_state: bool = False  # disaggregated: the prefill server owns the store and the turn lock
    ignore_eos: bool = False  # generate past the tokenizer's stop tokens (benchmarks)
    final_state: bytes = b""  # set when done, if return_state: a delta on the state received, or the full state
    received: Received | None = None  # the state `state` carries (DecodeStage.receive), once resolved


class DecodeStage:
    def __init__(self, engine: CEDEngine, store: ConversationStore, tokenizer: ChatTokenizer,
                 load_errors: dict[str, str] | None = None, batched: BatchedEngine | None = None,
                 transfers: DecodeTransfers | None = None):
        """`batched`: decode on the serving engine's path (torch), so a split server answers as the single one.
        `transfers`: the final states kept for the delta transfer (python_backend/core/delta_transfer.py)."""
        self.engine, self.store, self.tokenizer, self.batched = engine, store, tokenizer, batched
        self.load_errors = {} if load_errors is None else load_errors  # the set's adapters that failed to load
        self.transfers = DecodeTransfers(engine.config) if transfers is None else transfers

    def receive(self, request: DecodeRequest) -> Received:
        """The state the request's bytes carry (a full state, or a delta on a cached one: else BaseRefused, before
        anything is run or counted)."""
        if request.received is None:
            request.received = self.transfers.receive(request.conversation_id, request.state)
        return request.received

    def adapter_for(self, adapter_set: AdapterSet, value: int) -> str | None:
        if value == BASE:
            return None
        entry = adapter_set.by_hash(value)
        if entry is not None and entry.name in self.load_errors:
            raise RequestError(f"adapter {entry.name!r} is in the adapter set but failed to load: "
                               f"{self.load_errors[entry.name]}")
        if entry is None or entry.name not in self.engine.adapters:
            raise RequestError(f"the transfer names adapter hash {value}, which this decode server does not have "
                               "loaded (its adapter set differs from the prefill server's)")
        return entry.name

    def run(self, adapter_set: AdapterSet, request: DecodeRequest) -> Iterator[tuple[int, int]]:
        """Yields (token id, positions replayed) per generated token; when done, stores the state (or frees it at
        the end of the conversation), or with `return_state` puts it in `request.final_state` instead. Closed
        early (a cancelled request), it stores nothing: the conversation stays as it was before the turn."""
        locked = False
        try:
            if not request.return_state:  # it commits here: the turn lock is taken here, in this process
                self.store.begin_turn(request.conversation_id)
                locked = True
            adapter = self.adapter_for(adapter_set, request.meta.adapter_hash)
            received = self.receive(request)
            state = received.state
            if state.length != request.meta.length:
                raise RequestError(f"transfer says {request.meta.length} tokens, the state holds {state.length}")
            budget = min(request.max_tokens, self.engine.config.max_context - state.length)
            stops = () if request.ignore_eos else self.tokenizer.stop_ids
            if self.batched is None:
                logits, replayed = self.engine.replay(state, adapter)
                for token in self.engine.generate(state, adapter, logits, budget, request.sampling,
                                                  stops):
                    yield token, replayed
            else:
                row = self.batched.open(state)
                try:
                    logits, (replayed,) = self.batched.replay([row], [adapter])
                    for token in self.batched.generate(row, adapter, logits[0], budget, request.sampling,
                                                       stops):
                        yield token, replayed
                    state = self.batched.export(row)
                finally:
                    self.batched.close(row)
            if request.return_state:  # the relay rebuilds it from what it sent and this
                request.final_state = self.transfers.reply(request.conversation_id, received, state,
                                                           request.end_conversation)
            else:
                commit_turn(self.store, request.conversation_id, state, request.end_conversation)
        finally:
            if locked:
                self.store.end_turn(request.conversation_id)


def commit_turn(store: ConversationStore, conversation_id: str, state, end_conversation: bool) -> None:
    """The turn's final state becomes the conversation's one stored copy; the last turn frees it instead."""
    if end_conversation:
        store.delete(conversation_id)
    else:
        store.save(conversation_id, state)

