"""Stored responses and how a chain of them maps onto the engine's stateful conversations.

A response created with `store` (the default) runs as a turn of an engine conversation (the engine's
`conversation_id` input, docs/serving.md): its state stays in the engine, so a response that continues it
(`previous_response_id`) sends only its new input, and its prompt costs what a stateful turn costs. Each engine
conversation has one *head*, the response its state ends with. Which turn a new response runs (TurnPlan):

    store false                  stateless: the whole history resent as `messages` (the prefix cache serves what it
                                 holds); nothing is kept, in the engine's store or here
    no previous response         a new conversation, with this input as its first turn
    previous is its head         the next turn of that conversation: only the new input is sent
    previous is not a head       a new conversation whose first turn is the whole history up to the previous
    (a branch, a head in use,    response plus the new input; the prefix cache holds the states at the end of
    a conversation gone)         every earlier turn, so mostly only the new input is prefilled

A response keeps only what it added (its new messages and its answer) and a link to the response before it; the
history is read back along the links. The store holds at most `capacity` responses, the oldest dropped first (a
dropped response's ancestors stay in memory while a stored response links to them; a history is bounded by the
model's context, so what this holds is bounded by `capacity` histories). Nothing here survives a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ced.tokenization import ChatTokenizer

from .schema import APIError


@dataclass(eq=False)
class StoredResponse:
    id: str
    body: dict  # the response object, as GET /v1/responses/{id} returns it
    parent: "StoredResponse | None"  # the previous response (kept alive by this link while this one is)
    added: list[dict]  # the messages this response added before its answer (engine roles)
    answer: str  # the assistant's text
    instructions: str | None  # the instructions in force for it
    conversation_id: str  # the engine conversation whose state went through it
    created: float = field(default_factory=time.time)

    def history(self) -> list[dict]:
        """Every message up to and including this response's answer, oldest first."""
        chain, node = [], self
        while node is not None:
            chain.append(node)
            node = node.parent
        messages = []
        for node in reversed(chain):
            messages += node.added + [{"role": "assistant", "content": node.answer}]
        return messages


@dataclass(frozen=True)
class TurnPlan:
    """What the engine is sent for one response."""

    kind: str  # "continue" (the next turn of `conversation_id`), "start" (a new conversation) or "stateless"
    added: list[dict]  # the messages this response adds (instructions first, when they are new)
    messages: list[dict]  # what the turn renders: `added` for "continue", the whole history for the others
    conversation_id: str | None = None  # "continue": the engine conversation

    def text_ids(self, tokenizer: ChatTokenizer) -> list[int]:
        """The engine's `_text_ids` for a stateful turn: the engine wraps them in its user-turn markers, so they
        are the rendered messages less those markers (a first turn: less <|bos|><|user|> too)."""
        return turn_ids(tokenizer, self.messages, first=self.kind == "start")


def turn_ids(tokenizer: ChatTokenizer, messages: list[dict], first: bool) -> list[int]:
    """Ids that the engine's user_turn(ids, first) makes into exactly the tokens that ChatTokenizer.render gives
    these messages after the conversation so far: one rendering, whether a history is resent whole or sent turn by
    turn (several messages in one turn are joined by the markers render puts between them). `messages` begin with
    a user or system message and end with one (the request's checks)."""
    rendered, _ = tokenizer.render(messages)
    if not first and tokenizer.trained:
        rendered = rendered[1:]  # render begins a chat with <|bos|>; a later turn has none
    probe = tokenizer.user_turn([-1], first)  # the wrapping, around a placeholder
    head = probe.index(-1)
    tail = len(probe) - head - 1
    if rendered[:head] != probe[:head] or rendered[len(rendered) - tail:] != probe[head + 1:]:
        raise ValueError("these messages do not form one turn of this model's chat template")
    return rendered[head:len(rendered) - tail]


class ResponseStore:
    """Stored responses by id, the oldest dropped past `capacity`, and each engine conversation's head."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_stored_responses must be at least 1, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._heads: dict[str, str] = {}  # engine conversation -> the stored response its state ends with
        self._busy: set[str] = set()  # conversations with a turn running: the next must not be sent to them

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        found = self._responses.get(response_id)
        if found is None:
            # OpenAI answers a previous_response_id it does not know with a 400, a GET of an unknown id with a 404
            status, code = (400, "previous_response_not_found") if param else (404, "not_found")
            raise APIError(status, f"no stored response with id {response_id!r} (never stored: store was false; "
                                   f"deleted; dropped as the oldest past this server's max_stored_responses="
                                   f"{self.capacity}; or stored before the server restarted)", param, code)
        return found

    def plan(self, previous: StoredResponse | None, new: list[dict], instructions: str | None,
             store: bool) -> TurnPlan:
        """The turn for a response with these new messages after `previous` (None: the first of a chain).
        Instructions become a system message before the input, unless the previous response ran under the same
        ones (they are in its conversation's state already: the engine cannot take text out of a state)."""
        repeated = previous is not None and previous.instructions == instructions
        added = ([{"role": "system", "content": instructions}] if instructions and not repeated else []) + new
        before = previous.history() if previous is not None else []
        if not store:
            return TurnPlan("stateless", added, before + added)
        if previous is not None and self.is_head(previous) and previous.conversation_id not in self._busy:
            return TurnPlan("continue", added, added, previous.conversation_id)
        return TurnPlan("start", added, before + added)

    def is_head(self, response: StoredResponse) -> bool:
        return self._heads.get(response.conversation_id) == response.id

    def claim(self, conversation_id: str) -> None:
        """A turn on this conversation is running: until `release`, another is a branch (a new conversation)."""
        self._busy.add(conversation_id)

    def release(self, conversation_id: str, answered: bool) -> None:
        """The turn ended. Unless it was answered and is about to be stored, its conversation's state is not known
        to end with any stored response (a turn cut off may still have been stored by the engine): it is nobody's
        head now, and the next response after its head branches into a new conversation."""
        self._busy.discard(conversation_id)
        if not answered:
            self._heads.pop(conversation_id, None)

    def add(self, response: StoredResponse) -> None:
        """Store it as its conversation's head; past capacity the oldest responses are dropped. A conversation
        whose head is dropped has no stored response left to continue it: it is left to the engine, which ends it
        once it has been idle for idle_timeout_s."""
        self._responses[response.id] = response
        self._heads[response.conversation_id] = response.id
        while len(self._responses) > self.capacity:
            self.delete(next(iter(self._responses)))

    def delete(self, response_id: str) -> bool:
        dropped = self._responses.pop(response_id, None)
        if dropped is None:
            return False
        if self._heads.get(dropped.conversation_id) == response_id:
            del self._heads[dropped.conversation_id]
        return True
