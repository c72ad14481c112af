"""No client can load, unload or reconfigure models: Triton's model-repository, shared-memory, trace and logging APIs
answer only the start's admin key, on HTTP and on gRPC (a model load runs the sender's Python in the server)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from python_backend.server.launcher import ADMIN_HEADER, admin_key_path

# A Python-backend model whose initialize would leave a file behind: the proof that its code ran.
MODEL_PY = """
import pathlib
class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("ran")
    def execute(self, requests):
        return []
"""
CONFIG = json.dumps({"backend": "python", "max_batch_size": 0, "input": [
    {"name": "x", "data_type": "TYPE_INT32", "dims": [1]}], "output": [
    {"name": "y", "data_type": "TYPE_INT32", "dims": [1]}]})


def http(ports, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    request = urllib.request.Request(f"http://{ports.http_url}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(), headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def admin_headers(served_dir, ports) -> dict:
    return {ADMIN_HEADER: admin_key_path(served_dir / "triton", ports).read_text()}


def loaded_models(served_dir, ports) -> set[str]:
    status, text = http(ports, "POST", "/v2/repository/index", {}, admin_headers(served_dir, ports))
    assert status == 200, text
    return {entry["name"] for entry in json.loads(text) if entry.get("state") == "READY"}


def test_model_load_over_http_is_refused_and_runs_nothing(server, served_dir, tmp_path):
    marker = tmp_path / "ran-over-http"
    files = {"file:1/model.py": base64.b64encode(MODEL_PY.format(marker=str(marker)).encode()).decode()}
    status, text = http(server, "POST", "/v2/repository/models/intruder/load",
                        {"parameters": {"config": CONFIG, **files}})
    assert status == 403, (status, text)
    assert "restricted" in text.lower() or ADMIN_HEADER in text
    assert not marker.exists()
    assert "intruder" not in loaded_models(served_dir, server)


def test_model_load_over_grpc_is_refused_and_runs_nothing(server, served_dir, tmp_path):
    marker = tmp_path / "ran-over-grpc"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("intruder_grpc", config=CONFIG,
                              files={"file:1/model.py": MODEL_PY.format(marker=str(marker)).encode()})
        assert "restricted" in str(refused.value).lower() or ADMIN_HEADER in str(refused.value)
    finally:
        client.close()
    assert not marker.exists()
    assert "intruder_grpc" not in loaded_models(served_dir, server)


def test_unload_is_refused_on_both_ports_and_the_engine_keeps_serving(server):
    status, text = http(server, "POST", "/v2/repository/models/engine/unload", {})
    assert status == 403, (status, text)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            client.unload_model("engine")
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        assert client.is_model_ready("engine")
    finally:
        client.close()


@pytest.mark.parametrize("path, body", [("/v2/logging", {"log_verbose_level": 1}),
                                        ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
                                        ("/v2/systemsharedmemory/status", None)])
def test_logging_trace_and_shared_memory_are_closed(server, path, body):
    status, text = http(server, "POST" if body is not None else "GET", path, body)
    assert status == 403, (path, status, text)


def test_health_metadata_and_the_admin_key_still_work(server, served_dir):
    assert http(server, "GET", "/v2/health/ready")[0] == 200
    assert http(server, "GET", "/v2/models/engine")[0] == 200
    assert http(server, "GET", "/v2/models/engine/config")[0] == 200
    assert "engine" in loaded_models(served_dir, server)  # the restriction is the key, not a broken API
    status, _ = http(server, "POST", "/v2/repository/index", {}, {ADMIN_HEADER: "not-the-key"})
    assert status == 403
