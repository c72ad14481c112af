"""Work per request is bounded on Triton's ports: an oversized prompt is refused by its size before it is decoded or
tokenized, quickly and without the engine keeping the memory; text that is no valid Unicode is a 400 naming its
input, never an engine failure."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from python_backend.server.supervisor import model_processes

MIB = 1 << 20


def tritonserver_pid(grpc_port: int) -> int:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and f"--grpc-port={grpc_port}".encode() in args:
            return int(entry)
    raise LookupError(f"no tritonserver on gRPC port {grpc_port}")


def children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.fixture()
def processes(server):
    """name -> pid of the tokenize model's process and of the engine's core (a child of the engine model's)."""
    stubs = {name: pid for pid, name in model_processes(tritonserver_pid(server.grpc)).items()}
    cores = children(stubs["engine"])
    assert len(cores) == 1, cores
    return {"tokenize": stubs["tokenize"], "core": cores[0]}


def call(server, model: str, **inputs) -> tuple[str | None, float]:
    """One request over gRPC streaming; (the error message or None, seconds to the answer)."""
    tensors = []
    for name, value in inputs.items():
        if isinstance(value, (str, bytes)):
            data = np.array([value.encode() if isinstance(value, str) else value], dtype=object)
            tensor = grpcclient.InferInput(name, [1], "BYTES")
        else:
            data = np.array([value], dtype=np.int32)
            tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    answers = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    started = time.monotonic()
    try:
        client.start_stream(callback=lambda result, error: answers.append((result, error)))
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        while not any(error is not None or result.get_response().parameters.get("triton_final_response",
                                                                                  None) is not None
                      and result.get_response().parameters["triton_final_response"].bool_param
                      for result, error in answers):
            time.sleep(0.01)
            assert time.monotonic() - started < 120, "no answer in 120 s"
        client.stop_stream()
    finally:
        client.close()
    errors = [error for _, error in answers if error is not None]
    message = None if not errors else (errors[0].message() if isinstance(errors[0], InferenceServerException)
                                       else str(errors[0]))
    return message, time.monotonic() - started


@pytest.mark.parametrize("model, field, size", [("mol2", "text_input", 16 * MIB), ("engine", "prompt", 64 * MIB),
                                                ("engine", "messages", 16 * MIB)])
def test_an_oversized_prompt_is_refused_by_its_size(server, processes, model, field, size):
    text = "x" * size
    if field == "messages":
        text = json.dumps([{"role": "user", "content": text[:-40]}])
    before = {name: rss_mib(pid) for name, pid in processes.items()}
    message, seconds = call(server, model, **{field: text, "max_tokens": 4})
    assert message is not None and f"{field} is {len(text):,} bytes" in message and "max_prompt_tokens" in message
    assert seconds < 20, f"refused after {seconds:.1f} s"
    time.sleep(0.5)
    grown = {name: rss_mib(pid) - before[name] for name, pid in processes.items()}
    # what tokenizing would have cost: ~190 bytes of memory a byte of prompt (12.3 GB for 64 MiB); a refusal by size
    # keeps nothing (the request's own bytes are freed with it)
    assert all(growth < 40 for growth in grown.values()), grown


@pytest.mark.parametrize("model, field, value, expected", [
    ("mol2", "text_input", b"hi \xed\xa0\x80", "text_input is not valid UTF-8 text"),
    ("engine", "prompt", b"\xff\xfe", "prompt is not valid UTF-8 text"),
    ("engine", "messages", json.dumps([{"role": "user", "content": "a\ud800"}]).encode(),
     "messages[0].content holds a lone surrogate"),
    ("engine", "messages", b"[" * 5000 + b"]" * 5000, "messages nests too deeply"),
])
def test_text_that_is_no_unicode_is_refused_naming_its_input(server, model, field, value, expected):
    message, _ = call(server, model, **{field: value, "max_tokens": 4})
    assert message is not None and expected in message, message
    assert "engine failed" not in message
