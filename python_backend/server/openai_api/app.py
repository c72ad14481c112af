"""The FastAPI app: OpenAI's chat / completions / responses / models endpoints, vLLM's adapter management, /tokenize,
/detokenize and /version, Prometheus metrics; the keys, CORS and the access log (middleware.py) around them.

Bodies are read raw and validated by the models of schema.py, so every client mistake (malformed JSON, a field of
the wrong type or out of range, an unknown model) gets OpenAI's error shape with a 4xx code, never FastAPI's 422.
What a request may cost is bounded before it costs it: a body over max_body_bytes is refused while it is read (413),
JSON nested deeper than max_json_depth before it is parsed, and a prompt whose UTF-8 bytes cannot fit in
max_prompt_tokens (at most the tokenizer's longest token per token) before the engine tokenizes it. A streamed
answer's backlog is bounded too (streaming.py). Anything unexpected is a 500, logged with its traceback.
A client that goes away frees its engine row: a stream's by starlette's disconnect watch (streaming.py), a
non-streamed answer's by `unless_client_leaves`, which cancels the engine's gRPC stream (logged and counted as 499).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ced.tokenization import ChatTokenizer, check_messages

from ...core.limits import LimitError, Limits
from ...core.settings import ServingSettings
from ..guard import GuardLimits
from ..keys import ApiKeys
from . import openapi
from .adapters import AdapterManager
from .choices import DEFAULT_MAX_N, Choices, chat_answer, check_n, completion_answer
from .engine_client import EngineClient, EngineRequest
from .generation import Generation
from .guided import grammar_of
from .metrics import SERVED, Metrics
from .middleware import CLIENT_GONE, OPEN_PATHS, AccessLog, RequireKey, Unexpected
from .response_store import ResponseStore
from .responses import ResponsesAPI
from .responses_schema import ResponseRequest
from .schema import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadAdapterRequest,
                     TokenizeRequest, UnloadAdapterRequest, parse_body)
from .streaming import EventStream, sse
from .token_logprobs import TokenTexts, chat_logprobs, completion_logprobs
from .tools import ToolDeltas, ToolUse

AUTO = "auto"  # routed by MoL2 inside the engine
log = logging.getLogger("mol2.openai")


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
    max_prompt_tokens: int | None = None  # None: the engine's (its config parameter, else MOL2_MAX_PROMPT_TOKENS)
    max_body_bytes: int = GuardLimits.max_body_bytes  # a body over it: 413, refused as it is read
    max_json_depth: int = GuardLimits.max_json_depth  # JSON nested deeper: 400 before it is parsed
    max_unsent_bytes: int = 1 << 20  # a stream's events a slow client has not taken: past it the stream is cut
    # each connection's SO_SNDBUF (the kernel doubles it): small, so a slow client's backlog waits where
    # max_unsent_bytes sees it, not in a kernel buffer autotuned up to 4 MiB; None: the kernel's default
    send_buffer_bytes: int | None = 64 << 10
    api_keys: ApiKeys = ApiKeys()  # a request must carry one (Authorization: Bearer KEY); none: every request passes
    allowed_origins: tuple[str, ...] = ()  # CORS: origins whose pages may call this API ("*": any); none: no CORS
    max_n: int = DEFAULT_MAX_N  # choices one chat / completions request may ask for (`n`); more: 400
    max_stored_responses: int = 1024  # responses kept for previous_response_id and GET; the oldest dropped first
    # the decoupled model every request streams to: a single server's `engine`; on a disaggregated prefill server,
    # a relay (`mol2`), which takes the same inputs and hands decode to the decode server
    engine_model: str = "engine"


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
                         top_p=body.top_p, top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos,
                         presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                         repetition_penalty=body.repetition_penalty, min_p=body.min_p, min_tokens=body.min_tokens,
                         stop_token_ids=body.stop_token_ids, **text)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to be over `limit` bytes: by its Content-Length
    before any of it is read, else once the bytes read pass it. What the client still sends is discarded by uvicorn
    as it arrives, never kept."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared):,} bytes, over this server's limit of {limit:,} "
                            "bytes (max_body_bytes)", None, "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over this server's limit of {limit:,} bytes (max_body_bytes)",
                           None, "request_too_large")
    return bytes(body)


@dataclass(frozen=True)
class PromptBound:
    """What a prompt may weigh before the engine tokenizes it: a text of N UTF-8 bytes is at least N /
    token_bytes tokens (no token stands for more bytes: ChatTokenizer.max_token_bytes, the engine's own bound), so
    one over max_prompt_tokens x token_bytes cannot fit and is refused without tokenizing it."""

    limits: Limits
    token_bytes: int

    def check(self, field: str, texts: list[str]) -> None:
        size = sum(len(text) if text.isascii() else len(text.encode("utf-8")) for text in texts)
        try:
            self.limits.check_text(field, size, self.token_bytes)
        except LimitError as error:
            raise APIError(400, str(error), field, "context_length_exceeded") from None


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: the engine's request was cancelled."""


T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled as soon as the client disconnects (then ClientGone). Once the body is read, what uvicorn's
    `receive` has left to say is the disconnect; cancelling `work` ends the engine's gRPC stream (engine_client.py),
    which the engine sees at its next cancellation check (every 50 ms) and drops the row at its next step."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this handler cancelled itself: neither may outlive it
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if not task.cancelled():
        return task.result()
    raise ClientGone


def model_version() -> str:
    try:
        return importlib.metadata.version("mol2-triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_app(settings: OpenAISettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = EngineClient(settings.grpc_url, settings.engine_model)
        try:
            await engine.connect()
            served = ServingSettings.from_parameters(engine.parameters)
            app.state.model_dir = Path(settings.model_dir or served.model_dir)
            adapter_set = Path(settings.adapter_set or served.adapter_set)
            max_adapters = settings.max_adapters or served.max_adapters
            root = Path(settings.adapters_root) if settings.adapters_root else adapter_set.parent / "adapters"
            app.state.adapters = AdapterManager(adapter_set, root, app.state.model_dir, max_adapters,
                                                settings.max_rank or served.max_rank)
            limits = served.limits if settings.max_prompt_tokens is None else \
                dataclasses.replace(served.limits, max_prompt_tokens=settings.max_prompt_tokens)
            app.state.tokenizer = ChatTokenizer(app.state.model_dir)
            app.state.token_texts = TokenTexts(app.state.tokenizer, app.state.adapters.vocab_size)  # for logprobs
            app.state.prompt_bound = PromptBound(limits, app.state.tokenizer.max_token_bytes)
            # the limit that holds for prompt + answer: a prompt over max_prompt_tokens is refused, and a
            # conversation stops at the model's max_context (so any prompt + max_tokens within the lesser is served)
            app.state.max_model_len = min(app.state.adapters.max_context, limits.max_prompt_tokens)
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

    app = FastAPI(title="mol2 OpenAI-compatible API", version=model_version(), lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.metrics = None  # until the app starts
    app.state.responses = responses = ResponsesAPI(app.state, ResponseStore(settings.max_stored_responses),
                                                   settings.max_unsent_bytes, unless_client_leaves)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return Response(status_code=CLIENT_GONE)  # nobody reads it: for the access log and the error metric

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {"msg": str(error), "loc": ()}
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return JSONResponse(APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param,
                                     "invalid_value").body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = (f"no route {request.method} {request.url.path} (see GET /v1/models; the endpoints are "
                   "/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /v1/models/{id}, "
                   "/v1/load_lora_adapter, /v1/unload_lora_adapter, /tokenize, /detokenize, /version, /metrics, "
                   "/health)") \
            if error.status_code in (404, 405) else str(error.detail)
        return JSONResponse(APIError(error.status_code, message, code="not_found").body(),
                            status_code=error.status_code)

    # innermost first (each add_middleware wraps what is there): see middleware.py
    app.add_middleware(Unexpected)
    if settings.api_keys:
        app.add_middleware(RequireKey, keys=settings.api_keys)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], max_age=600)
    app.add_middleware(AccessLog, metrics=lambda: app.state.metrics)
    keyed = (401,) if settings.api_keys else ()  # declared where it can happen

    async def parsed(request: Request, model):
        body = parse_body(model, await read_body(request, settings.max_body_bytes), settings.max_json_depth)
        request.state.model = getattr(body, "model", None)
        return body

    async def answer(request: Request, generation: Generation, stream: bool, build):
        """The engine's answer: sent whole by `build(text)` once generated, or streamed (`build` is then the
        events). Waiting on the engine ends when the client leaves."""
        request.state.generation = generation
        await unless_client_leaves(request, generation.start())
        if not stream:
            return build(await unless_client_leaves(request, generation.text()))
        return EventStream(_guarded(build()), generation.request_id, settings.max_unsent_bytes)

    async def several(request: Request, body, engine_request: EngineRequest, kind: str, build):
        """n > 1 choices of one prompt (choices.py), answered as `answer` answers one."""
        check_n(body.n, settings.max_n)
        choices = Choices(app.state.engine, app.state.metrics, engine_request, body.stops, body.model, body.n)
        choices.request_id = f"{kind}-{uuid.uuid4().hex}"
        return await answer(request, choices, body.stream, build(choices, choices.request_id, int(time.time()),
                                                                 body.include_usage, body.stream))

    # -- generation -----------------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions", openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500, 503, 507))
    async def chat_completions(request: Request):
        body = await parsed(request, ChatCompletionRequest)
        app.state.prompt_bound.check("messages", [message.text() for message in body.messages])
        adapter = resolve_model(body.model, app.state.adapters)
        tools = ToolUse(body)  # tools.py: the prompt's tools, a forced call's grammar, the answer's calls
        grammar = grammar_of(body, tools.grammar())
        engine_request = _engine_request(body, adapter, messages=tools.messages(body.engine_messages()),
                                         structured_output=grammar.to_json() if grammar else None,
                                         logprobs=body.engine_logprobs)
        if body.n > 1:
            _one_choice_for(body, tools.active or body.logprobs, "tools or logprobs")
            return await several(request, body, engine_request, "chatcmpl", chat_answer)
        generation = Generation(app.state.engine, app.state.metrics, engine_request, body.stops, body.model)
        answer_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        generation.request_id = answer_id

        def logprobs(entries: list) -> dict | None:
            return chat_logprobs(entries, app.state.token_texts, body.top_logprobs or 0) if body.logprobs else None

        def whole(text: str) -> dict:
            content, calls = tools.split(text)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            return {"id": answer_id, "object": "chat.completion", "created": created, "model": generation.model,
                    "choices": [{"index": 0, "message": message, "logprobs": logprobs(generation.logprobs),
                                 "finish_reason": "tool_calls" if calls else generation.finish_reason}],
                    "usage": generation.usage(), "system_fingerprint": None}

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            payload = {"id": answer_id, "object": "chat.completion.chunk", "created": created,
                       "model": generation.model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(generation.new_logprobs()),
                                    "finish_reason": finish_reason}]}
            if body.include_usage:
                payload["usage"] = None
            return sse(payload)

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            deltas = ToolDeltas(tools)  # content deltas, and each complete call as a tool_calls delta
            async with contextlib.aclosing(generation.pieces()) as pieces:  # closed with the stream: cancels
                async for piece in pieces:
                    for delta in deltas.feed(piece):
                        yield chunk(delta)
            for delta in deltas.flush():
                yield chunk(delta)
            yield chunk({}, "tool_calls" if deltas.called else generation.finish_reason)
            if body.include_usage:
                yield sse({"id": answer_id, "object": "chat.completion.chunk", "created": created,
                           "model": generation.model, "choices": [], "usage": generation.usage()})

        return await answer(request, generation, body.stream, events if body.stream else whole)

    @app.post("/v1/completions", openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500, 503, 507))
    async def completions(request: Request):
        body = await parsed(request, CompletionRequest)
        app.state.prompt_bound.check("prompt", [body.prompt])
        adapter = resolve_model(body.model, app.state.adapters)
        grammar = grammar_of(body)
        engine_request = _engine_request(body, adapter, prompt=body.prompt,
                                         structured_output=grammar.to_json() if grammar else None,
                                         logprobs=body.engine_logprobs)
        if body.n > 1:
            _one_choice_for(body, body.logprobs is not None, "logprobs")
            return await several(request, body, engine_request, "cmpl", completion_answer)
        generation = Generation(app.state.engine, app.state.metrics, engine_request, body.stops, body.model)
        answer_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        generation.request_id = answer_id
        offset = 0  # where a streamed chunk's tokens start in the answer's text

        def logprobs(entries: list) -> dict | None:
            nonlocal offset
            if body.logprobs is None:
                return None
            shaped = completion_logprobs(entries, app.state.token_texts, body.logprobs, offset)
            offset += sum(len(token) for token in shaped["tokens"])
            return shaped

        def choice(text: str, finish_reason: str | None, entries: list | None = None) -> dict:
            entries = generation.new_logprobs() if entries is None else entries
            return {"index": 0, "text": text, "logprobs": logprobs(entries), "finish_reason": finish_reason}

        def whole(text: str) -> dict:
            return {"id": answer_id, "object": "text_completion", "created": created, "model": generation.model,
                    "choices": [choice(text, generation.finish_reason, generation.logprobs)],
                    "usage": generation.usage(), "system_fingerprint": None}

        def chunk(choices: list, usage: dict | None = None) -> str:
            payload = {"id": answer_id, "object": "text_completion", "created": created, "model": generation.model,
                       "choices": choices}
            if body.include_usage:
                payload["usage"] = usage
            return sse(payload)

        async def events():
            async with contextlib.aclosing(generation.pieces()) as pieces:  # closed with the stream: cancels
                async for piece in pieces:
                    yield chunk([choice(piece, None)])
            yield chunk([choice("", generation.finish_reason)])
            if body.include_usage:
                yield chunk([], generation.usage())

        return await answer(request, generation, body.stream, events if body.stream else whole)

    # -- responses (responses.py) ----------------------------------------------------------------------------------

    @app.post("/v1/responses", openapi_extra=openapi.request_body(ResponseRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500, 503, 507))
    async def create_response(request: Request):
        body = await parsed(request, ResponseRequest)
        app.state.prompt_bound.check("input", [m["content"] for m in body.input_messages()] +
                                     [body.instructions or ""])
        return await responses.create(request, body, resolve_model(body.model, app.state.adapters))

    @app.get("/v1/responses/{response_id}", responses=openapi.errors(*keyed, 404))
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=openapi.errors(*keyed, 404))
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    # -- models and adapters --------------------------------------------------------------------------------------

    def cards() -> list[dict]:
        manager: AdapterManager = app.state.adapters

        def card(name: str, parent: str | None, root: str) -> dict:
            return {"id": name, "object": "model", "created": app.state.created, "owned_by": "mol2", "root": root,
                    "parent": parent, "max_model_len": app.state.max_model_len}

        return [card(SERVED, None, str(app.state.model_dir)), card(AUTO, SERVED, "routed by MoL2"),
                *(card(entry.name, SERVED, entry.path) for entry in manager.current().adapters)]

    @app.get("/v1/models", responses=openapi.errors(*keyed, 500))
    async def models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model_id:path}", responses=openapi.errors(*keyed, 404, 500))
    async def model(model_id: str):
        found = next((card for card in cards() if card["id"] == model_id), None)
        if found is None:
            offered = ", ".join(card["id"] for card in cards())
            raise APIError(404, f"the model {model_id!r} does not exist; this server offers: {offered}", "model",
                           "model_not_found")
        return found

    @app.post("/v1/load_lora_adapter", openapi_extra=openapi.request_body(LoadAdapterRequest),
              responses=openapi.errors(400, *keyed, 413, 500))
    async def load_lora_adapter(request: Request):
        body = await parsed(request, LoadAdapterRequest)
        # off the event loop: the checks read the adapter's weights while other requests stream
        await asyncio.to_thread(app.state.adapters.load, body.lora_name, body.lora_path, body.description)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=openapi.request_body(UnloadAdapterRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500))
    async def unload_lora_adapter(request: Request):
        body = await parsed(request, UnloadAdapterRequest)
        await asyncio.to_thread(app.state.adapters.unload, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- tokens -----------------------------------------------------------------------------------------------------

    @app.post("/tokenize", openapi_extra=openapi.request_body(TokenizeRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500))
    async def tokenize(request: Request):
        """vLLM's: the tokens the engine would see for this prompt or these messages (the same chat rendering)."""
        body = await parsed(request, TokenizeRequest)
        if body.model is not None:
            resolve_model(body.model, app.state.adapters)
        tokenizer: ChatTokenizer = app.state.tokenizer
        if body.messages is not None:
            app.state.prompt_bound.check("messages", [message.text() for message in body.messages])
            try:
                messages = check_messages(body.engine_messages())  # what the engine checks, in its words
            except ValueError as error:
                raise APIError(400, str(error), "messages", "invalid_value") from None
            tokens = (await asyncio.to_thread(tokenizer.render, messages))[0]
        else:
            app.state.prompt_bound.check("prompt", [body.prompt])
            tokens = await asyncio.to_thread(tokenizer.completion_prompt if body.add_special_tokens else
                                             tokenizer.encode, body.prompt)
        return {"count": len(tokens), "max_model_len": app.state.max_model_len, "tokens": tokens}

    @app.post("/detokenize", openapi_extra=openapi.request_body(DetokenizeRequest),
              responses=openapi.errors(400, *keyed, 404, 413, 500))
    async def detokenize(request: Request):
        body = await parsed(request, DetokenizeRequest)
        if body.model is not None:
            resolve_model(body.model, app.state.adapters)
        vocabulary = app.state.adapters.vocab_size
        wrong = next((i for i, token in enumerate(body.tokens) if not 0 <= token < vocabulary), None)
        if wrong is not None:
            raise APIError(400, f"tokens[{wrong}]: {body.tokens[wrong]} is not a token id of this model (0 to "
                                f"{vocabulary - 1})", f"tokens[{wrong}]", "invalid_value")
        return {"prompt": await asyncio.to_thread(app.state.tokenizer.decode, body.tokens)}

    # -- the server -----------------------------------------------------------------------------------------------

    @app.get("/version", responses=openapi.errors(*keyed))
    async def version():
        return {"version": app.version}

    @app.get("/metrics", responses=openapi.errors(*keyed))
    async def metrics():
        return Response(app.state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    openapi.install(app, [ChatCompletionRequest, CompletionRequest, ResponseRequest, LoadAdapterRequest,
                          UnloadAdapterRequest, TokenizeRequest, DetokenizeRequest], bearer=bool(settings.api_keys),
                    open_paths=OPEN_PATHS)
    return app


def _one_choice_for(body, asked: bool, what: str) -> None:
    """n > 1 answers are built by choices.py, which does not carry these yet: refused, not dropped."""
    if asked:
        raise APIError(400, f"n: n > 1 together with {what} is not supported yet", "n", "unsupported_parameter")


async def _guarded(events):
    """An error after the first byte cannot change the HTTP status: it goes out as an error event (as vLLM
    does), and the stream ends with [DONE] either way. Closing this closes `events` (and the engine's request)."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except APIError as error:
        yield sse(error.body())
    yield sse("[DONE]")
