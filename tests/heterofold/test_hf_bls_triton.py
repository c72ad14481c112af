"""HeteroFold on a real tritonserver (model_repository_heterofold/, the tiny zoo and map of conftest): the BLS
path gives the in-process path's tokens, from text or from client-sent KV blocks; blocks of the wrong dtype, shape
or fingerprint are refused with a clear error and the server keeps serving."""
import contextlib
import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from heterofold import pipeline, zoo
from heterofold.serving import REPOSITORY
from python_backend.server.launcher import Ports, running

TEXTS = ["grep searches the named input files for lines containing a match.",
         "Return a new sorted list from the items in iterable."]


@pytest.fixture(scope="module")
def client(served_root):
    ports = Ports.free()
    with contextlib.ExitStack() as server:
        # started from inside its root, as `cd ROOT && heterofold --root . serve` does: the root's `triton/` work
        # folder must not shadow the `triton` package the model processes import
        with contextlib.chdir(served_root):
            server.enter_context(running(REPOSITORY, ports, served_root / "triton", served_root / "tritonserver.log",
                                         env={"HETEROFOLD_ROOT": str(served_root)}, timeout_s=120))
        client = httpclient.InferenceServerClient(ports.http_url, network_timeout=120)
        yield client
        client.close()          # an open keep-alive connection holds the server's shutdown for its exit timeout


def infer(client, model, outputs, **fields):
    inputs = []
    for name, value in fields.items():
        value = np.array([value.encode()], dtype=object) if isinstance(value, str) else np.asarray(value)
        inputs.append(httpclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    result = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput(o) for o in outputs])
    return {o: result.as_numpy(o) for o in outputs}


@pytest.fixture(scope="module")
def in_process(served_root):
    s, r = zoo.load("llama", served_root), zoo.load("qwen3", served_root)
    return {t: pipeline.apply_map_ids(served_root / "maps" / "llama-to-qwen3", s, r, t, 10) for t in TEXTS}


def bls(client, text, **blocks):
    return infer(client, "heterofold", ["output_ids", "text_output", "map_used"], text_input=text,
                 map="llama-to-qwen3", max_tokens=np.array([10], np.int32), **blocks)


def export(client, text):
    return infer(client, "heterofold_sender", ["kv_keys", "kv_values", "token_ends", "sender_fingerprint"],
                 text_input=text, sender="llama")


def test_bls_returns_the_in_process_tokens(client, in_process):
    for text in TEXTS:
        out = bls(client, text)                                   # the BLS asks heterofold_sender itself
        assert out["output_ids"].tolist() == in_process[text]
        used = json.loads(out["map_used"][0])
        assert (used["name"], used["sender"], used["receiver"]) == ("llama-to-qwen3", "llama", "qwen3")
        blocks = export(client, text)                             # blocks exported, then sent by the client
        assert bls(client, text, **blocks)["output_ids"].tolist() == in_process[text]


def test_mismatched_blocks_are_refused_and_the_server_serves_on(client, in_process):
    text = TEXTS[0]
    good = export(client, text)
    fp = json.loads(good["sender_fingerprint"][0])
    refused = {
        "sender tokenizer_hash": dict(good, sender_fingerprint=json.dumps(dict(fp, tokenizer_hash="0" * 16))),
        "kv_keys: shape": dict(good, kv_keys=np.ascontiguousarray(good["kv_keys"][:, :, :-1])),
        "data-type is 'FP16', but model 'heterofold' expects 'FP32'": dict(good, kv_values=good["kv_values"].astype(np.float16)),   # Triton's own check
    }
    for expected, blocks in refused.items():
        with pytest.raises(InferenceServerException, match=expected):
            bls(client, text, **blocks)
    with pytest.raises(InferenceServerException, match="no map 'qwen3-to-llama'"):
        infer(client, "heterofold", ["output_ids"], text_input=text, map="qwen3-to-llama")
    assert bls(client, text)["output_ids"].tolist() == in_process[text]
