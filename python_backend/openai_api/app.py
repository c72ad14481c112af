"""The FastAPI app: OpenAI's chat / completions / models endpoints, vLLM's adapter management, Prometheus metrics.

Bodies are read raw and validated by the models of schema.py, so every client mistake (malformed JSON, a field of
the wrong type or out of range, an unknown model) gets OpenAI's error shape with a 4xx code, never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..settings import ServingSettings
from .adapters import AdapterManager
from .engine_client import EngineClient, EngineRequest
from .generation import Generation
from .metrics import SERVED, Metrics
from .schema import (APIError, ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, UnloadAdapterRequest,
                     parse_body)

AUTO = "auto"  # routed by MoL2 inside the engine


@dataclass(frozen=True)
class OpenAISettings:
    """Where the engine is and what it serves. A field left None is resolved as the engine model resolves its own
    settings (ServingSettings.from_parameters on its config.pbtxt parameters and this process's MOL2_* variables:
    what `mol2 serve` hands both), so the front end offers the adapters the engine serves."""

    grpc_url: str  # the Triton server's gRPC endpoint, HOST:PORT
    model_dir: Path | None = None  # the served model (its config: shapes for the adapter checks, max_context)
    adapter_set: Path | None = None  # the adapter-set file the engine watches
    adapters_root: Path | None = None  # where lora_path may point; default: adapters/ beside the adapter set
    max_adapters: int | None = None
    max_rank: int | None = None


def resolve_model(name: str, manager: AdapterManager) -> str | None:
    """The request's `model` -> the engine's `adapter` input: a name of the set, "base", or None (routed)."""
    if name == AUTO:
        return None
    if name == SERVED:
        return "base"
    adapter = name.removeprefix(f"{SERVED}:")  # SGLang / LoRAX style: BASE_MODEL:ADAPTER
    if manager.current().by_name(adapter) is not None:
        return adapter
    offered = ", ".join([SERVED, AUTO, *(a.name for a in manager.current().adapters)])
    raise APIError(404, f"the model {name!r} does not exist; this server offers: {offered}", "model",
                   "model_not_found")


def _engine_request(body, adapter: str | None, **text) -> EngineRequest:
    return EngineRequest(adapter=adapter, max_tokens=body.token_limit, temperature=body.temperature,
                         top_p=body.top_p, top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos, **text)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(settings: OpenAISettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = EngineClient(settings.grpc_url)
        try:
            await engine.connect()
            served = ServingSettings.from_parameters(engine.parameters)
            app.state.model_dir = Path(settings.model_dir or served.model_dir)
            adapter_set = Path(settings.adapter_set or served.adapter_set)
            max_adapters = settings.max_adapters or served.max_adapters
            root = Path(settings.adapters_root) if settings.adapters_root else adapter_set.parent / "adapters"
            app.state.adapters = AdapterManager(adapter_set, root, app.state.model_dir, max_adapters,
                                                settings.max_rank or served.max_rank)
        except Exception as error:
            app.state.startup_error = error  # uvicorn only logs it; OpenAIServer.start reports it
            await engine.close()
            raise
        app.state.engine = engine
        app.state.metrics = Metrics(max_adapters)
        app.state.created = int(time.time())
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="mol2 OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {"msg": str(error), "loc": ()}
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return JSONResponse(APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param,
                                     "invalid_value").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = (f"no route {request.method} {request.url.path} (see GET /v1/models; the endpoints are "
                   "/v1/chat/completions, /v1/completions, /v1/models, /v1/load_lora_adapter, "
                   "/v1/unload_lora_adapter, /metrics)") if error.status_code in (404, 405) else str(error.detail)
        return JSONResponse(APIError(error.status_code, message, code="not_found").body(),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        return JSONResponse(APIError(500, f"{type(error).__name__}: {error}", code="internal_error").body(),
                            status_code=500)

    # -- generation -----------------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatCompletionRequest, await request.body())
        adapter = resolve_model(body.model, app.state.adapters)
        generation = Generation(app.state.engine, app.state.metrics,
                                _engine_request(body, adapter, messages=body.engine_messages()), body.stops, body.model)
        await generation.start()
        answer_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            text = await generation.text()
            return {"id": answer_id, "object": "chat.completion", "created": created, "model": generation.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": generation.finish_reason}],
                    "usage": generation.usage(), "system_fingerprint": None}

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            payload = {"id": answer_id, "object": "chat.completion.chunk", "created": created,
                       "model": generation.model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
            if body.include_usage:
                payload["usage"] = None
            return _sse(payload)

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            async for piece in generation.pieces():
                yield chunk({"content": piece})
            yield chunk({}, generation.finish_reason)
            if body.include_usage:
                yield _sse({"id": answer_id, "object": "chat.completion.chunk", "created": created,
                            "model": generation.model, "choices": [], "usage": generation.usage()})

        return StreamingResponse(_guarded(events()), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await request.body())
        adapter = resolve_model(body.model, app.state.adapters)
        generation = Generation(app.state.engine, app.state.metrics,
                                _engine_request(body, adapter, prompt=body.prompt), body.stops, body.model)
        await generation.start()
        answer_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(text: str, finish_reason: str | None) -> dict:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

        if not body.stream:
            text = await generation.text()
            return {"id": answer_id, "object": "text_completion", "created": created, "model": generation.model,
                    "choices": [choice(text, generation.finish_reason)], "usage": generation.usage(),
                    "system_fingerprint": None}

        def chunk(choices: list, usage: dict | None = None) -> str:
            payload = {"id": answer_id, "object": "text_completion", "created": created, "model": generation.model,
                       "choices": choices}
            if body.include_usage:
                payload["usage"] = usage
            return _sse(payload)

        async def events():
            async for piece in generation.pieces():
                yield chunk([choice(piece, None)])
            yield chunk([choice("", generation.finish_reason)])
            if body.include_usage:
                yield chunk([], generation.usage())

        return StreamingResponse(_guarded(events()), media_type="text/event-stream")

    # -- models and adapters --------------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        manager: AdapterManager = app.state.adapters
        created = app.state.created

        def card(name: str, parent: str | None, root: str) -> dict:
            return {"id": name, "object": "model", "created": created, "owned_by": "mol2", "root": root,
                    "parent": parent, "max_model_len": manager.max_context}

        cards = [card(SERVED, None, str(app.state.model_dir)), card(AUTO, SERVED, "routed by MoL2")]
        cards += [card(entry.name, SERVED, entry.path) for entry in manager.current().adapters]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = parse_body(LoadAdapterRequest, await request.body())
        # off the event loop: the checks read the adapter's weights while other requests stream
        await asyncio.to_thread(app.state.adapters.load, body.lora_name, body.lora_path, body.description)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = parse_body(UnloadAdapterRequest, await request.body())
        await asyncio.to_thread(app.state.adapters.unload, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        return Response(app.state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    return app


async def _guarded(events):
    """An error after the first byte cannot change the HTTP status: it goes out as an error event (as vLLM
    does), and the stream ends with [DONE] either way."""
    try:
        async for event in events:
            yield event
    except APIError as error:
        yield _sse(error.body())
    yield _sse("[DONE]")
