"""The engine's core process (python_backend/core/engine_core.py) behind the stub: a client that cancels its stream stops
its turn there; a core killed mid-turn gives the client a clear error, the turn stores nothing, a new core serves
the next requests and the conversation goes on from its last good turn."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from ced.tokenization import ChatTokenizer
from python_backend.server.supervisor import model_processes

from test_triton import generate, metric_totals


def engine_core_pid(ports) -> int:
    """The core process under the `engine` model's stub of the server on these ports."""
    pattern = f"tritonserver .*http-port={ports.http} "
    servers = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    stubs = {pid: name for server in map(int, servers.split()) for pid, name in model_processes(server).items()}
    stub = next(pid for pid, name in stubs.items() if name == "engine")
    children = subprocess.run(["pgrep", "-P", str(stub), "-f", "python_backend.core.engine_core"], capture_output=True,
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


def grpc_input(name: str, value: np.ndarray) -> grpcclient.InferInput:
    kinds = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL",
             np.dtype(object): "BYTES"}
    tensor = grpcclient.InferInput(name, list(value.shape), kinds[value.dtype])
    tensor.set_data_from_numpy(value)
    return tensor


def test_a_cancelled_stream_stops_its_turn_and_stores_nothing(server, served_dir):
    """Straight to the `engine` model over gRPC (Triton's ensemble does not pass a cancel on)."""
    first = dict(text_input="a conversation whose turn is cancelled", adapter="chat", max_tokens=4)
    cancelled = generate(server, **first)["conversation_id_out"]
    twin = generate(server, **first)["conversation_id_out"]
    ids = ChatTokenizer(served_dir / "model").encode("a long answer")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = {"_text_ids": np.array(ids, dtype=np.int64), "conversation_id": np.array([cancelled.encode()], object),
              "adapter": np.array([b"coding"], object), "max_tokens": np.array([400], np.int32),
              "ignore_eos": np.array([True]), "stream": np.array([True])}
    client.async_stream_infer("engine", [grpc_input(name, value) for name, value in inputs.items()])
    result, error = responses.get(timeout=120)  # its first token is out: the turn is decoding
    assert error is None, error
    served_before = metric_totals(server, ["mol2_requests"])["mol2_requests"]
    started = time.monotonic()
    client.stop_stream(cancel_requests=True)

    after = dict(text_input="and after that?", adapter="chat", max_tokens=6)
    while "already has a turn in progress" in (answer := generate(server, conversation_id=cancelled, **after)).get(
            "error", ""):  # until the core has stopped the turn and released its conversation
        assert time.monotonic() - started < 60
        time.sleep(0.05)
    assert "error" not in answer, answer
    # Nothing of the cancelled turn was stored: the conversation answers as its twin, which never had that turn.
    assert answer["text_output"] == generate(server, conversation_id=twin, **after)["text_output"]
    assert metric_totals(server, ["mol2_requests"])["mol2_requests"] == served_before + 2  # those two, not it
