"""Starting and stopping tritonserver: ports held by another server are refused up front (the ready probe would
find that server and report it as ours), and stopping takes the whole process group, model stubs included."""

import os
import socket
import subprocess
import time

import pytest

from python_backend.server.launcher import LaunchError, Ports, start, stop


def test_a_server_is_not_started_on_ports_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = Ports.free()
        with pytest.raises(LaunchError, match=f"port\\(s\\) {port} on 127.0.0.1 already in use"):
            start(tmp_path, Ports(free.http, port, free.metrics), tmp_path)


def test_stop_takes_the_children_a_dead_server_left(tmp_path):
    pid_file = tmp_path / "child.pid"
    # A "server" that starts a long-lived child (as tritonserver starts its model stubs) and then dies.
    process = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3"], start_new_session=True)
    process.wait()
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive, its parent gone
    stop(process)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the stub outlived stop()"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (killed, not yet reaped by init) counts as gone
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False



def test_free_ports_are_three_different_ports(monkeypatch):
    """A port released at once can be handed out again (a test's server once got gRPC and metrics on one port and
    could not start): here the system gives the lowest port not bound now, so only ports held together differ."""
    from python_backend.server import launcher

    bound = set()

    class LowestFreePort:
        def __init__(self, *args):
            self.port = None

        def bind(self, address):
            self.port = min(set(range(40000, 40010)) - bound)
            bound.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            bound.discard(self.port)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(launcher.socket, "socket", LowestFreePort)
    ports = Ports.free()
    assert len({ports.http, ports.grpc, ports.metrics}) == 3, ports
    assert not bound  # and all three are released for the server to take
