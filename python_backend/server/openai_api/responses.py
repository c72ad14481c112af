"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}.

Each response is one engine request, run as response_store.py plans it: a chain of stored responses is a stateful
engine conversation, each response sending only its new input. The answer is one assistant message of one
`output_text` part; `usage` counts as chat's does (`input_tokens` is the turn's prompt as the engine counts it,
`input_tokens_details.cached_tokens` what of it came from the prefix cache). A streamed response sends OpenAI's
events, each with its `sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per piece), response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed, or response.incomplete when
max_output_tokens cut the answer (as OpenAI's does); an error after the first event is an `error` event followed by
response.failed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from typing import Awaitable, Callable

from fastapi import Request

from .engine_client import EngineRequest
from .generation import Generation
from .response_store import ResponseStore, StoredResponse, TurnPlan
from .responses_schema import ResponseRequest
from .schema import APIError
from .streaming import EventStream

GONE = "unknown conversation_id"  # how the engine refuses a conversation it no longer holds (expired, ended)


class ResponsesAPI:
    def __init__(self, state, store: ResponseStore, max_unsent_bytes: int,
                 wait: Callable[[Request, Awaitable], Awaitable]):
        """`state`: the app's state, whose engine, metrics and tokenizer exist once the app has started; `wait`:
        awaits work unless the client leaves first (app.unless_client_leaves)."""
        self.state, self.store, self.max_unsent_bytes, self.wait = state, store, max_unsent_bytes, wait

    async def create(self, request: Request, body: ResponseRequest, adapter: str | None):
        previous = self.store.get(body.previous_response_id, "previous_response_id") \
            if body.previous_response_id else None
        plan = self.store.plan(previous, body.input_messages(), body.instructions, body.store)
        run = Run(self, body, adapter, previous, plan)
        await run.start(request)
        if not body.stream:
            try:
                text = await self.wait(request, run.generation.text())
            except BaseException:
                run.release()
                raise
            return run.finish(text)
        return EventStream(run.events(), run.id, self.max_unsent_bytes)

    def get(self, response_id: str) -> dict:
        return self.store.get(response_id).body

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            self.store.get(response_id)  # the 404, worded as a GET's
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class Run:
    """One response while it is made: its engine request, its claim on a conversation, its events."""

    def __init__(self, api: ResponsesAPI, body: ResponseRequest, adapter: str | None,
                 previous: StoredResponse | None, plan: TurnPlan):
        self.api, self.body, self.adapter, self.previous, self.plan = api, body, adapter, previous, plan
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.generation: Generation | None = None
        self.answered = False

    async def start(self, request: Request) -> None:
        """Send the turn and wait for its first token. A conversation the engine no longer holds (idle past its
        timeout) is not the client's fault: the response branches into a new conversation from the history."""
        try:
            await self._send(request)
        except APIError as error:
            if self.plan.kind != "continue" or not error.message.startswith(GONE):
                raise
            self.plan = self.api.store.plan(self.previous, self.body.input_messages(), self.body.instructions, True)
            await self._send(request)

    async def _send(self, request: Request) -> None:
        plan, body, state = self.plan, self.body, self.api.state
        try:
            text = {"messages": plan.messages} if plan.kind == "stateless" else \
                {"text_ids": plan.text_ids(state.tokenizer), "conversation_id": plan.conversation_id}
        except ValueError as error:
            raise APIError(400, f"input: {error}", "input", "invalid_value") from None
        engine_request = EngineRequest(adapter=self.adapter, max_tokens=body.token_limit,
                                       temperature=body.temperature, top_p=body.top_p, **text)
        self.generation = Generation(state.engine, state.metrics, engine_request, [], body.model)
        self.generation.request_id = self.id
        request.state.generation = self.generation
        if plan.kind == "continue":
            self.api.store.claim(plan.conversation_id)
        try:
            await self.api.wait(request, self.generation.start())
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.plan.kind == "continue":
            self.api.store.release(self.plan.conversation_id, self.answered)

    def finish(self, text: str) -> dict:
        """The whole response, stored when asked (as its conversation's new head)."""
        self.answered = True
        generation = self.generation
        body = self.response(self.status, [self.message(text, self.status)], usage(generation))
        if self.body.store:
            self.api.store.add(StoredResponse(self.id, body, self.previous, self.plan.added, text,
                                              self.body.instructions, generation.conversation_id))
        self.release()
        return body

    @property
    def status(self) -> str:
        return "incomplete" if self.generation.finish_reason == "length" else "completed"

    def response(self, status: str, output: list, usage: dict | None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "background": False,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "max_tool_calls": None, "metadata": body.metadata or {},
                "model": self.generation.model if self.generation else body.model, "output": output,
                "parallel_tool_calls": False, "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": body.store,
                "temperature": body.temperature, "text": {"format": {"type": "text"}}, "tool_choice": "none",
                "tools": [], "top_p": body.top_p, "truncation": "disabled", "usage": usage, "user": body.user}

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [output_text(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    async def events(self):
        numbers = itertools.count()

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers), **fields})}\n\n"

        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        pieces = []
        try:  # however it ends (an error, the client gone), an unanswered turn releases its conversation
            started = self.response("in_progress", [], None)
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            yield event("response.output_item.added", output_index=0, item=self.message(None, "in_progress"))
            yield event("response.content_part.added", **where, part=output_text(""))
            async with contextlib.aclosing(self.generation.pieces()) as stream:  # closed with the response: cancels
                async for piece in stream:
                    pieces.append(piece)
                    yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
            final = self.finish("".join(pieces))
        except APIError as error:
            yield event("error", code=error.code, message=error.message, param=error.param)
            failed = self.response("failed", [], None)
            failed["error"] = {"code": error.code or "server_error", "message": error.message}
            yield event("response.failed", response=failed)
            return
        finally:
            if not self.answered:
                self.release()
        text = final["output"][0]["content"][0]["text"]
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=output_text(text))
        yield event("response.output_item.done", output_index=0, item=final["output"][0])
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(generation: Generation) -> dict:
    return {"input_tokens": generation.prompt_tokens,
            "input_tokens_details": {"cached_tokens": generation.cached_tokens},
            "output_tokens": generation.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": generation.prompt_tokens + generation.completion_tokens}
