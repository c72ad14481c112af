"""The HTTP guard and the supervisor without `mol2 serve`: bodies over the size limit get 413 and JSON nested over
the depth limit 400 before anything reaches tritonserver; generate fields of the wrong type get 400 naming the
field; everything else, streams included, passes through unchanged and unbuffered; a stream whose client falls
more than max_unsent_bytes behind, or whose tritonserver goes away, ends with an error event and a log line;
readiness is 503 with its reason while tritonserver is down or the decode peer is unreachable; a server that dies
is restarted and counted; with API keys every request but the health probes needs one (401 otherwise); an answer is
compressed only when the client asked; a client that leaves a generate closes tritonserver's request.
tests/serving/test_serve_cli.py runs the same through a real `mol2 serve`."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from python_backend.server.guard import (Guard, GuardLimits, Refusal, ServerState, check_generate, error_status,
                                        json_depth, serve_guard)
from python_backend.server.keys import ApiKeys
from python_backend.server.launcher import LaunchError
from python_backend.server.supervisor import Peer, Supervisor

CONFIG = {"name": "m", "max_batch_size": 0, "input": [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "top_p", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
    {"name": "seed", "data_type": "TYPE_UINT64", "dims": [1], "optional": True}]}


def deep(depth: int) -> bytes:
    return b'{"text_input": "x", "x": ' + b"[" * depth + b"]" * depth + b"}"


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": 1}') == 1 and json_depth(b"[[[]], []]") == 3 and json_depth(b'"[[["') == 0
    assert json_depth(br'{"a": "[[\"[[", "b": [[1]]}') == 3  # an escaped quote does not end the string
    assert json_depth(br'{"a": "\\", "b": [[1]]}') == 3  # an escaped backslash does not escape the quote
    assert json_depth(b"[" * 10) == 10  # unclosed: the depth a parser reaches before it fails
    started = time.perf_counter()
    assert json_depth(deep(300_000)) == 300_001
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("body, message", [
    ({"text_input": "hi", "max_tokens": "many"}, 'max_tokens must be an integer, got "many"'),
    ({"text_input": "hi", "max_tokens": 3_000_000_000}, "max_tokens must be an integer from -2147483648 to "
                                                         "2147483647 (INT32), got 3000000000"),
    ({"text_input": "hi", "seed": -1}, "seed must be an integer from 0 to 18446744073709551615 (UINT64)"),
    ({"text_input": "hi", "stream": 1}, "stream must be true or false, got 1"),
    ({"text_input": 5}, "text_input must be a string, got 5"),
    ({"text_input": "hi", "top_p": "high"}, 'top_p must be a number, got "high"'),
    ({"text_input": "hi", "top_p": 1e39}, "top_p must be a finite number within FP32's range"),
    ({"text_input": "hi", "top_p": 5e-324}, "top_p 5e-324 is too small for FP32: it would arrive as 0"),
    ({"text_input": "hi", "max_tokens": [1, 2]}, "max_tokens must hold 1 value (dims [1]), got 2"),
    ({"text_input": "hi", "max_tokens": None}, "max_tokens must be an integer, got null"),
    ({"max_tokens": 4}, "text_input is required (an input of model m that is not optional)"),
    ({"text_input": "hi", "extra": [1]}, "extra is not an input of model m (its inputs: text_input, max_tokens, "
                                         "stream, top_p, seed); as a request parameter it must be a string"),
    ({"text_input": "hi", "parameters": {"a": {}}}, "parameters.a must be a string, number or boolean"),
    ([1], "a generate request must be a JSON object of model m's inputs, got an array"),
])
def test_generate_fields_of_the_wrong_type_are_named(body, message):
    with pytest.raises(Refusal) as refused:
        check_generate(body, "m", CONFIG)
    assert refused.value.status == 400 and message in refused.value.message


def test_generate_fields_that_fit_pass():
    check_generate({"text_input": ["hi"], "max_tokens": [[4]], "stream": True, "top_p": 1, "seed": 2**64 - 1,
                    "label": "x", "parameters": {"a": 1.5}}, "m", CONFIG)


def fake_triton(hits: list, release: asyncio.Event) -> web.Application:
    """What the guard sees of tritonserver: a config, a generate that echoes, an SSE stream that waits."""

    async def config(request):
        return web.json_response(CONFIG)

    async def generate(request):
        hits.append(request.path)
        return web.json_response({"echo": await request.json(), "encoding": request.headers.get("Content-Encoding"),
                                  "authorization": request.headers.get("Authorization")},
                                 headers={"X-Upstream": "yes"})

    async def compressible(request):  # as tritonserver's /infer: compressed when the request's Accept-Encoding asks
        response = web.json_response({"outputs": [{"name": "x", "data": ["y" * 200]}]})
        response.enable_compression()
        return response

    async def stream(request):
        hits.append(request.path)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await release.wait()  # the client must have the first event before the stream goes on
        await response.write(b'data: {"n": 2}\n\n')
        return response

    async def dying_stream(request):  # tritonserver killed in the middle of an event
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\ndata: {"n"')
        await asyncio.sleep(0.2)
        request.transport.abort()
        return response

    async def other(request):
        hits.append(request.path)
        return web.Response(status=400, text=f'{{"error": "upstream {request.method} {request.path_qs}"}}')

    async def metrics(request):
        return web.Response(text="nv_inference_count 3\n")

    async def parser_500(request):  # tritonserver's words for a body it cannot parse, with its (wrong) status
        response = web.Response(status=500, text='{"error":"Unable to parse \'parameters\': expected JSON object"}',
                                content_type="application/json")
        response.enable_compression()  # when asked
        return response

    async def real_500(request):
        return web.Response(status=500, text='{"error":"the model crashed"}', content_type="application/json")

    app = web.Application()
    app.router.add_get("/v2/models/m/config", config)
    app.router.add_post("/v2/models/m/generate", generate)
    app.router.add_post("/v2/models/m/generate_stream", stream)
    app.router.add_post("/v2/models/dying/generate_stream", dying_stream)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v2/models/m/infer", parser_500)
    app.router.add_post("/v2/models/crashing/infer", real_500)
    app.router.add_post("/v2/models/route/infer", compressible)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


def run(coroutine):
    return asyncio.run(coroutine)


async def guarded(limits=GuardLimits(max_body_bytes=1 << 20, max_json_depth=64), keys=ApiKeys()):
    hits, release = [], asyncio.Event()
    upstream = TestServer(fake_triton(hits, release))
    await upstream.start_server()
    state = ServerState(upstream=f"127.0.0.1:{upstream.port}", upstream_metrics=f"127.0.0.1:{upstream.port}")
    guard = Guard(state, limits, keys=keys)
    client = TestClient(TestServer(guard.app()))
    await client.start_server()
    metrics = TestClient(TestServer(guard.metrics_app()))
    await metrics.start_server()
    return client, metrics, upstream, state, hits, release


def test_the_guard_refuses_what_would_hurt_and_passes_the_rest():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            answer = await client.post("/v2/models/m/generate", data=deep(300_000))
            assert answer.status == 400
            assert (await answer.json())["error"] == ("the request's JSON nests 300001 levels deep, over this "
                                                      "server's limit of 64 (max_json_depth)")
            answer = await client.post("/v2/models/anything/infer", data=b'{"inputs": ' + b"[" * 65 + b"]" * 65 + b"}")
            assert answer.status == 400 and "nests 66 levels deep" in (await answer.json())["error"]
            answer = await client.post("/v2/models/m/generate", data=b"x" * ((1 << 20) + 1))
            assert answer.status == 413
            assert (await answer.json())["error"] == ("the request body is 1,048,577 bytes, over this server's "
                                                      "limit of 1,048,576 bytes (max_body_bytes)")

            async def chunked():  # no Content-Length: stopped as it is read
                for _ in range(40):
                    yield b" " * 32768

            answer = await client.post("/v2/models/m/generate", data=chunked())
            assert answer.status == 413 and "over this server's limit of 1,048,576 bytes" in await answer.text()
            bomb = gzip.compress(b'{"text_input": "x", "x": "' + b"a" * (2 << 20) + b'"}')  # 2 MB in ~2 KB
            answer = await client.post("/v2/models/m/generate", data=bomb, headers={"Content-Encoding": "gzip"})
            assert answer.status == 413
            answer = await client.post("/v2/models/m/generate", data=b'{"text_input": "hi", "max_tokens": "many"}')
            assert answer.status == 400 and (await answer.json()) == {"error": 'max_tokens must be an integer, got '
                                                                               '"many"'}
            answer = await client.post("/v2/models/m/generate", data=b'{"text_input": "hi",')
            assert answer.status == 400 and "not valid JSON" in (await answer.json())["error"]
            assert hits == []  # none of it reached tritonserver

            body = {"text_input": "hi", "max_tokens": 4}
            answer = await client.post("/v2/models/m/generate", data=gzip.compress(json.dumps(body).encode()),
                                       headers={"Content-Encoding": "gzip"})
            assert answer.status == 200 and answer.headers["X-Upstream"] == "yes"
            assert await answer.json() == {"echo": body, "encoding": None, "authorization": None}  # decompressed
            answer = await client.get("/v2/models/m/other?x=a%20b")  # status, body and query as they are
            assert answer.status == 400
            assert await answer.text() == '{"error": "upstream GET /v2/models/m/other?x=a%20b"}'

            answer = await client.post("/v2/models/m/generate_stream", data=json.dumps(body))
            assert answer.headers["Content-Type"] == "text/event-stream"
            first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), 10)  # before the stream has ended
            release.set()
            assert first == b'data: {"n": 1}\n\n' and await answer.content.read() == b'data: {"n": 2}\n\n'

            text = await (await metrics.get("/metrics")).text()
            assert "nv_inference_count 3\n" in text and "mol2_server_restarts_total 0\n" in text
            assert 'mol2_guard_refused_total{reason="json_depth"} 2' in text
            assert 'mol2_guard_refused_total{reason="body_size"} 3' in text
            assert 'mol2_guard_refused_total{reason="field_type"} 1' in text
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


def test_tritonservers_500_for_a_body_it_cannot_parse_reaches_the_client_as_400():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            for encoding in ("identity", "gzip"):  # read through the compression the client asked for
                answer = await client.post("/v2/models/m/infer", data=b'{"inputs": [], "parameters": [1]}',
                                           headers={"Accept-Encoding": encoding})
                assert answer.status == 400
                assert await answer.json() == {"error": "Unable to parse 'parameters': expected JSON object"}
            answer = await client.post("/v2/models/crashing/infer", data=b'{"inputs": []}')
            assert answer.status == 500 and await answer.json() == {"error": "the model crashed"}  # not the client's
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


@pytest.mark.parametrize("message, status", [
    ("in ensemble 'mol2', storage full: [Errno 28] No space left on device", 503),
    ("in ensemble 'mol2', engine failed: RuntimeError: a bug", 500),
    ("stored state damaged: the journal of conversation 'c' was damaged", 500),
    ("in ensemble 'mol2', max_tokens must be at least 1", 400),  # the client's: left as Triton said
    ("a message that mentions engine failed: later on", 400),
])
def test_tritonservers_400_for_a_server_condition_the_engine_marked_is_its_5xx(message, status):
    assert error_status(400, json.dumps({"error": message}).encode()) == status
    assert error_status(400, b"not json") == 400 and error_status(502, b'{"error": "storage full: x"}') == 502


def test_with_keys_every_request_but_the_health_probes_needs_one():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded(keys=ApiKeys.of(["k-one", "k-two"]))
        try:
            body = json.dumps({"text_input": "hi"})
            for headers, message in (({}, "this server needs an API key: send it as the header 'Authorization: "
                                          "Bearer KEY'"),
                                     ({"Authorization": "Bearer k-on"}, "the API key is not valid"),
                                     ({"Authorization": "Basic k-one"}, "the Authorization header must be 'Bearer "
                                                                        "KEY'")):
                for method, path in (("POST", "/v2/models/m/generate"), ("GET", "/v2/models/m/config"),
                                     ("POST", "/v2/repository/models/m/load"), ("GET", "/v2/status"),
                                     ("GET", "/v2/health/other")):
                    answer = await client.request(method, path, data=body, headers=headers)
                    assert answer.status == 401 and answer.headers["WWW-Authenticate"] == "Bearer", (path, headers)
                    assert await answer.json() == {"error": message}  # Triton's shape
            assert hits == [] and state.refused == {"unauthorized": 15}
            for path in ("/v2/health/ready", "/v2/health/live"):  # open: tritonserver's own answer
                assert (await client.get(path)).status == 400 and hits[-1] == path
            answer = await client.post("/v2/models/m/generate", data=body, headers={"Authorization": "Bearer k-two"})
            assert answer.status == 200
            assert (await answer.json())["authorization"] is None  # the guard's header: not passed on
            text = await (await metrics.get("/metrics")).text()
            assert 'mol2_guard_refused_total{reason="unauthorized"} 15' in text
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


def test_an_answer_is_compressed_only_when_the_client_asks():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            # aiohttp's client adds Accept-Encoding of its own: left out, the request is a plain curl's
            answer = await client.post("/v2/models/route/infer", data=b"{}", skip_auto_headers=("Accept-Encoding",),
                                       auto_decompress=False)
            assert "Content-Encoding" not in answer.headers
            assert json.loads(await answer.read())["outputs"][0]["data"] == ["y" * 200]
            answer = await client.post("/v2/models/route/infer", data=b"{}", headers={"Accept-Encoding": "gzip"},
                                       auto_decompress=False)
            assert answer.headers["Content-Encoding"] == "gzip"
            assert json.loads(gzip.decompress(await answer.read()))["outputs"][0]["data"] == ["y" * 200]
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


def test_a_body_that_does_not_decompress_is_a_400():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            answer = await client.post("/v2/models/m/generate", data=b"\x1f\x8bnot gzip",
                                       headers={"Content-Encoding": "gzip"})
            assert answer.status == 400 and (await answer.json())["error"] == (
                "the request body could not be read: Can not decode content-encoding: gzip")
            assert hits == []
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


def test_a_stream_whose_tritonserver_goes_away_ends_with_an_error_event(caplog):
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            answer = await client.post("/v2/models/dying/generate_stream", data=b'{"text_input": "hi"}')
            events = (await asyncio.wait_for(answer.content.read(), 10)).split(b"\n\n")
            assert events[0] == b'data: {"n": 1}' and events[2:] == [b""]  # whole events only, then the error
            assert json.loads(events[1][len(b"data: "):]) == {"error": "tritonserver went away in the middle of this "
                                                                       "answer (ClientPayloadError): it is incomplete"}
            text = await (await metrics.get("/metrics")).text()
            assert 'mol2_guard_streams_cut_total{reason="tritonserver_gone"} 1' in text
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    with caplog.at_level(logging.WARNING, logger="mol2.guard"):
        run(main())
    assert "a stream of /v2/models/dying/generate_stream to 127.0.0.1 ended early" in caplog.text


def slow_reader(port: int, body: bytes, resume: threading.Event) -> bytes:
    """A client on a slow link: a 4 KB receive buffer, and nothing read until `resume`; then all of it."""
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window is set then
        client.connect(("127.0.0.1", port))
        client.sendall(b"POST /v2/models/mol2/generate_stream HTTP/1.1\r\nHost: guard\r\nConnection: close\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert resume.wait(120), "the guard never ended the stream"
        client.settimeout(30)
        answer = b""
        while chunk := client.recv(1 << 16):
            answer += chunk
        return answer


def test_a_slow_reader_gets_an_error_event_and_the_guard_holds_at_most_max_unsent_bytes(server, caplog):
    """A real tritonserver's stream (4,096 tokens, ~1.5 MB of events) to a client that stops reading: the guard
    keeps reading tritonserver, holds at most max_unsent_bytes, then ends the stream with an error event."""
    limit = 256 << 10
    body = json.dumps({"text_input": "Tell me a long story.", "max_tokens": 4096, "ignore_eos": True,
                       "stream": True}).encode()

    async def main():
        state = ServerState(upstream=server.http_url)
        guard = TestServer(Guard(state, GuardLimits(max_unsent_bytes=limit)).app())
        await guard.start_server()
        resume = threading.Event()
        try:
            reading = asyncio.create_task(asyncio.to_thread(slow_reader, guard.port, body, resume))
            await until(lambda: state.cut or reading.done(), timeout_s=120)
            resume.set()
            return await reading, state.cut
        finally:
            resume.set()
            await guard.close()

    with caplog.at_level(logging.WARNING, logger="mol2.guard"):
        answer, cut = run(main())
    assert cut == {"slow_reader": 1}
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and rest.endswith(b"0\r\n\r\n")  # ended, not cut off
    events = re.findall(rb"data: (.*?)\n\n", rest)
    *tokens, last = [json.loads(event) for event in events]
    assert len(tokens) > 20 and all("text_output" in event for event in tokens)  # a whole prefix of the answer
    assert [event["output_tokens"] for event in tokens] == list(range(1, len(tokens) + 1))
    unsent = int(re.search(r"([\d,]+) bytes of it were not yet taken", last["error"])[1].replace(",", ""))
    assert last == {"error": f"this stream was ended because its client reads too slowly: {unsent:,} bytes of it "
                             f"were not yet taken, over this server's limit of {limit:,} bytes (max_unsent_bytes)"}
    # Bounded: the guard checks after each read from tritonserver (one event when it keeps up, as it does here;
    # 64 KiB allows for reads that bring several). Everything it held reached the client after all, so what came
    # is what the client's own buffer took before it stopped (4 KB, doubled by the kernel) plus the unsent bytes.
    sent = sum(len(event) + len(b"data: \n\n") for event in events[:-1])
    assert limit < unsent <= limit + (64 << 10) and sent <= unsent + (16 << 10), (sent, unsent)
    assert "ended early, with this error event: this stream was ended because its client reads too slowly" in caplog.text


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_a_client_that_leaves_closes_tritonservers_request_at_once(endpoint):
    """Through the guard as `mol2 serve` runs it (serve_guard): tritonserver still working on an answer (nothing
    sent yet, or a stream in its middle) when the client leaves; the guard's handler is cancelled and closes its
    request to tritonserver at once. (Before, a generate's handler waited on tritonserver's whole answer.) Whether
    tritonserver then stops the model is its own affair: see docs/openai_api_additions.md."""

    async def main():
        closed = asyncio.Event()

        async def slow(request):  # tritonserver generating a long answer
            try:
                response = None
                if endpoint == "generate_stream":
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await response.prepare(request)
                    await response.write(b'data: {"text_output": "a"}\n\n')
                await asyncio.sleep(60)
                return response or web.json_response({"text_output": "a" * 100})
            except asyncio.CancelledError:  # its client (the guard) went away
                closed.set()
                raise

        async def config(request):
            return web.json_response(CONFIG)

        app = web.Application()
        app.router.add_get("/v2/models/m/config", config)
        app.router.add_post(f"/v2/models/m/{endpoint}", slow)
        upstream = TestServer(app)  # aiohttp's test server cancels a handler whose client left
        await upstream.start_server()
        port = closed_port()
        runners = await serve_guard(Guard(ServerState(upstream=f"127.0.0.1:{upstream.port}")), "127.0.0.1", port,
                                    None)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"text_input": "hi", "max_tokens": 4096}'
            writer.write(b"POST /v2/models/m/%s HTTP/1.1\r\nHost: guard\r\nContent-Length: %d\r\n\r\n"
                         % (endpoint.encode(), len(body)) + body)
            await asyncio.sleep(0.5)
            assert not closed.is_set()
            writer.transport.abort()  # the client leaves
            left = time.monotonic()
            await asyncio.wait_for(closed.wait(), 10)
            return time.monotonic() - left
        finally:
            for runner in runners:
                await runner.cleanup()
            await upstream.close()

    assert run(main()) < 1.0


def test_a_plain_request_gets_a_plain_answer_from_tritonserver_through_the_guard(server):
    """A curl without Accept-Encoding to an /infer of the real server: plain JSON, as from tritonserver's own port."""
    body = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "data": ["hello " * 100]}]}).encode()

    async def main():
        guard = TestServer(Guard(ServerState(upstream=server.http_url)).app())
        await guard.start_server()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", guard.port)
            writer.write(b"POST /v2/models/route/infer HTTP/1.1\r\nHost: guard\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            answer = await asyncio.wait_for(reader.read(), 60)
            writer.close()
            return answer
        finally:
            await guard.close()

    head, _, rest = run(main()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-encoding" not in head.lower(), head
    assert b'"name":"adapter"' in rest  # readable as it is


def test_readiness_follows_tritonserver_and_the_status_says_why():
    async def main():
        client, metrics, upstream, state, hits, release = await guarded()
        try:
            assert (await client.get("/v2/health/ready")).status == 400  # up: Triton's own answer passes
            state.upstream, state.restarts, state.last_exit = None, 1, "tritonserver killed by SIGSEGV"
            answer = await client.get("/v2/health/ready")
            assert answer.status == 503
            assert (await answer.json())["error"] == "not ready: tritonserver is restarting (tritonserver killed by " \
                                                     "SIGSEGV)"
            answer = await client.post("/v2/models/m/generate", data=b'{"text_input": "hi"}')
            assert answer.status == 503 and "retry shortly" in (await answer.json())["error"]
            status = await (await client.get("/v2/status")).json()
            assert status["ready"] is False and status["tritonserver"]["restarts"] == 1
            assert "mol2_server_restarts_total 1\n" in await (await metrics.get("/metrics")).text()
        finally:
            await client.close(), await metrics.close(), await upstream.close()

    run(main())


# A stand-in for tritonserver: answers /v2/health/ready on the HTTP port it is given, until it is killed.
FAKE_SERVER = """
import http.server, sys
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def launch_fake(ports):
    return subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(ports.http)], start_new_session=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_server_that_dies_is_restarted_and_counted():
    async def main():
        state, stopping, ready = ServerState(), asyncio.Event(), asyncio.Event()
        supervisor = Supervisor(state, launch_fake, grpc_port=0, first_backoff_s=0.1)
        task = asyncio.create_task(supervisor.run(stopping, ready))
        await asyncio.wait_for(ready.wait(), 60)
        first = state.pid
        os.kill(first, signal.SIGSEGV)
        await until(lambda: state.restarts == 1 and state.upstream is not None and state.pid != first)
        assert state.last_exit == "tritonserver killed by SIGSEGV" and state.generation == 2
        with urllib.request.urlopen(f"http://{state.upstream}/v2/health/ready", timeout=5) as answer:
            assert answer.status == 200  # the new one serves
        process = supervisor.process
        stopping.set()
        await task
        assert state.restarts == 1 and process.poll() is not None  # stopped, and a stop is not a crash

    run(main())


def test_a_model_process_that_dies_takes_the_server_down_and_it_is_restarted():
    """Triton keeps a model whose Python stub died listed as ready; the supervisor restarts the whole server."""
    def launch_with_a_model(ports):  # the fake server starts a child standing in for a model's stub
        code = "import subprocess; subprocess.Popen(['sleep', '600'])" + FAKE_SERVER
        return subprocess.Popen([sys.executable, "-c", code, str(ports.http)], start_new_session=True)

    def children(pid):
        return {int(p): "engine" for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                         text=True).stdout.split()}

    async def main():
        state, stopping, ready = ServerState(), asyncio.Event(), asyncio.Event()
        supervisor = Supervisor(state, launch_with_a_model, grpc_port=0, first_backoff_s=0.1,
                                find_model_processes=children)
        task = asyncio.create_task(supervisor.run(stopping, ready))
        await asyncio.wait_for(ready.wait(), 60)
        first, (model,) = state.pid, children(state.pid)
        os.kill(model, signal.SIGKILL)
        await until(lambda: state.restarts == 1 and state.upstream is not None and state.pid != first)
        assert state.last_exit == f"the model process of engine (pid {model}) died"
        stopping.set()
        await task

    run(main())


def test_a_first_start_that_fails_is_reported_not_retried():
    async def main():
        state = ServerState()
        launch = lambda ports: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],  # noqa: E731
                                                start_new_session=True)
        with pytest.raises(LaunchError, match="exited with code 3 before it was ready"):
            await Supervisor(state, launch, grpc_port=0).run(asyncio.Event(), asyncio.Event())
        assert state.restarts == 0

    run(main())


def test_a_stop_during_the_first_start_is_prompt():
    async def main():
        stopping = asyncio.Event()
        launch = lambda ports: subprocess.Popen(["sleep", "600"], start_new_session=True)  # noqa: E731 - never ready
        supervisor = Supervisor(ServerState(), launch, grpc_port=0)
        task = asyncio.create_task(supervisor.run(stopping, asyncio.Event()))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        stopping.set()
        await asyncio.wait_for(task, 20)  # not the 300 s the ready wait allows
        assert time.monotonic() - started < 15

    run(main())


def test_a_prefill_server_whose_decode_server_is_down_is_not_ready():
    async def main():
        state, stopping, ready = ServerState(role="prefill"), asyncio.Event(), asyncio.Event()
        url = f"127.0.0.1:{closed_port()}"
        supervisor = Supervisor(state, launch_fake, grpc_port=0, peers=(Peer(url, ("decode",)),), probe_every_s=0.2)
        task = asyncio.create_task(supervisor.run(stopping, ready))
        guard = TestClient(TestServer(Guard(state).app()))
        await guard.start_server()
        try:
            await asyncio.wait_for(ready.wait(), 60)  # tritonserver is up ...
            await until(lambda: "unreachable" in state.peer_problems.get(url, ""))
            answer = await guard.get("/v2/health/ready")  # ... but a turn cannot be served
            assert answer.status == 503
            assert (await answer.json())["error"].startswith(f"not ready: the decode server at {url} is unreachable")
            status = await (await guard.get("/v2/status")).json()
            assert status["ready"] is False and status["peers"][url].startswith(f"the decode server at {url}")
            answer = await guard.post("/v2/models/mol2/generate", data=b'{"text_input": "hi"}')
            assert answer.status == 503 and "cannot serve a turn now: the decode server" in await answer.text()
        finally:
            stopping.set()
            await task
            await guard.close()

    run(main())
