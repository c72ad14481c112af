"""A real `mol2 serve` (the tiny model): the body that crashed tritonserver is refused and the next request served;
wrong types and malformed JSON are 400s naming the field; a second server on its store is refused, naming the
first; its limits refuse with their values; tritonserver killed by SIGSEGV is restarted by itself, counted on the
metrics port, and the conversation goes on; SIGTERM stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from python_backend.server.launcher import Ports


def mol2_command() -> list[str]:
    script = Path(sys.executable).parent / "mol2"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mol2_cli"]


def request(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_ready(ports: Ports, process: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"mol2 serve exited with {process.returncode}"
        try:
            if request(f"http://{ports.http_url}/v2/health/ready", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mol2 serve was not ready within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def serve(served_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_cli")
    env = {**os.environ, "MOL2_MODEL_DIR": str(served_dir / "model"), "MOL2_ROUTER_DIR": str(served_dir / "router"),
           "MOL2_ADAPTER_SET": str(served_dir / "adapter_set.json")}
    ports = Ports.free()
    process = subprocess.Popen([*mol2_command(), "serve", "--http-port", str(ports.http), "--grpc-port",
                                str(ports.grpc), "--metrics-port", str(ports.metrics), "--store", str(root / "store"),
                                "--log", str(root / "tritonserver.log"), "--max-prompt-tokens", "64",
                                "--max-conversations", "2", "--openai-port", "0", "--max-grpc-message-bytes", "1M"],
                               env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(ports, process)
        yield ports, process, root, env
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def generate(ports: Ports, **fields) -> tuple[int, dict]:
    return request(f"http://{ports.http_url}/v2/models/mol2/generate", {"adapter": "chat", "max_tokens": 2, **fields})


def test_a_second_server_on_the_store_is_refused_naming_the_first(serve):
    ports, process, root, env = serve
    other = Ports.free()
    second = subprocess.run([*mol2_command(), "serve", "--http-port", str(other.http), "--grpc-port", str(other.grpc),
                             "--metrics-port", str(other.metrics), "--store", str(root / "store"), "--log",
                             str(root / "second.log"), "--openai-port", "0"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode != 0
    assert (f"the conversation store {root / 'store'} is held by another live server (pid {process.pid}"
            in second.stderr), second.stderr
    assert f"http {ports.http_url}" in second.stderr and not (root / "second.log").exists()


def test_the_body_that_crashed_tritonserver_is_refused_and_the_next_request_served(serve):
    """On main, this body sent to the HTTP port clients reach killed tritonserver with SIGSEGV."""
    ports = serve[0]
    body = b'{"text_input": "x", "x": ' + b"[" * 300_000 + b"]" * 300_000 + b"}"
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{ports.http_url}/v2/models/mol2/generate",
                                                           data=body), timeout=60) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    assert status == 400 and "nests 300001 levels deep, over this server's limit of 64 (max_json_depth)" in text
    status, answer = generate(ports, text_input="still here?", max_tokens=3, end_conversation=True)
    assert status == 200 and answer["applied_adapter"] == "chat" and answer["output_tokens"] == 3
    assert request(f"http://{ports.http_url}/v2/status")[1]["tritonserver"]["restarts"] == 0  # it never went down


def test_wrong_types_and_malformed_json_are_400s_naming_the_field(serve):
    url = f"http://{serve[0].http_url}/v2/models/mol2/generate"
    answers = []
    for body in (b'{"text_input": "hi", "max_tokens": "many"}', b'{"text_input": "hi", "seed": -1}',
                 b'{"text_input": "hi"', b'{"max_tokens": 4}', b"[1]"):
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60)
        except urllib.error.HTTPError as error:
            answers.append((error.code, json.loads(error.read())["error"]))
    assert answers == [(400, 'max_tokens must be an integer, got "many"'),
                       (400, "seed must be an integer from 0 to 18446744073709551615 (UINT64), got -1"),
                       (400, "the request body is not valid JSON: Expecting ',' delimiter at line 1, column 20"),
                       (400, "text_input is required (an input of model mol2 that is not optional)"),
                       (400, "a generate request must be a JSON object of model mol2's inputs, got an array")]
    stream = urllib.request.urlopen(urllib.request.Request(url + "_stream", data=json.dumps(
        {"text_input": "go", "adapter": "chat", "max_tokens": 3, "stream": True, "end_conversation": True}).encode()),
        timeout=120)
    events = [json.loads(line[5:]) for line in stream.read().decode().splitlines() if line.startswith("data:")]
    assert [event["output_tokens"] for event in events][:3] == [1, 2, 3]  # SSE through the guard


def test_limits_refuse_with_the_limit_and_its_value(serve):
    ports = serve[0]
    status, answer = generate(ports, text_input="many words " * 20)
    # refused by its size before tokenizing (python_backend/core/limits.py check_text), naming the limit and its value
    assert status == 400 and "text_input is 220 bytes, more than this server's limit of 64 tokens per request " \
        "(max_prompt_tokens) can hold" in answer["error"], answer
    started = [generate(ports, text_input=f"conversation {n}") for n in range(2)]
    assert all(status == 200 for status, _ in started), started
    status, answer = generate(ports, text_input="one too many")
    assert status == 400 and "already holds 2 conversations, its limit (max_conversations=2)" in answer["error"]
    for _, answer in started:
        assert generate(ports, text_input="bye", conversation_id=answer["conversation_id_out"],
                        end_conversation=True)[0] == 200
    assert generate(ports, text_input="room again", end_conversation=True)[0] == 200


def test_the_grpc_port_bounds_messages_and_passes_the_rest_through(serve):
    """gRPC reaches tritonserver through grpc_guard.py: a message over --max-grpc-message-bytes is refused before
    Triton holds it; streams, metadata calls and Triton's own refusals pass through."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(serve[0].grpc_url)
    try:
        assert client.is_model_ready("engine")
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("engine")  # the admin-key check is tritonserver's, behind the guard
        answers = []
        client.start_stream(callback=lambda result, error: answers.append(error or result))

        def send(text: str) -> None:
            tensors = []
            for name, value, kind in (("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                                      ("adapter", np.array([b"chat"], dtype=object), "BYTES"),
                                      ("max_tokens", np.array([3], dtype=np.int32), "INT32"),
                                      ("end_conversation", np.array([True]), "BOOL")):
                tensors.append(grpcclient.InferInput(name, [1], kind))
                tensors[-1].set_data_from_numpy(value)
            client.async_stream_infer("mol2", tensors)

        send("x" * (2 << 20))  # 2 MiB: over the 1 MiB limit
        send("hello over grpc")
        deadline = time.monotonic() + 120
        while len(answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()
    assert isinstance(answers[0], InferenceServerException), answers[0]
    assert "StatusCode.RESOURCE_EXHAUSTED" in str(answers[0].status()) and "larger than max" in str(answers[0])
    # the stream ended with that refusal; the second request needs a stream of its own
    client = grpcclient.InferenceServerClient(serve[0].grpc_url)
    try:
        answers.clear()
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        send("hello over grpc")
        deadline = time.monotonic() + 120
        while not answers and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop_stream()
    finally:
        client.close()
    assert not isinstance(answers[0], InferenceServerException), answers[0]
    assert answers[0].as_numpy("applied_adapter")[0] == b"chat"


def test_tritonserver_killed_is_restarted_and_the_conversation_goes_on(serve):
    ports, process, root, env = serve
    status, first = generate(ports, text_input="remember me")
    assert status == 200
    conversation = first["conversation_id_out"]
    pid = request(f"http://{ports.http_url}/v2/status")[1]["tritonserver"]["pid"]
    os.kill(pid, signal.SIGSEGV)
    deadline = time.monotonic() + 30
    while request(f"http://{ports.http_url}/v2/status")[1]["tritonserver"]["restarts"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    status, answer = request(f"http://{ports.http_url}/v2/health/ready")
    assert status == 503 and "tritonserver is restarting (tritonserver killed by SIGSEGV)" in answer["error"]
    wait_ready(ports, process)
    restarted = request(f"http://{ports.http_url}/v2/status")[1]["tritonserver"]["pid"]
    metrics = urllib.request.urlopen(f"http://{ports.host}:{ports.metrics}/metrics", timeout=30).read().decode()
    assert "mol2_server_restarts_total 1\n" in metrics and "nv_inference_count" in metrics
    status, answer = generate(ports, text_input="still there?", conversation_id=conversation, end_conversation=True)
    assert status == 200 and answer["conversation_id_out"] == conversation  # journaled: it survived the crash
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=90)[0]
    assert process.returncode == 0, output
    assert "tritonserver killed by SIGSEGV; restart 1 in 1 s" in output and "stopping tritonserver" in output
    with pytest.raises(ProcessLookupError):
        os.kill(restarted, 0)  # stopped with it
