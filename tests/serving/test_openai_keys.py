"""The OpenAI port's keys, origins and small endpoints (issue 35, items 5-7) on the real tritonserver: a missing or
wrong key is a 401 in OpenAI's shape everywhere but /health, adapter loading included; CORS preflights are answered
for the allowed origins; a non-streaming request whose client leaves frees its engine row at once; /v1/models
advertises the limit that holds; /v1/models/{id}, /tokenize (the engine's own rendering), /detokenize and /version;
one access-log line per request and every 4xx/5xx counted by status."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import psutil
import pytest
from openai import OpenAI

from ced.tokenization import ChatTokenizer
from python_backend.server import keys as keys_module
from python_backend.server.keys import ApiKeyError, ApiKeys, is_loopback
from python_backend.server.openai_api import OpenAIServer, OpenAISettings
from python_backend.server.serve_cli import allowed_origins, api_keys

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def front(server, served_dir):
    """Keys, one allowed origin, and a small max_prompt_tokens (64) so that the advertised limit is the prompt's."""
    app = OpenAIServer(OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json",
                                      max_prompt_tokens=64, api_keys=ApiKeys.of(KEYS), allowed_origins=(ORIGIN,)),
                       port=0).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def tokenizer(served_dir):
    return ChatTokenizer(served_dir / "model")


def call(front, method: str, path: str, body=None, key: str | None = KEYS[1], headers=None):
    """(status, headers, JSON or text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    request = urllib.request.Request(f"{front.url}{path}", data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, head, text = response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        status, head, text = error.code, error.headers, error.read().decode()
    try:
        return status, head, json.loads(text)
    except ValueError:
        return status, head, text


def metrics_text(url: str, key: str | None = KEYS[0]) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
        return response.read().decode()


def series(text: str, name: str, **labels) -> float:
    """The sum of the series `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- keys --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("GET", "/v1/models/chat", None), ("GET", "/metrics", None),
    ("GET", "/version", None), ("GET", "/openapi.json", None),
    ("POST", "/v1/chat/completions", {"model": "chat", "messages": HELLO, "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [104]}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "chat"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "chat"}),
    ("GET", "/v1/no/such/route", None),
])
def test_every_endpoint_but_health_needs_a_key(front, served_dir, method, path, body):
    adapter_set = (served_dir / "adapter_set.json").read_bytes()
    for key, message in ((None, "this server needs an API key: send it as the header 'Authorization: Bearer KEY'"),
                         ("wrong", "the API key is not valid"), (KEYS[0][:-1], "the API key is not valid")):
        status, headers, answer = call(front, method, path, body, key=key)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (key, status, answer)
        assert answer == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                    "code": "invalid_api_key"}}
    status, _, answer = call(front, method, path, body, key=None, headers={"Authorization": f"Basic {KEYS[0]}"})
    assert status == 401 and answer["error"]["message"] == "the Authorization header must be 'Bearer KEY'"
    assert (served_dir / "adapter_set.json").read_bytes() == adapter_set  # nothing loaded or unloaded


def test_the_right_key_passes_and_health_stays_open(front):
    assert call(front, "GET", "/health", key=None)[0] == 200
    for key in KEYS:  # either key
        assert call(front, "GET", "/v1/models", key=key)[0] == 200
    assert call(front, "GET", "/v1/models", headers={"Authorization": f"bearer {KEYS[0]}"}, key=None)[0] == 200
    client = OpenAI(base_url=f"{front.url}/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="chat", messages=HELLO, max_tokens=3, temperature=0.0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError) as refused:
        OpenAI(base_url=f"{front.url}/v1", api_key="nope", max_retries=0).models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_a_key_is_compared_with_every_key_in_constant_time(monkeypatch):
    keys, compared = ApiKeys.of(["a" * 40, "bravo-key", "c" * 5]), []

    def compare(given, expected):
        assert len(given) == len(expected) == 32  # digests: the keys' lengths do not show
        compared.append(expected)
        return given == expected

    monkeypatch.setattr(keys_module.hmac, "compare_digest", compare)
    for header, accepted in (("Bearer " + "a" * 40, True), ("Bearer bravo-key", True), ("Bearer nope", False),
                             ("Bearer ", False), (None, False)):
        compared.clear()
        assert keys.accepts(header) is accepted, header
        assert compared == list(keys.digests), header  # each key once, no early exit on a match
    assert keys.digests[1] == hashlib.sha256(b"bravo-key").digest() and "bravo" not in repr(keys)  # not kept


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path, capsys, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nfile-one\n\n  file-two  \n")
    keys = ApiKeys.load(["flag"], path, "from-env")
    assert len(keys) == 4 and all(keys.accepts(f"Bearer {key}") for key in ("flag", "file-one", "file-two",
                                                                             "from-env"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        ApiKeys.load(key_file=tmp_path / "empty")
    with pytest.raises(ApiKeyError, match="cannot be read"):
        ApiKeys.load(key_file=tmp_path / "missing")
    with pytest.raises(ApiKeyError, match="must not be empty"):
        ApiKeys.of([""])

    def serve_args(host, key=()):
        return SimpleNamespace(host=host, api_key=list(key), api_key_file=None)

    monkeypatch.delenv("MOL2_API_KEY", raising=False)
    assert not api_keys(serve_args("127.0.0.1")) and capsys.readouterr().err == ""
    assert not api_keys(serve_args("0.0.0.0"))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "warning: 0.0.0.0 is not loopback and no API key is set" in warning
    assert api_keys(serve_args("0.0.0.0", ["k"])) and capsys.readouterr().err == ""
    monkeypatch.setenv("MOL2_API_KEY", "env-key")
    assert api_keys(serve_args("0.0.0.0")).accepts("Bearer env-key") and capsys.readouterr().err == ""
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("example.com")
    assert allowed_origins("https://a.example, http://b.example:3000/") == ("https://a.example",
                                                                           "http://b.example:3000")
    with pytest.raises(SystemExit, match="not an origin"):
        allowed_origins("a.example")


def test_mol2_serve_takes_the_key_and_origin_flags():
    import argparse

    from python_backend.server.cli import add_serve

    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--api-key", "a", "--api-key", "b", "--api-key-file", "/k",
                              "--allowed-origins", "*"])
    assert args.api_key == ["a", "b"] and args.api_key_file == "/k" and allowed_origins(args.allowed_origins) == ("*",)
    plain = parser.parse_args(["serve"])
    assert plain.api_key == [] and plain.api_key_file is None and allowed_origins(plain.allowed_origins) == ()


# -- origins -----------------------------------------------------------------------------------------------------

def test_a_cors_preflight_is_answered_for_allowed_origins_only(front):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = call(front, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN  # no key on a preflight: browsers
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, _ = call(front, "OPTIONS", "/v1/chat/completions", key=None,
                              headers={**preflight, "Origin": "https://evil.example"})
    assert status == 400 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = call(front, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    status, headers, _ = call(front, "GET", "/v1/models", key=None, headers={"Origin": ORIGIN})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # the page can read why


# -- models, tokens, version ---------------------------------------------------------------------------------------

def test_max_model_len_is_the_limit_that_holds(front):
    status, _, listing = call(front, "GET", "/v1/models")
    assert status == 200 and {card["max_model_len"] for card in listing["data"]} == {64}  # max_prompt_tokens
    status, _, answer = call(front, "POST", "/v1/completions", {"model": "chat", "prompt": "a" * 63, "max_tokens": 1,
                                                                "ignore_eos": True})
    assert status == 200 and answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 64
    status, _, answer = call(front, "POST", "/v1/completions", {"model": "chat", "prompt": "a" * 65, "max_tokens": 1})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_max_model_len_is_the_context_when_that_is_less(server, served_dir):
    app = OpenAIServer(OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json"),
                       port=0).start()
    try:
        with urllib.request.urlopen(f"{app.url}/v1/models", timeout=30) as response:
            cards = json.loads(response.read())["data"]
        assert {card["max_model_len"] for card in cards} == {4096}  # the tiny model's max_context < 16,384
    finally:
        app.stop()


def test_one_model_by_id(front):
    status, _, card = call(front, "GET", "/v1/models/coding")
    assert status == 200 and card["id"] == "coding" and card["parent"] == "mol2" and card["max_model_len"] == 64
    status, _, answer = call(front, "GET", "/v1/models/nope")
    assert status == 404 and answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
    assert "this server offers: mol2, auto, chat, coding" in answer["error"]["message"]
    client = OpenAI(base_url=f"{front.url}/v1", api_key=KEYS[0], max_retries=0)
    assert client.models.retrieve("auto").id == "auto"


def test_tokenize_counts_what_the_engine_counts(front, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you?"}]
    status, _, counted = call(front, "POST", "/tokenize", {"model": "chat", "messages": messages})
    assert status == 200 and counted == {"count": len(tokenizer.render(messages)[0]), "max_model_len": 64,
                                         "tokens": tokenizer.render(messages)[0]}
    status, _, answer = call(front, "POST", "/v1/chat/completions", {"model": "chat", "messages": messages,
                                                                     "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] == counted["count"]  # the engine's own count
    status, _, counted = call(front, "POST", "/tokenize", {"prompt": "def f():"})
    assert counted["tokens"] == tokenizer.completion_prompt("def f():") and counted["count"] == 8
    status, _, text = call(front, "POST", "/detokenize", {"model": "coding", "tokens": counted["tokens"]})
    assert status == 200 and text == {"prompt": "def f():"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "hi", "messages": HELLO}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a" * 65}, 400, "prompt"),  # what could not be served is not tokenized
    ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, 404, "model"),
    ("/tokenize", {"messages": HELLO, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [1 << 40]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_and_detokenize_refuse_with_the_field_named(front, path, body, status, param):
    answer_status, _, answer = call(front, "POST", path, body)
    assert answer_status == status and answer["error"]["param"] == param, answer


def test_version(front):
    status, _, answer = call(front, "GET", "/version")
    assert status == 200 and re.fullmatch(r"\d+\.\d+\.\d+.*", answer["version"])


def test_openapi_declares_the_key_and_the_new_endpoints(front):
    status, _, document = call(front, "GET", "/openapi.json")
    assert status == 200 and document["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                                      "scheme": "bearer"}}
    assert document["security"] == [{"bearer": []}] and document["paths"]["/health"]["get"]["security"] == []
    for path, method in (("/v1/chat/completions", "post"), ("/v1/load_lora_adapter", "post"), ("/tokenize", "post"),
                         ("/detokenize", "post"), ("/v1/models/{model_id}", "get"), ("/version", "get")):
        assert "401" in document["paths"][path][method]["responses"], path
    for path, field in (("/tokenize", "messages"), ("/detokenize", "tokens")):
        reference = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert field in document["components"]["schemas"][reference.rsplit("/", 1)[1]]["properties"]
    assert "404" in document["paths"]["/v1/models/{model_id}"]["get"]["responses"]


# -- the operator's view -------------------------------------------------------------------------------------------

def access_lines(caplog, count: int, timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [record.getMessage() for record in caplog.records if record.name == "mol2.openai.access"
                 and not record.getMessage().startswith("GET /metrics ")]  # the test's own scrapes
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_one_access_log_line_per_request_and_every_error_counted_by_status(front, caplog):
    before = metrics_text(f"{front.url}/metrics")
    with caplog.at_level(logging.INFO, logger="mol2.openai.access"):
        status, _, answer = call(front, "POST", "/v1/chat/completions", {"model": "coding", "messages": HELLO,
                                                                         "max_tokens": 3, "ignore_eos": True})
        assert status == 200
        assert call(front, "GET", "/v1/nowhere")[0] == 404
        assert call(front, "GET", "/v1/models", key="wrong")[0] == 401
        assert call(front, "POST", "/v1/chat/completions", {"model": "nope", "messages": HELLO})[0] == 404
        assert call(front, "POST", "/v1/completions", {"model": "chat", "prompt": 5})[0] == 400
        lines = access_lines(caplog, 5)  # each written once its answer has gone out: wait for the last
    assert len(lines) == 5, lines
    usage = answer["usage"]
    assert re.fullmatch(rf"POST /v1/chat/completions 200 model=coding adapter=coding prompt_tokens="
                        rf"{usage['prompt_tokens']} cached_tokens={usage['prompt_tokens_details']['cached_tokens']} "
                        rf"completion_tokens=3 ttft_ms=[\d.]+ duration_ms=[\d.]+ finish=length client=127\.0\.0\.1:\d+",
                        lines[0]), lines[0]
    assert lines[1].startswith("GET /v1/nowhere 404 duration_ms=") and lines[2].startswith("GET /v1/models 401 ")
    assert lines[3].startswith("POST /v1/chat/completions 404 model=nope duration_ms=")
    after = metrics_text(f"{front.url}/metrics")
    for status, count in (("404", 2), ("401", 1), ("400", 1)):
        name = "mol2_openai_request_errors_total"
        assert series(after, name, status=status) - series(before, name, status=status) == count, status


# -- a client that leaves ------------------------------------------------------------------------------------------

def raw_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nAuthorization: "
                       f"Bearer {KEYS[0]}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


def engine_processes(server) -> list[psutil.Process]:
    """The engine core processes of the test server (below the tritonserver that serves its HTTP port)."""
    for process in psutil.process_iter(["cmdline"]):
        if f"--http-port={server.http}" in (process.info["cmdline"] or []):
            return [child for child in process.children(recursive=True)
                    if "python_backend.core.engine_core" in " ".join(child.cmdline())]
    raise AssertionError("the test server's tritonserver is not running")


def engine_cpu(processes, window_s: float = 0.25) -> float:
    """CPU seconds per second the engine's processes spend over `window_s`: ~1 while a row decodes, 0 idle."""
    def used():
        return sum(sum(process.cpu_times()[:2]) for process in processes)

    before = used()
    time.sleep(window_s)
    return (used() - before) / window_s


def wait_for(condition, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_non_streaming_request_whose_client_leaves_frees_its_engine_row(front, server, caplog):
    """4,096 tokens asked (~20 s here), the client gone after its first tokens: the front end cancels the engine's
    gRPC stream at once (the request leaves vllm:lora_requests_info's running set; test_engine_core.py shows the
    engine stopping a cancelled stream at its next token) and logs it as 499. The engine's CPU is printed, not
    asserted: on a shared machine a starved engine looks idle too."""
    engine, url = engine_processes(server), f"{front.url}/metrics"
    with caplog.at_level(logging.INFO, logger="mol2.openai.access"):
        connection = raw_request(front.port, "/v1/completions", {"model": "coding", "prompt": "Once upon a time",
                                                                "max_tokens": 4096, "ignore_eos": True})
        wait_for(lambda: 'running_lora_adapters="coding"' in metrics_text(url), 30)  # generating
        busy = engine_cpu(engine, 0.5)
        connection.close()
        left = time.monotonic()
        wait_for(lambda: 'running_lora_adapters=""' in metrics_text(url), 10)
        freed_s = time.monotonic() - left
        idle = next((time.monotonic() - left for _ in range(20) if engine_cpu(engine) < 0.05), None)
        lines = access_lines(caplog, 1)
    idle_text = "not within 5 s" if idle is None else f"after {idle:.3f} s"
    print(f"\nclient left: the front end cancelled the engine's stream after {freed_s:.3f} s; the engine's CPU "
          f"went from {busy:.2f} s/s to idle {idle_text}")
    assert freed_s < 1.0
    assert any(re.match(r"POST /v1/completions 499 model=coding adapter=coding .*completion_tokens=\d+", line)
               for line in lines), lines
