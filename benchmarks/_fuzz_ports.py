"""The fuzz's requests to two more surfaces (benchmarks/fuzz.py runs them): Triton's restricted APIs (model
repository, shared memory, trace, logging) over HTTP and gRPC, which must refuse every client, and the OpenAI port
(chat, completions, adapters), which must answer bad input with a 4xx in OpenAI's error shape."""

from __future__ import annotations

import base64
import http.client
import json
import tempfile
import urllib.parse
from pathlib import Path

# Where a model sent in a load request would leave its mark if its code ran (checked after the category).
MARKER = Path(tempfile.gettempdir()) / "mol2-fuzz-intruder-ran"
INTRUDER_PY = f"""
import pathlib
class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({str(MARKER)!r}).write_text("ran")
    def execute(self, requests):
        return []
"""
INTRUDER_CONFIG = json.dumps({"backend": "python", "max_batch_size": 0,
                              "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1]}],
                              "output": [{"name": "y", "data_type": "TYPE_INT32", "dims": [1]}]})
MODEL_NAMES = ("engine", "mol2", "tokenize", "route", "intruder", "../engine", "")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


# -- the restricted APIs -----------------------------------------------------------------------------------------


def repository_request(st):
    """(port, operation, model name, a fake admin key or None): what an intruder would try."""
    names = st.one_of(st.sampled_from(MODEL_NAMES), st.text(max_size=20))
    operations = st.sampled_from(["load_code", "load", "unload", "unload_dependents", "index", "log_settings",
                                  "set_log", "trace_settings", "set_trace", "shm_register", "shm_status",
                                  "shm_unregister", "cuda_shm_status"])
    key = st.one_of(st.none(), st.none(), st.text("0123456789abcdef", min_size=64, max_size=64))
    return st.tuples(st.sampled_from(["http", "grpc"]), operations, names, key)


def _http_operation(operation: str, name: str) -> tuple[str, str, dict | None]:
    quoted = urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe="") or "x"
    files = {"config": INTRUDER_CONFIG, "file:1/model.py": base64.b64encode(INTRUDER_PY.encode()).decode()}
    return {
        "load_code": ("POST", f"/v2/repository/models/{quoted}/load", {"parameters": files}),
        "load": ("POST", f"/v2/repository/models/{quoted}/load", {}),
        "unload": ("POST", f"/v2/repository/models/{quoted}/unload", {}),
        "unload_dependents": ("POST", f"/v2/repository/models/{quoted}/unload",
                              {"parameters": {"unload_dependents": True}}),
        "index": ("POST", "/v2/repository/index", {}),
        "log_settings": ("GET", "/v2/logging", None),
        "set_log": ("POST", "/v2/logging", {"log_verbose_level": 2, "log_file": "/tmp/mol2-fuzz.log"}),
        "trace_settings": ("GET", "/v2/trace/setting", None),
        "set_trace": ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_file": "/tmp/x.json"}),
        "shm_register": ("POST", f"/v2/systemsharedmemory/region/{quoted}/register",
                         {"key": "/dev/shm/x", "offset": 0, "byte_size": 1 << 20}),
        "shm_status": ("GET", "/v2/systemsharedmemory/status", None),
        "shm_unregister": ("POST", "/v2/systemsharedmemory/unregister", {}),
        "cuda_shm_status": ("GET", "/v2/cudasharedmemory/status", None),
    }[operation]


def _grpc_operation(client, operation: str, name: str, headers: dict | None) -> None:
    files = {"file:1/model.py": INTRUDER_PY.encode()}
    calls = {
        "load_code": lambda: client.load_model(name or "x", headers=headers, config=INTRUDER_CONFIG, files=files),
        "load": lambda: client.load_model(name or "x", headers=headers),
        "unload": lambda: client.unload_model(name or "x", headers=headers),
        "unload_dependents": lambda: client.unload_model(name or "x", headers=headers, unload_dependents=True),
        "index": lambda: client.get_model_repository_index(headers=headers),
        "log_settings": lambda: client.get_log_settings(headers=headers),
        "set_log": lambda: client.update_log_settings({"log_verbose_level": 2}, headers=headers),
        "trace_settings": lambda: client.get_trace_settings(headers=headers),
        "set_trace": lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=headers),
        "shm_register": lambda: client.register_system_shared_memory(name or "x", "/x", 1 << 20, headers=headers),
        "shm_status": lambda: client.get_system_shared_memory_status(headers=headers),
        "shm_unregister": lambda: client.unregister_system_shared_memory(headers=headers),
        "cuda_shm_status": lambda: client.get_cuda_shared_memory_status(headers=headers),
    }
    calls[operation]()


def send_repository(target, drawn, http_request, answer_type):
    """One restricted operation; any answer but a refusal is reported as a 2xx (the category must have none)."""
    port, operation, name, key = drawn
    headers = None if key is None else {"mol2-admin-key": key}
    if port == "http":
        method, path, body = _http_operation(operation, name)
        return http_request(target, method, path, None if body is None else json.dumps(body).encode(),
                            headers=headers)
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(target.grpc)
    try:
        _grpc_operation(client, operation, name, headers)
        return answer_type("2xx", f"gRPC {operation} was allowed")
    except InferenceServerException as error:
        message = error.message() or str(error)
        restricted = "restricted" in message.lower() or "mol2-admin-key" in message
        return answer_type("4xx" if restricted else "5xx", message)
    finally:
        client.close()


def intruder_ran() -> bool:
    return MARKER.exists()


# -- the OpenAI port ---------------------------------------------------------------------------------------------


def openai_request(st, adapters: tuple[str, ...], hostile, small_text):
    """(path, body bytes): chat and completion bodies, three fields in four well typed, the rest hostile."""
    model = st.one_of(st.sampled_from([*adapters, "auto", "mol2", "mol2:chat"]), st.sampled_from(adapters),
                      small_text)
    content = st.one_of(small_text, small_text, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": small_text}), max_size=2), hostile)
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]),
                                                       small_text), "content": content})
    messages = st.one_of(st.lists(message, min_size=1, max_size=3).map(lambda ms: [*ms, {"role": "user",
                                                                                        "content": "hi"}]),
                         st.lists(message, max_size=3), hostile)
    valid = {"max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
             "top_k": st.integers(0, 50), "seed": st.integers(0, 2 ** 63 - 1), "stream": st.booleans(),
             "stop": st.one_of(small_text, st.lists(small_text, max_size=3)), "n": st.just(1),
             "ignore_eos": st.booleans(), "stream_options": st.just({"include_usage": True})}
    edges = st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([2 ** 31, 2 ** 32 + 5, 2 ** 63, -1, 0, 4097,
                                                                         5e-324, 1e308, -0.0]),
                      st.floats(allow_nan=False, allow_infinity=False))
    fields = {name: st.one_of(good, good, good, hostile, edges) for name, good in valid.items()}
    unsupported = st.sampled_from([{}, {}, {}, {"tools": [{"type": "function"}]}, {"logprobs": True}, {"n": 2},
                                   {"response_format": {"type": "json_object"}}])
    chat = st.tuples(st.fixed_dictionaries({"model": model, "messages": messages}, optional=fields), unsupported)
    completion = st.tuples(st.fixed_dictionaries({"model": model, "prompt": st.one_of(small_text, hostile)},
                                                 optional=fields), unsupported)
    return st.one_of(chat.map(lambda t: (CHAT, {**t[0], **t[1]})), completion.map(lambda t: (COMPLETIONS,
                                                                                            {**t[0], **t[1]})))


def openai_malformed(st, truncated_of, paths: tuple[str, ...], depths: tuple[int, ...]):
    """(path, body bytes): not JSON, not the JSON it claims, nested deep, huge, or an adapter path that is none."""
    literal = st.sampled_from([
        b"", b"{", b"[]", b"null", b"1", b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "chat", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        b'{"model": "chat", "prompt": "\xff\xfe"}', b'{"model": "chat", "prompt": "x", "top_k": ' + b"9" * 40 + b"}",
        b'{"model": "chat", "prompt": "x", "max_tokens": NaN}', b'{"model": "chat", "prompt": "x", "model": "y"}'])
    deep = st.sampled_from(depths).map(lambda d: b'{"model": "chat", "prompt": "x", "x": ' + b"[" * d + b"]" * d
                                       + b"}")
    huge = st.sampled_from([5 << 20, 64 << 20]).map(
        lambda size: b'{"model": "chat", "prompt": "' + b"x" * size + b'"}')
    lora_path = st.one_of(st.sampled_from(paths + ("a" * 300, "a/" * 3000, "\x00", "adapters/\x00chat")),
                          st.text(max_size=30))
    load = st.tuples(st.text(min_size=1, max_size=20).filter(lambda n: n not in ("chat", "coding")), lora_path).map(
        lambda t: json.dumps({"lora_name": t[0], "lora_path": t[1]}).encode("utf-8", "surrogatepass"))
    unload = st.text(max_size=20).filter(lambda n: n not in ("chat", "coding", "design", "agent")).map(
        lambda name: json.dumps({"lora_name": name}).encode("utf-8", "surrogatepass"))
    bodies = st.one_of(st.binary(max_size=200), literal, literal, deep, huge)
    to_generation = st.tuples(st.sampled_from([CHAT, COMPLETIONS]), bodies)
    return st.one_of(to_generation, to_generation, st.tuples(st.just("/v1/load_lora_adapter"), load),
                     st.tuples(st.just("/v1/unload_lora_adapter"), unload),
                     st.tuples(st.sampled_from([CHAT, COMPLETIONS, "/v1/load_lora_adapter"]),
                               st.binary(max_size=60).flatmap(truncated_of)))


def wait_openai(address: str, timeout_s: float = 120.0) -> None:
    """`mol2 serve` starts its OpenAI API once tritonserver is ready: wait for it."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection(*address.rsplit(":", 1), timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the OpenAI API at {address} did not answer within {timeout_s:.0f} s")


def openai_post(address: str, path: str, body: bytes, timeout_s: float, answer_type):
    """One request to the OpenAI port, classified as fuzz.http_request does (an error event inside a 200 stream
    is a 5xx when its type is server_error)."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    except TimeoutError:
        return answer_type("hang", f"no answer within {timeout_s:.0f} s")
    except (OSError, http.client.HTTPException) as error:
        return answer_type("dropped", f"{type(error).__name__}: {error}")
    finally:
        connection.close()
    text = data.decode("utf-8", "replace")
    kind = f"{response.status // 100}xx" if 200 <= response.status < 600 else "5xx"
    if kind == "2xx" and "text/event-stream" in (response.getheader("Content-Type") or ""):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:]).get("error", {})
                kind = "5xx" if error.get("type") == "server_error" else "4xx"
                break
    return answer_type(kind, text)
