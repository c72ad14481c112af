"""Server-sent events whose backlog is bounded: a client that reads slower than the engine writes (or stops
reading) holds at most `max_unsent_bytes` of its stream in this process; past that the stream ends with an error
event and [DONE], the engine's request is cancelled (its row freed) and a WARNING names the request.

How the backlog builds up: uvicorn's `send` waits while the connection's transport holds more than its high-water
mark (64 KiB) until the kernel's send buffer has room, and the kernel's buffer fills once the client's window is
full. Starlette's StreamingResponse pulls the next event only after `send` returns, so a stalled client stalls
the engine's stream as well, holding its row for as long as the client waits. Here a producer task drains the
events into a queue as the engine makes them and the response sends from that queue; what is queued is the
stream's unsent output, and its size is what the bound applies to. The kernel's share is bounded by the
connection's SO_SNDBUF (OpenAIServer sets it: with the kernel's autotuning a slow stream could wait there, up to
net.ipv4.tcp_wmem's maximum, 4 MiB by default, before any of it queued here).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from .schema import APIError

log = logging.getLogger("mol2.openai")


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Backlog:
    """Events made and not yet written to the connection, with their size in bytes. An event stays counted while
    `send` waits to take it."""

    def __init__(self):
        self.chunks: deque[bytes] = deque()
        self.unsent = 0
        self.ended = False
        self.error: BaseException | None = None  # the producer's failure, raised once what came before it is sent
        self._changed = asyncio.Event()

    def put(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.unsent += len(chunk)
        self._changed.set()

    def end(self, error: BaseException | None = None) -> None:
        self.ended, self.error = True, error
        self._changed.set()

    async def next(self) -> bytes | None:
        """The oldest unsent event; None once the producer has ended and everything is sent."""
        while not self.chunks:
            if self.ended:
                return None
            self._changed.clear()
            await self._changed.wait()
        return self.chunks.popleft()

    def sent(self, chunk: bytes) -> None:
        self.unsent -= len(chunk)


class EventStream(StreamingResponse):
    """A text/event-stream response over `events` (an async generator of SSE strings that closes what it reads
    when closed: closing it cancels the engine's request)."""

    def __init__(self, events: AsyncIterator[str], request_id: str, max_unsent_bytes: int):
        super().__init__(events, media_type="text/event-stream")
        self.request_id, self.max_unsent_bytes = request_id, max_unsent_bytes

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        backlog = _Backlog()
        # a task group: when the client goes away starlette cancels this scope, and the producer (waiting on the
        # engine) is cancelled and awaited with it, which closes the engine's stream
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._produce, backlog)
            while (chunk := await backlog.next()) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                backlog.sent(chunk)
        if backlog.error is not None:
            raise backlog.error  # a failure after the first byte: uvicorn logs it and cuts the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _produce(self, backlog: _Backlog) -> None:
        try:
            async for event in self.body_iterator:
                chunk = event.encode("utf-8")
                if backlog.unsent + len(chunk) > self.max_unsent_bytes:
                    await self._cut(backlog, backlog.unsent + len(chunk))
                    break
                backlog.put(chunk)
        except Exception as error:  # noqa: BLE001 - handed to the response, which raises it after the events before it
            backlog.end(error)
        else:
            backlog.end()

    async def _cut(self, backlog: _Backlog, unsent: int) -> None:
        """The client fell behind by more than the bound: tell the client why, stop the engine, log it."""
        log.warning("%s: the client fell %d bytes behind its stream (over max_unsent_bytes=%d): ended with an error "
                    "event, the engine's request cancelled", self.request_id, unsent, self.max_unsent_bytes)
        error = APIError(400, f"this stream was cut: the client fell {unsent:,} bytes behind it, over this server's "
                              f"limit of {self.max_unsent_bytes:,} unsent bytes per stream (max_unsent_bytes); read "
                              "the events as they come", code="slow_reader")
        backlog.put(sse(error.body()).encode())
        backlog.put(sse("[DONE]").encode())
        await self.body_iterator.aclose()  # closes the generation, whose engine stream cancels the request
