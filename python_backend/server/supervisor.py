"""`mol2 serve` keeps tritonserver running: started on loopback ports of its own behind the HTTP guard
(python_backend/server/guard.py), restarted with backoff when it exits unexpectedly (each restart logged and counted,
`mol2_server_restarts_total`; conversations survive it, being journaled), and its required peers probed (a
`--role prefill` server's decode server), so readiness means the server can serve a turn. A model process (a
Python-backend stub) that dies takes tritonserver down with it here: Triton would keep the model listed as ready and
answer every request to it with "Stub process ... is not healthy", and it does not restart a decoupled model's stub.

The first start must succeed (a configuration error is reported, not retried); after the server has once been
ready, any exit that `stop` did not ask for is restarted: 1 s, then 2, 4, ... up to `max_backoff_s`, back to 1 s
once a run has stayed up for `stable_s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .guard import ServerState
from .launcher import LaunchError, Ports, stop, wait_ready

log = logging.getLogger("mol2.serve")


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_ports(grpc: int) -> Ports:
    """Fresh loopback ports for tritonserver's HTTP and metrics, and its gRPC port `grpc` (the guards serve the
    public ones)."""
    return Ports(free_loopback_port(), grpc, free_loopback_port(), "127.0.0.1")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def model_processes(server_pid: int) -> dict[int, str]:
    """tritonserver's Python-backend model processes: pid -> the model's name (the folder of its model.py)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            if parent != server_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if args[0].endswith(b"triton_python_backend_stub") and len(args) > 1:
            found[int(entry)] = Path(args[1].decode(errors="replace")).parent.parent.name
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(frozen=True)
class Peer:
    """A server this one cannot serve without: the decode server of a prefill server."""

    url: str  # HOST:PORT of its gRPC endpoint
    models: tuple[str, ...]  # what it must have ready

    def probe(self, timeout_s: float = 2.0) -> str | None:
        """None when it serves, else why not (one line)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            client = grpcclient.InferenceServerClient(self.url)
        except Exception as error:  # noqa: BLE001 - a malformed address reads as unreachable, with why
            return f"the decode server at {self.url} cannot be reached: {error}"
        try:
            if not client.is_server_ready(client_timeout=timeout_s):
                return f"the decode server at {self.url} is not ready"
            missing = [model for model in self.models if not client.is_model_ready(model, client_timeout=timeout_s)]
            if missing:
                return f"the decode server at {self.url} has no ready {', '.join(missing)}"
        except InferenceServerException as error:
            first = (error.message() or str(error)).splitlines()[0]
            return f"the decode server at {self.url} is unreachable ({first})"
        finally:
            client.close()
        return None


class Supervisor:
    def __init__(self, state: ServerState, launch: Callable[[Ports], subprocess.Popen], grpc_port: int,
                 peers: tuple[Peer, ...] = (), ready_timeout_s: float = 300.0, first_backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, stable_s: float = 60.0, probe_every_s: float = 2.0,
                 find_model_processes: Callable[[int], dict[int, str]] = model_processes):
        self.state, self.launch, self.grpc_port, self.peers = state, launch, grpc_port, peers
        self.find_model_processes = find_model_processes
        self.ready_timeout_s, self.stable_s = ready_timeout_s, stable_s
        self.first_backoff_s, self.max_backoff_s = first_backoff_s, max_backoff_s
        self.probe_every_s = probe_every_s
        self.process: subprocess.Popen | None = None

    async def run(self, stopping: asyncio.Event, ready: asyncio.Event) -> None:
        """Until `stopping` is set; `ready` is set once the first start answers ready. The first start's failure
        raises LaunchError."""
        for peer in self.peers:  # not ready before the first probe has answered
            self.state.peer_problems[peer.url] = f"the decode server at {peer.url} has not been reached yet"
        probes = asyncio.create_task(self._probe_peers(stopping)) if self.peers else None
        delay = self.first_backoff_s
        try:
            while not stopping.is_set():
                ports = loopback_ports(self.grpc_port)
                self.process = process = self.launch(ports)
                self.state.generation, self.state.pid = self.state.generation + 1, process.pid
                try:
                    await self._wait_ready(process, ports, stopping)
                except LaunchError as error:
                    await self._stop()
                    if stopping.is_set():
                        break
                    if not ready.is_set():
                        raise
                    self.state.last_exit = str(error)
                else:
                    started = time.monotonic()
                    self.state.upstream, self.state.upstream_metrics = ports.http_url, f"127.0.0.1:{ports.metrics}"
                    self.state.starting = False
                    ready.set()
                    died = await self._wait_exit(process, stopping)
                    self.state.upstream = self.state.upstream_metrics = None
                    if stopping.is_set():
                        break
                    self.state.last_exit = died or f"tritonserver {describe_exit(process.returncode)}"
                    await self._stop()  # what is left of its group: model stubs
                    if time.monotonic() - started >= self.stable_s:
                        delay = self.first_backoff_s
                self.state.restarts += 1
                log.error("%s; restart %d in %.0f s (conversations are journaled: none is lost)",
                          self.state.last_exit, self.state.restarts, delay)
                try:
                    await asyncio.wait_for(stopping.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, self.max_backoff_s)
        finally:
            self.state.upstream = self.state.upstream_metrics = None
            if probes is not None:
                probes.cancel()
            await self._stop()

    async def _stop(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(stop, self.process)
            self.process = None  # stopped once: its pid may belong to another process by now

    async def _wait_ready(self, process: subprocess.Popen, ports: Ports, stopping: asyncio.Event) -> None:
        """wait_ready, cut short by `stopping` (the server is stopped: wait_ready then sees it exit)."""
        waiting = asyncio.create_task(asyncio.to_thread(wait_ready, process, ports, self.ready_timeout_s))
        stop_wanted = asyncio.create_task(stopping.wait())
        await asyncio.wait({waiting, stop_wanted}, return_when=asyncio.FIRST_COMPLETED)
        stop_wanted.cancel()
        if not waiting.done():
            await self._stop()
        await waiting

    async def _wait_exit(self, process: subprocess.Popen, stopping: asyncio.Event) -> str | None:
        """Until tritonserver exits or `stopping` is set (None), or one of its model processes dies (why)."""
        models = self.find_model_processes(process.pid)  # all are up once it answers ready
        log.info("watching tritonserver (pid %d) and its %d model processes (%s)", process.pid, len(models),
                 ", ".join(sorted(set(models.values()))))
        while process.poll() is None and not stopping.is_set():
            dead = [(pid, name) for pid, name in models.items() if not alive(pid)]
            if dead:
                return f"the model process of {dead[0][1]} (pid {dead[0][0]}) died"
            try:
                await asyncio.wait_for(stopping.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        return None

    async def _probe_peers(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            for peer in self.peers:
                problem = await asyncio.to_thread(peer.probe)
                known = self.state.peer_problems.get(peer.url)
                if problem != known:
                    if problem is None:
                        self.state.peer_problems.pop(peer.url, None)
                        log.warning("the decode server at %s answers: ready", peer.url)
                    else:
                        self.state.peer_problems[peer.url] = problem
                        log.error("not ready: %s", problem)
            try:
                await asyncio.wait_for(stopping.wait(), self.probe_every_s)
            except asyncio.TimeoutError:
                pass
