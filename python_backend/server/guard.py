"""The HTTP port clients reach: an asyncio reverse proxy in front of tritonserver's HTTP, which listens on a
loopback port of its own (`mol2 serve` starts both; python_backend/server/supervisor.py keeps tritonserver running).

Triton's HTTP parser cannot survive every body (arrays nested 300,000 deep, ~600 KB, crash it with SIGSEGV), and
answers wrong JSON types with a 500 and parser internals. So before anything reaches it:
- a body over `max_body_bytes` gets 413, JSON nested deeper than `max_json_depth` gets 400 (whatever the endpoint;
  a compressed body is checked as it decompresses, and forwarded decompressed);
- a `generate` / `generate_stream` body must be a JSON object whose fields fit the model's inputs as Triton
  reports them (`/v2/models/NAME/config`, cached per server start): 400 naming the field otherwise;
- `/v2/health/ready` is 503 while tritonserver is down or a required peer (the decode server of a `--role
  prefill` server) is unreachable, with the reasons; `GET /v2/status` says what the guard knows;
- with API keys configured (`mol2 serve --api-key`), every request but the health probes (OPEN_PATHS) must carry
  `Authorization: Bearer KEY`, else 401 with `WWW-Authenticate: Bearer`; the header is not passed on.
Everything else passes through unchanged, answers streamed back as they come (generate_stream's SSE unbuffered);
the client's Accept-Encoding is passed on as it is, none added (a client that asks for no encoding gets none).
A client that goes away cancels its handler (handler_cancellation), which closes tritonserver's request at once,
whether its answer was streaming or not yet begun (tritonserver 2.51 does not pass that on to an ensemble step
already running, so a `mol2` turn runs on to its max_tokens; the OpenAI port cancels the engine's own request).
A stream whose client reads slower than tritonserver answers is held here, not in tritonserver, up to
`max_unsent_bytes`; past that it ends with an error event (as does one whose tritonserver went away), logged.
The metrics port is served here too: Triton's metrics plus the guard's own (restarts, refusals, readiness).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import math
import re
import struct
import termios
import time
import zlib
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import web
from yarl import URL

from ..core.server_errors import STATUS, server_condition
from .keys import CHALLENGE, ApiKeys

log = logging.getLogger("mol2.guard")
_GENERATE = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/generate(?:_stream)?$")
# Not forwarded either way: hop-by-hop headers, and what aiohttp sets itself for the body it sends.
_REQUEST_DROPPED = {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
                    "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}
# Open without an API key, so that orchestrators can probe (everything else needs one when keys are configured).
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
_RESPONSE_DROPPED = {"connection", "keep-alive", "proxy-authenticate", "te", "trailer", "transfer-encoding", "upgrade"}
_INTEGERS = {**{f"TYPE_INT{bits}": (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) for bits in (8, 16, 32, 64)},
             **{f"TYPE_UINT{bits}": (0, (1 << bits) - 1) for bits in (8, 16, 32, 64)}}
# How tritonserver's HTTP front end words a request it cannot map onto tensors or parameters, or /infer on a
# decoupled model. It answers those with a 5xx, though the request is at fault: the guard passes them on as 400 (the
# message unchanged).
TRITON_PARSER_ERRORS = ("Unable to parse", "failed to parse the request JSON buffer", "attempt to access JSON",
                        "Expected JSON object for keyword", "HTTP end point doesn't support models with decoupled")
_FLOATS = {"TYPE_FP16": 65504.0, "TYPE_BF16": 3.3895313892515355e38, "TYPE_FP32": 3.4028234663852886e38,
           "TYPE_FP64": 1.7976931348623157e308}
# the smallest positive value of each type (subnormal): a number at most half of it would arrive as 0
_FLOAT_TINY = {"TYPE_FP16": 5.960464477539063e-08, "TYPE_BF16": 9.183549615799121e-41,
               "TYPE_FP32": 1.401298464324817e-45, "TYPE_FP64": 5e-324}


@dataclass(frozen=True)
class GuardLimits:
    max_body_bytes: int = 4 << 20  # a 16K-token prompt, every character \u-escaped, is ~0.4 MB
    max_json_depth: int = 64  # generate bodies are flat; /infer nests a few levels per tensor
    max_unsent_bytes: int = 1 << 20  # of one stream, that its client has not taken yet (~2,500 generate_stream events)


@dataclass
class ServerState:
    """What the supervisor knows and the guard answers from (one event loop: no locking)."""

    role: str = "all"
    upstream: str | None = None  # tritonserver's HTTP, host:port, while it runs and is ready
    upstream_metrics: str | None = None
    generation: int = 0  # +1 per tritonserver start: what the guard cached of the previous one is stale
    pid: int | None = None  # tritonserver's process id (its latest start)
    restarts: int = 0
    last_exit: str | None = None  # how tritonserver last ended, for the status and the 503s
    starting: bool = True
    peer_problems: dict[str, str] = field(default_factory=dict)  # peer -> why it cannot serve (empty: all fine)
    refused: dict[str, int] = field(default_factory=dict)  # refusal reason -> count
    cut: dict[str, int] = field(default_factory=dict)  # why the guard ended a stream early -> count
    details: dict = field(default_factory=dict)  # ports, store, limits: shown on the status endpoint
    started_at: float = field(default_factory=time.time)

    def not_ready_reasons(self) -> list[str]:
        reasons = []
        if self.upstream is None:
            reasons.append("tritonserver is starting" if self.starting and not self.restarts else
                           f"tritonserver is restarting ({self.last_exit})")
        reasons.extend(self.peer_problems.values())
        return reasons

    def status(self) -> dict:
        reasons = self.not_ready_reasons()
        return {"ready": not reasons, "reasons": reasons, "role": self.role, "tritonserver": {
            "running": self.upstream is not None, "pid": self.pid, "starts": self.generation, "restarts": self.restarts,
            "last_exit": self.last_exit}, "peers": dict(self.peer_problems), "refused": dict(self.refused),
            "streams_cut": dict(self.cut),
            "uptime_s": round(time.time() - self.started_at, 1), **self.details}


class Refusal(Exception):
    """A request the guard answers itself: HTTP `status`, `message` as Triton's {"error": ...}, counted by
    `reason`."""

    def __init__(self, status: int, message: str, reason: str):
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


# -- the checks, free of aiohttp (unit-tested on their own) -----------------------------------------------------


def json_depth(data: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text; brackets inside strings do not count. Linear and
    vectorized, so a hostile body costs milliseconds, and never recursive. For text that is not valid JSON it
    still bounds the depth any parser reaches before it stops at the first error."""
    if b"[" not in data and b"{" not in data:
        return 0
    # Escaped backslashes first (left to right, as a parser pairs them), then every \" left is an escaped quote:
    # what remains of the quotes delimit strings.
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    chars = np.frombuffer(text, dtype=np.uint8)
    outside = (np.cumsum(chars == ord('"'), dtype=np.int32) & 1) == 0
    opens = ((chars == ord("[")) | (chars == ord("{"))) & outside
    closes = ((chars == ord("]")) | (chars == ord("}"))) & outside
    depth = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32), dtype=np.int32)
    return int(depth.max(initial=0))


def check_depth(data: bytes, limit: int) -> None:
    depth = json_depth(data)
    if depth > limit:
        raise Refusal(400, f"the request's JSON nests {depth} levels deep, over this server's limit of {limit} "
                           "(max_json_depth)", "json_depth")


def parse_json(data: bytes):
    """The body as JSON, strictly: UTF-8, no NaN/Infinity, no field given twice."""

    def constant(name):
        raise ValueError(f"{name} is not a JSON number")

    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"field {key!r} is given twice")
            seen[key] = value
        return seen

    try:
        return json.loads(data.decode("utf-8"), parse_constant=constant, object_pairs_hook=unique)
    except UnicodeDecodeError as error:
        raise Refusal(400, f"the request body is not UTF-8 text (byte {error.start})", "json_invalid") from None
    except json.JSONDecodeError as error:
        raise Refusal(400, f"the request body is not valid JSON: {error.msg} at line {error.lineno}, column "
                           f"{error.colno}", "json_invalid") from None
    except (ValueError, RecursionError) as error:
        raise Refusal(400, f"the request body is not valid JSON: {error}", "json_invalid") from None


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _flatten(value) -> list:
    if not isinstance(value, list):
        return [value]
    flat, stack = [], [iter(value)]  # iterative: depth is bounded already, but no recursion is simpler to trust
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _check_element(name: str, item, data_type: str) -> None:
    if data_type in ("TYPE_STRING", "TYPE_BYTES"):
        if not isinstance(item, str):
            raise Refusal(400, f"{name} must be a string, got {_shown(item)}", "field_type")
    elif data_type == "TYPE_BOOL":
        if not isinstance(item, bool):
            raise Refusal(400, f"{name} must be true or false, got {_shown(item)}", "field_type")
    elif data_type in _INTEGERS:
        low, high = _INTEGERS[data_type]
        if isinstance(item, bool) or not isinstance(item, int):
            raise Refusal(400, f"{name} must be an integer, got {_shown(item)}", "field_type")
        if not low <= item <= high:
            raise Refusal(400, f"{name} must be an integer from {low} to {high} ({data_type[5:]}), got {item}",
                          "field_type")
    elif data_type in _FLOATS:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise Refusal(400, f"{name} must be a number, got {_shown(item)}", "field_type")
        if not math.isfinite(item) or abs(item) > _FLOATS[data_type]:
            raise Refusal(400, f"{name} must be a finite number within {data_type[5:]}'s range, got {item}",
                          "field_type")
        if item != 0 and abs(item) <= _FLOAT_TINY[data_type] / 2:  # top_p 5e-324 reached the engine as 0.0
            raise Refusal(400, f"{name} {item!r} is too small for {data_type[5:]}: it would arrive as 0 (the smallest "
                               f"positive {data_type[5:]} is {_FLOAT_TINY[data_type]:.4g})", "field_type")


def _scalar(value) -> bool:
    """What Triton takes as a request parameter: a string, a boolean or a finite number."""
    return isinstance(value, (str, int, float)) and not (isinstance(value, float) and not math.isfinite(value))


def check_generate(body, model: str, config: dict) -> None:
    """A generate body against the model's inputs (`config` as /v2/models/NAME/config gives it). Fields that are
    not inputs are request parameters to Triton: they must be a string, number or boolean."""
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(body), "a number")
        raise Refusal(400, f"a generate request must be a JSON object of model {model}'s inputs, got {kind}",
                      "field_type")
    inputs = {spec["name"]: spec for spec in config.get("input", [])}
    batched = int(config.get("max_batch_size", 0)) > 0
    for name, value in body.items():
        spec = inputs.get(name)
        if spec is None:
            if name == "parameters" and isinstance(value, dict):
                wrong = [key for key, item in value.items() if not _scalar(item)]
                if wrong:
                    raise Refusal(400, f"parameters.{wrong[0]} must be a string, number or boolean, got "
                                       f"{_shown(value[wrong[0]])}", "field_type")
            elif not _scalar(value):
                raise Refusal(400, f"{name} is not an input of model {model} (its inputs: {', '.join(inputs)}); as a "
                                   f"request parameter it must be a string, number or boolean, got {_shown(value)}",
                              "field_type")
            continue
        items = _flatten(value)
        for item in items:
            _check_element(name, item, spec["data_type"])
        dims = [int(d) for d in spec.get("dims", [])]
        if not batched and all(d >= 0 for d in dims) and len(items) != math.prod(dims):
            raise Refusal(400, f"{name} must hold {math.prod(dims)} value{'s' * (math.prod(dims) != 1)} (dims "
                               f"{dims}), got {len(items)}", "field_type")
    missing = [name for name, spec in inputs.items() if not spec.get("optional") and name not in body]
    if missing:
        raise Refusal(400, f"{missing[0]} is required (an input of model {model} that is not optional)",
                      "field_type")


def parser_refusal(answer: bytes) -> Refusal | None:
    """Triton's 5xx for a request it could not parse, as the 400 it should have been (None: a real 5xx)."""
    try:
        message = json.loads(answer).get("error", "")
    except (ValueError, AttributeError):
        return None
    if isinstance(message, str) and message.startswith(TRITON_PARSER_ERRORS):
        return Refusal(400, message, "triton_parser")
    return None


def error_status(status: int, answer: bytes) -> int:
    """The status an error answer should have: Triton's generate answers every error a model sends with 400, so a
    server condition the engine marked (server_errors.py: a full disk, damaged state, a failure of its own) gets
    the 5xx it stands for."""
    try:
        message = json.loads(answer).get("error", "")
    except (ValueError, AttributeError):
        return status
    condition = server_condition(message) if isinstance(message, str) else None
    return STATUS[condition] if condition is not None and status < 500 else status


def decoded(body: bytes, encoding: str | None) -> bytes:
    """An answer's body as text to inspect (gzip or deflate undone); b"" when it cannot be."""
    if not encoding or encoding == "identity":
        return body
    try:
        return zlib.decompress(body, {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[encoding.lower()])
    except (KeyError, zlib.error):
        return b""


# -- the proxy ------------------------------------------------------------------------------------------------


def sse_error(message: str) -> bytes:
    """An error event as tritonserver's generate_stream writes one."""
    return b"data: " + json.dumps({"error": message}, separators=(",", ":")).encode() + b"\n\n"


def kernel_unsent(transport: asyncio.Transport | None) -> int:
    """Bytes in the kernel's send queue of a client's socket that the client has not acknowledged (Linux's
    SIOCOUTQ; 0 where there is no such query). They count as unsent: on loopback the kernel lets that queue grow to
    4 MB (net.ipv4.tcp_wmem), room for a whole 4,096-token answer, so what the guard's own buffers hold alone would
    not reach a bound of 1 MiB."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    query = getattr(termios, "TIOCOUTQ", None)
    if sock is None or query is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), query, b"\0\0\0\0"))[0]
    except OSError:  # the socket is closed already
        return 0


class Outbox:
    """A streamed answer on its way to the client. `put` never waits, so tritonserver is read as fast as it
    answers and never holds a slow client's output; a task of its own writes to the client as fast as the client
    reads. `unsent()` is what the client has not taken: queued here, in the transport's buffer, in the kernel's."""

    def __init__(self, request: web.Request, response: web.StreamResponse):
        self._transport = request.transport
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._queued = 0
        self._writer = asyncio.create_task(self._write(response))

    async def _write(self, response: web.StreamResponse) -> None:
        while (data := await self._queue.get()) is not None:
            self._queued -= len(data)
            await response.write(data)  # waits while the client does not read
        await response.write_eof()

    def put(self, data: bytes) -> None:
        self._queued += len(data)
        self._queue.put_nowait(data)

    def unsent(self) -> int:
        transport = self._transport
        if transport is None or transport.is_closing():
            return self._queued
        return self._queued + transport.get_write_buffer_size() + kernel_unsent(transport)

    @property
    def client_gone(self) -> bool:
        return self._writer.done()  # before finish(), the writer ends only when a write failed

    async def finish(self) -> None:
        """Send what is queued, then the answer's end; returns early if the client goes away."""
        self._queue.put_nowait(None)
        try:
            await self._writer
        except ConnectionError:
            pass

    def abandon(self) -> None:
        """Stop writing (the client went away, or the handler was cancelled)."""
        if not self._writer.done():
            self._writer.cancel()
        elif not self._writer.cancelled():
            self._writer.exception()  # a failed write is how the client's leaving shows: retrieved, not logged


class Guard:
    def __init__(self, state: ServerState, limits: GuardLimits = GuardLimits(), config_ttl_s: float = 30.0,
                 keys: ApiKeys = ApiKeys()):
        self.state, self.limits, self.config_ttl_s, self.keys = state, limits, config_ttl_s, keys
        self._configs: dict[tuple, tuple[float, dict | None]] = {}  # (generation, model, version) -> (when, config)
        self._session: aiohttp.ClientSession | None = None

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Bytes pass as they are (no decompression of answers); no total timeout: a stream lasts the answer. No
            # idle keep-alive connection either: tritonserver's shutdown would wait for it (15 s). No Accept-Encoding
            # of aiohttp's own: tritonserver compresses what the client did not ask to be compressed (a plain curl
            # got gzip from /infer).
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            self._session = aiohttp.ClientSession(auto_decompress=False, connector=connector,
                                                  skip_auto_headers=("Accept-Encoding",),
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_cleanup.append(lambda _: self.close())
        return app

    def metrics_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    def _refuse(self, refusal: Refusal) -> web.Response:
        self.state.refused[refusal.reason] = self.state.refused.get(refusal.reason, 0) + 1
        headers = CHALLENGE if refusal.status == 401 else None
        return web.json_response({"error": refusal.message}, status=refusal.status, headers=headers)

    def _check_key(self, request: web.Request) -> None:
        if not self.keys or (request.path in OPEN_PATHS and request.method in ("GET", "HEAD")):
            return
        authorization = request.headers.get("Authorization")
        if not self.keys.accepts(authorization):
            raise Refusal(401, ApiKeys.problem(authorization), "unauthorized")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            self._check_key(request)  # before the body is read: a client without a key costs nothing more
            if request.path == "/v2/health/ready" and request.method in ("GET", "HEAD"):
                reasons = self.state.not_ready_reasons()
                if reasons:
                    return web.json_response({"error": "not ready: " + "; ".join(reasons)}, status=503)
            elif request.path in ("/v2/status", "/status") and request.method == "GET":
                return web.json_response(self.state.status())
            body = await self._body(request)
            match = _GENERATE.match(request.path)
            if match and request.method == "POST":
                await self._check_generate(body, match["model"], match["version"])
            elif body:
                check_depth(self._json_part(request, body), self.limits.max_json_depth)
            return await self._forward(request, body)
        except Refusal as refusal:
            return self._refuse(refusal)

    async def _body(self, request: web.Request) -> bytes:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, f"the request body is {request.content_length:,} bytes, over this server's limit of "
                               f"{limit:,} bytes (max_body_bytes)", "body_size")
        chunks, size = [], 0
        while True:  # aiohttp decompresses as it reads: a compressed bomb stops at the limit too
            try:
                chunk = await request.content.readany()
            except (web.RequestPayloadError, aiohttp.ClientPayloadError) as error:  # does not decompress, cut short
                cause = error.__cause__ or error.__context__ or error
                why = str(getattr(cause, "message", cause)).strip() or type(cause).__name__
                raise Refusal(400, f"the request body could not be read: {why}", "body_invalid") from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise Refusal(413, f"the request body is over this server's limit of {limit:,} bytes "
                                   "(max_body_bytes)", "body_size")
            chunks.append(chunk)

    @staticmethod
    def _json_part(request: web.Request, body: bytes) -> bytes:
        """The JSON header of a body; binary tensor data may follow it (Triton's binary data extension)."""
        header = request.headers.get("Inference-Header-Content-Length")
        if header is not None:
            try:
                size = int(header)
            except ValueError:
                size = -1
            if not 0 <= size <= len(body):
                raise Refusal(400, f"Inference-Header-Content-Length {header!r} is not a length within the "
                                   f"{len(body)}-byte body", "body_invalid")
            return body[:size]
        return body

    async def _check_generate(self, body: bytes, model: str, version: str | None) -> None:
        check_depth(body, self.limits.max_json_depth)  # first: the parse below must only see shallow JSON
        parsed = await asyncio.to_thread(parse_json, body) if len(body) > 65536 else parse_json(body)
        if self.state.peer_problems:
            raise Refusal(503, "this server cannot serve a turn now: " + "; ".join(self.state.peer_problems.values()),
                          "not_ready")
        config = await self._model_config(model, version)
        if config is not None:  # None: no such model (Triton answers that), or tritonserver is down (see below)
            check_generate(parsed, model, config)

    async def _model_config(self, model: str, version: str | None) -> dict | None:
        key = (self.state.generation, model, version)
        cached = self._configs.get(key)
        if cached is not None and time.monotonic() - cached[0] < self.config_ttl_s:
            return cached[1]
        upstream = self.state.upstream
        if upstream is None:
            return None
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/config"
        try:
            session = await self._client()
            async with session.get(URL(f"http://{upstream}") .with_path(path)) as answer:
                config = json.loads(await answer.read()) if answer.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            return None
        self._configs = {k: v for k, v in self._configs.items() if k[0] == self.state.generation}
        self._configs[key] = (time.monotonic(), config)
        return config

    def _unavailable(self) -> web.Response:
        reasons = self.state.not_ready_reasons() or ["tritonserver is not reachable"]
        return self._refuse(Refusal(503, "the server cannot answer now: " + "; ".join(reasons) + "; retry shortly",
                                    "unavailable"))

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        upstream = self.state.upstream
        if upstream is None:
            return self._unavailable()
        dropped = _REQUEST_DROPPED | ({"authorization"} if self.keys else set())  # the guard's: not passed on
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in dropped]
        session = await self._client()
        response = None
        try:
            async with session.request(request.method, URL(f"http://{upstream}{request.raw_path}", encoded=True),
                                       headers=headers, data=body or None, allow_redirects=False) as answer:
                if answer.status >= 500 or answer.status == 400:  # errors, short: read whole to sort them
                    whole = await answer.read()
                    encoding = answer.headers.get("Content-Encoding")
                    plain = decoded(whole, encoding)  # what the client asked compressed is read here uncompressed
                    refusal = parser_refusal(plain)
                    if refusal is not None:
                        return self._refuse(refusal)
                    return web.Response(status=error_status(answer.status, plain), body=whole,
                                        content_type=answer.content_type,
                                        headers={"Content-Encoding": encoding} if encoding else None)
                response = web.StreamResponse(status=answer.status, reason=answer.reason)
                for key, value in answer.headers.items():
                    if key.lower() not in _RESPONSE_DROPPED:
                        response.headers.add(key, value)
                await response.prepare(request)
                if answer.content_type == "text/event-stream":
                    await self._stream(request, answer, response)
                    return response
                async for chunk in answer.content.iter_any():  # as it comes
                    try:
                        await response.write(chunk)
                    except ConnectionResetError:  # the client went away: leaving the block closes the upstream
                        return response
                await response.write_eof()
                return response
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            if response is None:  # nothing sent yet: the client hears why
                return self._unavailable()
            log.warning("tritonserver went away in the middle of an answer to %s: the client's connection is cut",
                        request.path)
            raise  # so the client sees an answer cut short, not one that ended

    async def _stream(self, request: web.Request, answer: aiohttp.ClientResponse,
                      response: web.StreamResponse) -> None:
        """Copy an SSE answer (generate_stream) to the client as it comes, whole events at a time, holding at most
        `max_unsent_bytes` of it the client has not taken; past that the stream ends with an error event and
        tritonserver's request is closed. Every early end is an error event and a log line, never a silent cut."""
        limit, outbox, partial = self.limits.max_unsent_bytes, Outbox(request, response), b""
        try:
            try:
                async for chunk in answer.content.iter_any():
                    partial += chunk
                    end = partial.rfind(b"\n\n") + 2  # whole events only: an error event may have to follow them
                    if end >= 2:
                        outbox.put(partial[:end])
                        partial = partial[end:]
                    if outbox.client_gone:
                        return  # leaving closes tritonserver's request
                    unsent = outbox.unsent() + len(partial)
                    if unsent > limit:
                        answer.close()  # now: the client may take long to read what is queued
                        self._cut(request, outbox, "slow_reader",
                                  f"this stream was ended because its client reads too slowly: {unsent:,} bytes of "
                                  f"it were not yet taken, over this server's limit of {limit:,} bytes "
                                  "(max_unsent_bytes)")
                        break
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as error:
                self._cut(request, outbox, "tritonserver_gone", "tritonserver went away in the middle of this "
                                                                 f"answer ({type(error).__name__}): it is incomplete")
            await outbox.finish()
        finally:
            outbox.abandon()

    def _cut(self, request: web.Request, outbox: Outbox, reason: str, message: str) -> None:
        self.state.cut[reason] = self.state.cut.get(reason, 0) + 1
        log.warning("a stream of %s to %s ended early, with this error event: %s", request.path, request.remote,
                    message)
        outbox.put(sse_error(message))

    async def metrics(self, request: web.Request) -> web.Response:
        text = ""
        if self.state.upstream_metrics is not None:
            try:
                session = await self._client()
                async with session.get(f"http://{self.state.upstream_metrics}/metrics") as answer:
                    text = (await answer.read()).decode("utf-8", "replace")
            except aiohttp.ClientError:
                text = ""
        return web.Response(text=text + self._own_metrics(), content_type="text/plain")

    def _own_metrics(self) -> str:
        state = self.state
        lines = ["# HELP mol2_server_restarts_total tritonserver restarts by mol2 serve after it exited unexpectedly",
                 "# TYPE mol2_server_restarts_total counter", f"mol2_server_restarts_total {state.restarts}",
                 "# HELP mol2_server_ready 1 when the guarded HTTP port answers ready",
                 "# TYPE mol2_server_ready gauge", f"mol2_server_ready {0 if state.not_ready_reasons() else 1}",
                 "# HELP mol2_guard_refused_total requests the HTTP guard answered itself, by reason",
                 "# TYPE mol2_guard_refused_total counter"]
        lines += [f'mol2_guard_refused_total{{reason="{reason}"}} {count}'
                  for reason, count in sorted(state.refused.items())]
        lines += ["# HELP mol2_guard_streams_cut_total streamed answers the HTTP guard ended early, with an error "
                  "event, by reason", "# TYPE mol2_guard_streams_cut_total counter"]
        lines += [f'mol2_guard_streams_cut_total{{reason="{reason}"}} {count}'
                  for reason, count in sorted(state.cut.items())]
        return "\n".join(lines) + "\n"


async def serve_guard(guard: Guard, host: str, http_port: int, metrics_port: int | None) -> list[web.AppRunner]:
    """Start the guard's sites; returns the runners to clean up."""
    runners = []
    for app, port in ((guard.app(), http_port), (guard.metrics_app(), metrics_port)):
        if port is None:
            continue
        # handler_cancellation: a client that goes away cancels its handler, which closes tritonserver's request
        # (without it aiohttp lets the handler wait on tritonserver's whole answer, a generate to its max_tokens)
        runner = web.AppRunner(app, access_log=None, auto_decompress=True, handle_signals=False,
                               handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    return runners
