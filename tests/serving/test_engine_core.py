"""The engine's core process (python_backend/engine_core.py): killed mid-turn, the client gets a clear error, the
turn stores nothing, a new core serves the next requests and the conversation goes on from its last good turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

from python_backend.supervisor import model_processes

from test_triton import generate


def engine_core_pid(ports) -> int:
    """The core process under the `engine` model's stub of the server on these ports."""
    pattern = f"tritonserver .*http-port={ports.http} "
    servers = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    stubs = {pid: name for server in map(int, servers.split()) for pid, name in model_processes(server).items()}
    stub = next(pid for pid, name in stubs.items() if name == "engine")
    children = subprocess.run(["pgrep", "-P", str(stub), "-f", "python_backend.engine_core"], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 1, children
    return int(children[0])


def test_a_core_killed_mid_turn_fails_that_turn_and_the_conversation_goes_on(server):
    first = dict(text_input="a conversation that will lose a turn", adapter="chat", max_tokens=4)
    killed = generate(server, **first)["conversation_id_out"]
    twin = generate(server, **first)["conversation_id_out"]  # the same first turn, never interrupted
    core = engine_core_pid(server)

    request = urllib.request.Request(f"http://{server.http_url}/v2/models/mol2/generate_stream", method="POST",
                                     data=json.dumps(dict(text_input="a long answer", adapter="coding",
                                                          max_tokens=400, ignore_eos=True, stream=True,
                                                          conversation_id=killed)).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        events = []
        for line in response:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 1:
                    os.kill(core, signal.SIGKILL)  # mid-turn: its first token is out
    assert "error" in events[-1] and "core process died" in events[-1]["error"], events[-1]
    assert len(events) < 400

    after = dict(text_input="and after that?", adapter="chat", max_tokens=6)
    answer = generate(server, conversation_id=killed, **after)  # waits for the new core
    assert "error" not in answer, answer
    assert engine_core_pid(server) != core
    # The killed turn left nothing: the conversation answers as its twin, which never had that turn.
    assert answer["text_output"] == generate(server, conversation_id=twin, **after)["text_output"]
