"""The OpenAI front end against hostile input (issue 31), on the real tritonserver and uvicorn: what a request may
cost is bounded before it costs it (body size while it is read, JSON depth before it is parsed, prompt bytes before
the engine tokenizes), every bad value is a 4xx naming its field (never a wrap, a 0 or a 500), a slow reader's
backlog is bounded and ends in an error event, the engine's absence is a 503, and /openapi.json declares it all."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from python_backend.server.openai_api import OpenAIServer, OpenAISettings
from python_backend.server.openai_api.engine_client import engine_error

MIB = 1 << 20
HELLO = [{"role": "user", "content": "hello there"}]


def settings(server, served_dir, **limits) -> OpenAISettings:
    return OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json", **limits)


@pytest.fixture(scope="module")
def front(server, served_dir):
    """The defaults: max_body_bytes 4 MiB, max_json_depth 64, the engine's max_prompt_tokens (16384; the test model's
    text is UTF-8 bytes, one token each)."""
    app = OpenAIServer(settings(server, served_dir), port=0).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def tight(server, served_dir):
    """Small bounds, so that reaching them takes a short prompt or a few seconds of a stream."""
    app = OpenAIServer(settings(server, served_dir, max_prompt_tokens=64, max_unsent_bytes=8 << 10,
                                send_buffer_bytes=4096), port=0).start()
    yield app
    app.stop()


def post(front, path: str, body) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{front.url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def refused(answer: tuple[int, dict | str], status: int, param: str | None, *words: str) -> dict:
    """The answer is OpenAI's error object with this status and param, its message holding `words`."""
    code, body = answer
    assert code == status and isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}, \
        answer
    error = body["error"]
    assert error["param"] == param and all(word in error["message"] for word in words), error
    return error


def tree_rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / MIB


@pytest.fixture(scope="module")
def tritonserver_pid(server) -> int:
    for process in psutil.process_iter(["cmdline"]):
        if f"--grpc-port={server.grpc}" in (process.info["cmdline"] or []):
            return process.pid
    raise LookupError(f"no tritonserver on gRPC port {server.grpc}")


def send_huge(front, size: int, chunked: bool) -> tuple[int, bytes, float]:
    """POST /v1/completions with a `size`-byte body over a raw socket, sent 1 MiB at a time from one buffer (this
    process never holds the body); (status, answer, seconds)."""
    piece = b"x" * MIB
    head = b'{"model": "chat", "max_tokens": 4, "prompt": "'
    framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}".encode()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + framing
                     + b"\r\n\r\n")
        try:
            for index in range(size // MIB):
                data = head + piece[len(head):] if index == 0 else piece
                sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before all of it went out: the answer is already here
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer.split(b"\r\n\r\n", 1)[1], time.monotonic() - started


def _length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    return next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")), 0)


# -- what a request may cost -------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_64_mib_body_is_refused_while_it_is_read(front, tritonserver_pid, chunked):
    engine_before = tree_rss_mib(tritonserver_pid)
    status, body, seconds = send_huge(front, 64 * MIB, chunked)  # warms up whatever a first request allocates
    front_before = psutil.Process().memory_info().rss / MIB
    for _ in range(3):
        status, body, seconds = send_huge(front, 64 * MIB, chunked)
        assert status == 413 and "max_body_bytes" in json.loads(body)["error"]["message"], body
        assert seconds < 10, f"refused after {seconds:.1f} s"
    grown = psutil.Process().memory_info().rss / MIB - front_before  # uvicorn runs in this process
    engine_grown = tree_rss_mib(tritonserver_pid) - engine_before
    assert grown < 16 and engine_grown < 16, (grown, engine_grown)  # nothing of the bodies is kept anywhere


def test_a_prompt_that_cannot_fit_max_prompt_tokens_is_refused_before_the_engine(front, tight, tritonserver_pid):
    # default limits: 16384 tokens of at most 1 byte each; 4 MiB minus a little passes the body limit
    engine_before = tree_rss_mib(tritonserver_pid)
    started = time.monotonic()
    big = post(front, "/v1/completions", {"model": "chat", "prompt": "x" * (4 * MIB - 100), "max_tokens": 4})
    error = refused(big, 400, "prompt", "max_prompt_tokens", "16384")
    assert error["code"] == "context_length_exceeded" and time.monotonic() - started < 5
    assert tree_rss_mib(tritonserver_pid) - engine_before < 16
    # max_prompt_tokens=64: bytes are counted, not characters, and what fits passes to the engine
    for prompt, fits in (("x" * 64, True), ("x" * 65, False), ("é" * 32, True), ("é" * 33, False)):
        answer = post(tight, "/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 2})
        if fits:
            assert answer[0] == 200, answer
        else:
            refused(answer, 400, "prompt", "max_prompt_tokens", f"{len(prompt.encode())} bytes")
    for last, fits in (("z" * 4, True), ("z" * 5, False)):  # the contents of a history count together: 60 + last
        history = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 20},
                   {"role": "user", "content": last}]
        answer = post(tight, "/v1/chat/completions", {"model": "chat", "messages": history, "max_tokens": 2})
        if fits:
            assert answer[0] == 200, answer
        else:
            refused(answer, 400, "messages", "max_prompt_tokens", "65 bytes")


def test_deep_json_is_refused_before_it_is_parsed(front):
    deep = b'{"model": "chat", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # ~2 KB; today: RecursionError
    refused(post(front, "/v1/chat/completions", deep), 400, None, "1001 levels", "max_json_depth")
    refused(post(front, "/v1/load_lora_adapter", b'{"lora_name": ' + b'{"a": ' * 500 + b"1" + b"}" * 501), 400,
            None, "max_json_depth")


# -- bad values: a 4xx naming the field --------------------------------------------------------------------------

@pytest.mark.parametrize("body, param, words", [
    (b'{"model": "chat", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content",
     ["unpaired surrogate \\ud800"]),
    (b'{"model": "chat", "messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}', "messages[0].content",
     ["not valid UTF-8", "0xED"]),
    (b'{"model": "chat", "messages": [{"role": "user", "content": [{"type": "text", "text": "\xff"}]}]}',
     "messages[0].content[0].text", ["0xFF"]),
    (b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}', "stop[0]",
     ["unpaired surrogate"]),
])
def test_text_that_is_no_unicode_is_refused_naming_its_field(front, body, param, words):
    refused(post(front, "/v1/chat/completions", body), 400, param, *words)


def test_a_lone_surrogate_in_a_prompt_is_refused(front):
    refused(post(front, "/v1/completions", b'{"model": "chat", "prompt": "a\\udfff"}'), 400, "prompt", "\\udfff")


@pytest.mark.parametrize("field, value, words", [
    ("top_k", 2**70, ["2147483647"]),   # today: OverflowError, a 500
    ("top_k", 2**32 + 5, ["2147483647"]),  # today: served as top_k 5
    ("top_k", 2**31, ["2147483647"]),  # today: refused by the engine as top_k=-2147483648
    ("top_p", 5e-324, ["1.401298e-45", "would arrive as 0"]),  # today: refused as top_p=0.0
    ("temperature", 5e-324, ["0 (greedy) or at least 1.401298e-45"]),
    ("seed", 2**64, ["less than 9223372036854775808"]),
    ("max_tokens", 2**40, ["4096"]),
])
def test_numbers_outside_what_the_engine_holds_are_refused_not_wrapped(front, field, value, words):
    body = {"model": "chat", "messages": HELLO, "max_tokens": 2, field: value}
    refused(post(front, "/v1/chat/completions", body), 400, field, *words)


def test_the_extremes_that_fit_are_served_as_sent(front):
    body = {"model": "chat", "messages": HELLO, "max_tokens": 2, "top_k": 2**31 - 1, "top_p": 1.401298464324817e-45,
            "temperature": 2.0, "seed": 2**63 - 1}
    assert post(front, "/v1/chat/completions", body)[0] == 200


@pytest.fixture()
def adapters_root(served_dir):
    """The adapters root; what a test makes in it is removed afterwards."""
    made = []
    yield served_dir / "adapters", made
    for path in made:
        path.unlink()


def test_lora_paths_the_os_cannot_take_are_refused_naming_lora_path(front, adapters_root):
    root, made = adapters_root
    loop = root / "loop"
    loop.symlink_to(loop)  # a symlink to itself: ELOOP
    made.append(loop)
    name_max = os.pathconf(root, "PC_NAME_MAX")
    for path, words in (("chat\x00/../coding", ["NUL byte"]), ("a" * 300, ["300 bytes", f"{name_max} (NAME_MAX)"]),
                        ("a/" * 2100, ["PATH_MAX"]), ("loop", ["cannot be resolved", "ELOOP"]),
                        ("loop/inner", ["cannot be resolved"])):
        answer = post(front, "/v1/load_lora_adapter", {"lora_name": "hostile", "lora_path": path})
        refused(answer, 400, "lora_path", *words)
    refused(post(front, "/v1/load_lora_adapter", {"lora_name": "a/b\x00", "lora_path": "chat"}), 400, "lora_name",
            "letters, digits")


# -- a slow reader -----------------------------------------------------------------------------------------------

def test_a_client_that_stops_reading_gets_an_error_event_and_frees_the_engine(tight, caplog):
    """A raw socket with a 4 KB receive buffer that sends its request and reads nothing until the front end has
    cut the stream (8 KiB unsent; the front's sockets send 4 KiB buffers), then reads everything."""
    caplog.set_level(logging.WARNING, logger="mol2.openai")
    body = json.dumps({"model": "chat", "prompt": "hello", "max_tokens": 4000, "ignore_eos": True,
                       "stream": True, "temperature": 0}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", tight.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        while not any("max_unsent_bytes" in record.getMessage() for record in caplog.records):
            assert time.monotonic() < deadline, "the stream was never cut"
            time.sleep(0.2)
        sock.settimeout(30)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):  # the chunked answer's end
            chunk = sock.recv(65536)
            assert chunk, "the connection closed before the answer ended"
            received += chunk
    events = [line[6:] for line in received.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "slow_reader" and "max_unsent_bytes" in error["message"], error
    texts = [json.loads(event)["choices"][0]["text"] for event in events[:-2]]
    assert 100 < len(texts) < 4000  # what was made before the cut arrived whole; the rest was never made
    warning = next(r for r in caplog.records if "max_unsent_bytes" in r.getMessage())
    assert warning.levelno == logging.WARNING and "cmpl-" in warning.getMessage()
    with urllib.request.urlopen(f"{tight.url}/metrics", timeout=30) as response:  # the request is no longer running
        assert 'running_lora_adapters=""' in response.read().decode()


# -- the engine's absence ----------------------------------------------------------------------------------------

class Relay:
    """A TCP relay to tritonserver's gRPC port that a test can cut: to a front end behind it, tritonserver is gone."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        for sock in [self.listener, *self.sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on them
            except OSError:
                pass
            sock.close()


def test_an_engine_that_is_not_there_is_a_503(server, served_dir):
    relay = Relay(server.grpc)
    front = OpenAIServer(OpenAISettings(f"127.0.0.1:{relay.port}", served_dir / "model",
                                        served_dir / "adapter_set.json"), port=0).start()
    try:
        body = {"model": "chat", "messages": HELLO, "max_tokens": 2}
        assert post(front, "/v1/chat/completions", body)[0] == 200
        front.app.state.engine.model = "engine_unloaded"  # what Triton answers while the engine is not loaded
        error = refused(post(front, "/v1/chat/completions", body), 503, None, "Request for unknown model",
                        "retry shortly")
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
        front.app.state.engine.model = "engine"
        relay.cut()  # tritonserver gone
        error = refused(post(front, "/v1/chat/completions", body), 503, None, "failed the request")
        assert error["code"] == "engine_unavailable"
    finally:
        front.stop()
        relay.cut()


@pytest.mark.parametrize("message, status", [
    ("Request for unknown model: 'engine' is not found", 503),
    ("Request for unknown model: 'engine' has no available versions", 503),
    ("Request for unknown model: 'engine' version 1 is not at ready state", 503),
    ("unknown adapter 'x'", 404),
    ("top_k must be >= 0 (0: no top-k filter), got -1", 400),
])
def test_engine_errors_map_to_statuses(message, status):
    assert engine_error(message).status == status


# -- anything unexpected, and the document -----------------------------------------------------------------------

def test_an_unexpected_failure_is_a_500_logged_with_its_traceback(front, monkeypatch, caplog):
    def broken():
        raise RuntimeError("the adapter set vanished")

    monkeypatch.setattr(front.app.state.adapters, "current", broken)
    caplog.set_level(logging.ERROR, logger="mol2.openai")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"{front.url}/v1/models", timeout=30)
    error = json.loads(answer.value.read())["error"]
    assert answer.value.code == 500 and error["code"] == "internal_error" and "vanished" in error["message"]
    logged = [r for r in caplog.records if "GET /v1/models failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info and "vanished" in str(logged[0].exc_info[1])


def test_openapi_declares_request_bodies_and_error_responses(front):
    with urllib.request.urlopen(f"{front.url}/openapi.json", timeout=30) as response:
        document = json.loads(response.read())
    schemas = document["components"]["schemas"]

    def resolve(reference: dict) -> dict:
        return schemas[reference["$ref"].rsplit("/", 1)[1]]

    expected = {"/v1/chat/completions": ("messages", {400, 404, 413, 500, 503, 507}),
                "/v1/completions": ("prompt", {400, 404, 413, 500, 503, 507}),
                "/v1/load_lora_adapter": ("lora_path", {400, 413, 500}),
                "/v1/unload_lora_adapter": ("lora_name", {400, 404, 413, 500})}
    for path, (field, statuses) in expected.items():
        operation = document["paths"][path]["post"]
        body = resolve(operation["requestBody"]["content"]["application/json"]["schema"])
        assert field in body["properties"] and field in body["required"], (path, body)
        assert {int(code) for code in operation["responses"] if code != "200"} == statuses, path
        for code in statuses:
            error = resolve(operation["responses"][str(code)]["content"]["application/json"]["schema"])
            assert set(resolve(error["properties"]["error"])["properties"]) == {"message", "type", "param", "code"}
    for reference in json.dumps(document).split('"$ref": "')[1:]:  # every reference resolves
        assert reference.split('"', 1)[0].rsplit("/", 1)[1] in schemas
