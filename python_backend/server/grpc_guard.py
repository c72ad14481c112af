"""The gRPC port clients reach: a pass-through proxy in front of tritonserver's gRPC, which listens on a loopback port
of its own (`mol2 serve` starts both, as it does for HTTP with python_backend/server/guard.py).

It exists for what tritonserver cannot be told: the largest message it takes. Triton 2.51 accepts gRPC messages up to
2 GB and holds each whole before any model sees it (a 16 MiB `text_input` cost the tokenize process 2.9 GB). Here a
message over `max_message_bytes` is refused by gRPC itself with RESOURCE_EXHAUSTED before it is held. Everything else
passes through as bytes, unparsed: every method of Triton's GRPCInferenceService, the caller's metadata (so Triton's
own restricted-API key check still applies), deadlines, and cancellation (a client that cancels its stream cancels
the call upstream, which the engine sees as a cancelled request). While tritonserver is down or restarting, calls
get UNAVAILABLE with the reason.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc

from .guard import ServerState

log = logging.getLogger("mol2.grpc_guard")
# Metadata that gRPC itself sets on each call: not forwarded (the upstream call sets its own).
_RESERVED = ("user-agent", "content-type", "te", "grpc-", ":")
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"  # the one bidirectional stream; all else unary
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # a decode server takes whole conversation states (8 MB at 8K tokens, demo)


def forwarded_metadata(metadata) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((key, value) for key, value in (metadata or ()) if not key.lower().startswith(_RESERVED))


class GrpcGuard(grpc.GenericRpcHandler):
    def __init__(self, state: ServerState, upstream: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.state, self.upstream, self.max_message_bytes = state, upstream, max_message_bytes
        self._channel: grpc.aio.Channel | None = None

    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:  # made on the serving loop; it reconnects by itself after a tritonserver restart
            self._channel = grpc.aio.insecure_channel(self.upstream, options=[
                ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        return self._channel

    def service(self, details: grpc.HandlerCallDetails):
        if details.method == STREAM_METHOD:
            return grpc.stream_stream_rpc_method_handler(self._stream(details.method))
        return grpc.unary_unary_rpc_method_handler(self._unary(details.method))

    async def _unavailable(self, context: grpc.aio.ServicerContext) -> None:
        reasons = self.state.not_ready_reasons() or ["tritonserver is not reachable"]
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "the server cannot answer now: " + "; ".join(reasons) + "; retry shortly")

    def _unary(self, method: str):
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if self.state.upstream is None:
                await self._unavailable(context)
            call = self.channel().unary_unary(method)(request, metadata=forwarded_metadata(
                context.invocation_metadata()), timeout=context.time_remaining())
            try:
                return await call
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
        return forward

    def _stream(self, method: str):
        async def forward(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
            if self.state.upstream is None:
                await self._unavailable(context)
            call = self.channel().stream_stream(method)(requests, metadata=forwarded_metadata(
                context.invocation_metadata()), timeout=context.time_remaining())
            try:
                async for response in call:
                    yield response
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.CANCELLED:
                    await context.abort(error.code(), error.details() or "")
            finally:
                call.cancel()  # a no-op once it ended; the client left: the engine stops the request
        return forward

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


async def serve_grpc_guard(guard: GrpcGuard, host: str, port: int) -> grpc.aio.Server:
    """Start the public gRPC port; returns the server to stop."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", guard.max_message_bytes),
                                      ("grpc.max_send_message_length", -1),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((guard,))
    if not server.add_insecure_port(f"{host}:{port}"):
        raise OSError(f"cannot listen on {host}:{port} for gRPC")
    await server.start()
    log.info("gRPC on %s:%d (messages up to %d bytes) -> tritonserver %s", host, port, guard.max_message_bytes,
             guard.upstream)
    return server
