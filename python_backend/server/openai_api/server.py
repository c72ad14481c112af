"""The app under uvicorn on a thread of its own (`mol2 serve` runs it beside tritonserver; the tests in-process)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from ..launcher import port_in_use
from .app import OpenAISettings, create_app


class OpenAIServer:
    def __init__(self, settings: OpenAISettings, host: str = "127.0.0.1", port: int = 9000,
                 log_level: str = "warning"):
        self.settings, self.host, self.asked_port = settings, host, port
        self.app = create_app(settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                    lifespan="on", access_log=False))
        self._thread = threading.Thread(target=self.server.run, name="mol2-openai", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the one the system chose for port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "OpenAIServer":
        if self.asked_port and port_in_use(self.host, self.asked_port):
            raise RuntimeError(f"port {self.asked_port} on {self.host} is already in use: choose another "
                               "(--openai-port) or 0 to turn the OpenAI front end off")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                reason = getattr(self.app.state, "startup_error", None) or "it did not start in time"
                raise RuntimeError(f"the OpenAI front end on {self.host}:{self.asked_port} did not start: {reason}")
            time.sleep(0.05)
        self._limit_send_buffers()
        return self

    def _limit_send_buffers(self) -> None:
        """SO_SNDBUF on the listening sockets, which every accepted connection inherits (Linux): a slow client's
        backlog then queues where max_unsent_bytes bounds it (streaming.py) rather than in the kernel."""
        size = self.settings.send_buffer_bytes
        if size is None:
            return
        for listener in self.server.servers:
            for sock in listener.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
