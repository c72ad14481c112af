"""A bounded fuzz pass (benchmarks/fuzz.py, ~200 generated requests over every category and every model's inputs,
Triton's restricted APIs and the OpenAI port) against the test server behind the HTTP guard, as `mol2 serve` puts it: no crash, no hang, no 5xx (tritonserver's
own 500s for /infer bodies it cannot parse reach the client as 400s), and every conversation the fuzz did not start
bitwise unchanged with its turn lock free."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.request

import pytest

from benchmarks.fuzz import COLUMNS, Target, fuzz, seed_conversations, totals
from benchmarks._report import markdown_table
from python_backend.server.launcher import Ports
from python_backend.server.openai_api import OpenAIServer, OpenAISettings

COUNTS = {"generate_json": 30, "generate_stream": 10, "malformed_json": 20, "deep_nesting": 8, "infer": 5,
          "concurrent_turns": 3, "bystander_refusals": 12, "repository_api": 16, "openai_json": 20,
          "openai_malformed": 14}


@contextlib.contextmanager
def guard_in_front(upstream: str):
    """python_backend/server/guard.py on a port of its own, forwarding to `upstream` (tritonserver's HTTP)."""
    from python_backend.server.guard import Guard, ServerState, serve_guard

    loop, port = asyncio.new_event_loop(), Ports.free().http
    runners = loop.run_until_complete(serve_guard(Guard(ServerState(upstream=upstream, starting=False)),
                                                  "127.0.0.1", port, None))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        for runner in runners:
            loop.run_until_complete(runner.cleanup())
        loop.close()


def live(server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


def test_a_bounded_fuzz_pass(server, served_dir, repository):
    settings = OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json")
    with guard_in_front(server.http_url) as guarded, contextlib.ExitStack() as stack:
        api = OpenAIServer(settings, port=0).start()
        stack.callback(api.stop)
        target = Target("", guarded, server.grpc_url, served_dir / "conversations",
                        restarts=lambda: 0 if live(server) else 1, recover=lambda: False, timeout_s=60,
                        openai=api.url.removeprefix("http://"), repository=repository)
        seed_conversations(target, bystanders=3, owned=3)
        rows, samples = fuzz(target, COUNTS, seed=0)
    table = markdown_table([*rows, totals(rows)], COLUMNS) + "\n" + "\n".join(samples)
    print(table)
    total = totals(rows)
    assert total["requests"] >= 140, table
    assert {name: total[name] for name in ("crashes", "hangs", "status_5xx", "state_changed")} == \
        {"crashes": 0, "hangs": 0, "status_5xx": 0, "state_changed": 0}, table
    assert total["status_2xx"] > 10 and total["status_4xx"] > 50, table  # it both served and refused
    models = {row["category"].split(":", 1)[1] for row in rows if row["category"].startswith("infer:")}
    assert {"prefill", "router", "decode", "tokenize", "engine", "route", "mol2"} <= models, models
    by_category = {row["category"]: row for row in rows}
    assert by_category["repository_api"]["status_2xx"] == 0, table  # no restricted operation was allowed
    assert by_category["openai_json"]["status_2xx"] > 0 and by_category["openai_malformed"]["status_4xx"] > 0, table


@pytest.mark.parametrize("depth", [100_000, 300_000])
def test_a_deeply_nested_body_does_not_take_the_server_down(server, depth):
    """The body that killed tritonserver (SIGSEGV in its JSON parser), refused by the guard, and the server
    serves the next request."""
    from benchmarks.fuzz import http_request, nested_body

    with guard_in_front(server.http_url) as guarded:
        target = Target("", guarded, server.grpc_url, None, restarts=lambda: 0, recover=lambda: False)
        refused = http_request(target, "POST", "/v2/models/mol2/generate", nested_body(depth, "[", False))
        assert refused.kind == "4xx" and "max_json_depth" in refused.text, refused
        assert live(server)
        answer = http_request(target, "POST", "/v2/models/mol2/generate",
                              b'{"text_input": "still there?", "adapter": "chat", "max_tokens": 2}')
        assert answer.kind == "2xx", answer
