"""What every request of the OpenAI port passes through, outermost first (plain ASGI, so streams stay unbuffered):

    AccessLog   one line per request on logger `mol2.openai.access` when it ends, and the error metric per status
    CORS        (starlette's, with --allowed-origins) preflights answered, headers added to every answer, 401s too
    RequireKey  (with API keys) `Authorization: Bearer KEY`, else 401 in OpenAI's shape with WWW-Authenticate
    Unexpected  whatever no handler expected: a 500 in OpenAI's shape, logged once with its traceback

A handler tells AccessLog about its request through `request.state`: `model` (as the client named it) and
`generation` (generation.py: the adapter that answered, the token counts, TTFT, a failure after the first byte).
"""

from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..keys import CHALLENGE, ApiKeys
from .schema import APIError

log = logging.getLogger("mol2.openai")
access = logging.getLogger("mol2.openai.access")
OPEN_PATHS = ("/health",)  # answered without a key: what orchestrators probe
CLIENT_GONE = 499  # nginx's "client closed request": the status a request whose client left is logged and counted with


class AccessLog:
    """`METHOD PATH STATUS key=value ...` per request, once its answer has ended (a stream: its last event), e.g.
    `POST /v1/chat/completions 200 model=auto adapter=coding prompt_tokens=12 cached_tokens=0 completion_tokens=6
    ttft_ms=35.1 duration_ms=120.4 finish=length client=127.0.0.1:50412`; a stream that failed after its first
    byte adds `error=STATUS`. Every status from 400 up (404s of unknown routes, 401s, 499 for a client that left) is
    counted in mol2_openai_request_errors_total{status}, once."""

    def __init__(self, app: ASGIApp, metrics):
        self.app, self.metrics = app, metrics  # metrics(): the app's Metrics, made when the app starts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), None

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope: Scope, status: int | None, seconds: float) -> None:
        state = scope.get("state") or {}
        generation, model = state.get("generation"), state.get("model")
        status = status or 500  # nothing sent: the connection was cut
        fields = {"model": model}
        if generation is not None:
            fields.update(adapter=generation.model, prompt_tokens=generation.prompt_tokens,
                          cached_tokens=generation.cached_tokens, completion_tokens=generation.completion_tokens,
                          ttft_ms=None if generation.ttft_s is None else round(generation.ttft_s * 1000, 1))
        fields["duration_ms"] = round(seconds * 1000, 1)
        if generation is not None:
            fields.update(finish=generation.finish_reason, error=generation.failure)
        client = scope.get("client")
        fields["client"] = f"{client[0]}:{client[1]}" if client else None
        access.info("%s %s %d %s", scope["method"], scope["path"], status,
                    " ".join(f"{key}={value}" for key, value in fields.items() if value is not None))
        failure = status if status >= 400 else getattr(generation, "failure", None)
        metrics = self.metrics()
        if failure and metrics is not None:
            # the adapter that answered, else none: a client's unknown model name must not become a series
            metrics.failed(generation.model if generation is not None else "", failure)


class RequireKey:
    """Every request but OPEN_PATHS carries one of the keys, else 401 (OpenAI's error object, code
    invalid_api_key, and `WWW-Authenticate: Bearer`). Checked before the body is read."""

    def __init__(self, app: ASGIApp, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                              if name == b"authorization"), None)
        if self.keys.accepts(authorization):
            return await self.app(scope, receive, send)
        error = APIError(401, ApiKeys.problem(authorization), code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers=CHALLENGE)(scope, receive, send)


class Unexpected:
    """Whatever no handler expected: a 500 in OpenAI's shape, logged once with the request and its traceback.
    (Starlette's own catch-all would answer and then re-raise it for uvicorn to log again, without the request.)
    Once an answer has started its status cannot change: the connection is cut, so the client sees it unfinished."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as error:  # noqa: BLE001 - the point of this middleware
            log.error("%s %s failed: %s: %s", scope["method"], scope["path"], type(error).__name__, error,
                      exc_info=error)
            if not started:
                answer = APIError(500, f"{type(error).__name__}: {error} (logged)", code="internal_error")
                await JSONResponse(answer.body(), status_code=500)(scope, receive, send)
            # else: returning unfinished makes uvicorn close the connection
