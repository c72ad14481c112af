"""The Triton glue of HeteroFold without a server (a fake `triton_python_backend_utils`): the BLS path, with text
or with client-sent KV blocks, gives the in-process tokens; blocks of the wrong dtype, shape or fingerprint, a
partial set of blocks and an unknown map are refused per request, naming what does not match."""
import json
import types

import numpy as np
import pytest

from heterofold import pipeline, zoo
from heterofold.serving import BlockMismatch, Receiver, Sender, Settings, heterofold_execute, sender_execute

TEXT = "grep searches the named input files for lines containing a match."


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.tensors, self._error = {t.name(): t for t in output_tensors}, error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


def fake_pb(sender: Sender):
    """The few pieces of triton_python_backend_utils the two models use; BLS calls reach `sender` directly."""
    pb = types.SimpleNamespace(Tensor=Tensor, TritonError=TritonError, InferenceResponse=InferenceResponse,
                               get_input_tensor_by_name=lambda request, name: request.get(name),
                               get_output_tensor_by_name=lambda response, name: response.tensors.get(name))

    class InferenceRequest:
        calls = []

        def __init__(self, model_name, requested_output_names, inputs):
            self.model_name, self.inputs = model_name, {t.name(): t for t in inputs}
            InferenceRequest.calls.append(model_name)

        def exec(self):
            assert self.model_name == "heterofold_sender"
            return sender_execute(pb, sender, [self.inputs])[0]

    pb.InferenceRequest = InferenceRequest
    return pb


def request(**fields):
    out = {}
    for name, value in fields.items():
        if isinstance(value, str):
            value = np.array([value.encode()], dtype=object)
        out[name] = Tensor(name, value)
    return out


@pytest.fixture(scope="module")
def served(served_root):
    settings = Settings.from_parameters({"root": str(served_root)})
    sender = Sender(settings)
    return settings, sender, Receiver(settings), fake_pb(sender)


@pytest.fixture(scope="module")
def in_process_ids(served_root):
    s, r = zoo.load("llama", served_root), zoo.load("qwen3", served_root)
    return pipeline.apply_map_ids(served_root / "maps" / "llama-to-qwen3", s, r, TEXT, 8)


def exported(pb, sender):
    response = sender_execute(pb, sender, [request(text_input=TEXT, sender="llama")])[0]
    assert not response.has_error(), response.error().message()
    return {name: t.as_numpy() for name, t in response.tensors.items()}


def test_bls_with_text_matches_in_process(served, in_process_ids):
    _, sender, receiver, pb = served
    pb.InferenceRequest.calls.clear()
    response = heterofold_execute(pb, receiver, [request(text_input=TEXT, map="llama-to-qwen3",
                                                         max_tokens=np.array([8], np.int32))])[0]
    assert not response.has_error(), response.error().message()
    assert response.tensors["output_ids"].as_numpy().tolist() == in_process_ids
    assert pb.InferenceRequest.calls == ["heterofold_sender"]
    used = json.loads(response.tensors["map_used"].as_numpy()[0])
    assert (used["name"], used["sender"], used["receiver"]) == ("llama-to-qwen3", "llama", "qwen3")
    assert len(used["digest"]) == 16


def test_bls_with_client_blocks_matches_in_process(served, in_process_ids):
    _, sender, receiver, pb = served
    blocks = exported(pb, sender)
    assert blocks["kv_keys"].dtype == np.float32 and blocks["kv_keys"].shape[0] == 2    # tiny llama: 2 layers
    assert json.loads(blocks["sender_fingerprint"][0])["family"] == "llama"
    pb.InferenceRequest.calls.clear()
    response = heterofold_execute(pb, receiver, [request(text_input=TEXT, map="llama-to-qwen3",
                                                         max_tokens=np.array([8], np.int32), **blocks)])[0]
    assert not response.has_error(), response.error().message()
    assert response.tensors["output_ids"].as_numpy().tolist() == in_process_ids
    assert pb.InferenceRequest.calls == []                                   # no sender call: blocks were given


def test_mismatched_blocks_are_refused_per_request(served, in_process_ids):
    _, sender, receiver, pb = served
    good = exported(pb, sender)
    fp = json.loads(good["sender_fingerprint"][0])
    cases = {
        "dtype float16": dict(good, kv_keys=good["kv_keys"].astype(np.float16)),
        "kv_values: shape": dict(good, kv_values=good["kv_values"][:, :, :-2]),
        "kv_keys: shape": dict(good, kv_keys=good["kv_keys"][:1]),
        "sender config_hash": dict(good, sender_fingerprint=json.dumps(dict(fp, config_hash="0" * 16))),
        "sender family: map has 'llama', model has 'mistral'":
            dict(good, sender_fingerprint=json.dumps(dict(fp, family="mistral"))),
        "come as kv_keys, kv_values, token_ends, sender_fingerprint together; got only kv_keys, token_ends":
            {k: v for k, v in good.items() if k != "kv_values"},
        "kv_keys: holds NaN or infinite values": dict(good, kv_keys=np.full_like(good["kv_keys"], np.nan)),
        "kv_values: holds NaN or infinite values": dict(good, kv_values=np.full_like(good["kv_values"], np.inf)),
        "the first at least 1": dict(good, token_ends=np.concatenate([[-100], good["token_ends"][1:]])),
    }
    batch = [request(text_input=TEXT, map="llama-to-qwen3", **blocks) for blocks in cases.values()]
    batch.append(request(text_input=TEXT + " more", map="llama-to-qwen3", **good))       # blocks of another text
    batch.append(request(text_input=TEXT, map="no-such-map"))
    batch.append(request(text_input=TEXT, map="llama-to-qwen3", max_tokens=np.array([8], np.int32), **good))
    responses = heterofold_execute(pb, receiver, batch)
    messages = [r.error().message() for r in responses[:-1]]
    for expected, message in zip(list(cases) + ["exported for another text", "no map 'no-such-map'"], messages):
        assert expected in message, message
    assert not responses[-1].has_error()                                   # the rest of the batch is served
    assert responses[-1].tensors["output_ids"].as_numpy().tolist() == in_process_ids


def test_sender_errors_are_per_request(served):
    _, sender, _, pb = served
    responses = sender_execute(pb, sender, [request(text_input=TEXT, sender="mistral"),
                                            request(sender="llama"), request(text_input=TEXT, sender="llama")])
    assert "no zoo model 'mistral'" in responses[0].error().message()
    assert "missing input 'text_input'" in responses[1].error().message()
    assert not responses[2].has_error()


def test_settings_from_parameters_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HETEROFOLD_ROOT", str(tmp_path))
    s = Settings.from_parameters({"threads": "2"})
    assert (s.root, s.maps_dir, s.threads, s.sender_model) == (tmp_path, tmp_path / "maps", 2, "heterofold_sender")
    s = Settings.from_parameters({"root": "/x", "maps_dir": "/y"})
    assert (s.root, s.maps_dir) == (__import__("pathlib").Path("/x"), __import__("pathlib").Path("/y"))
    assert issubclass(BlockMismatch, ValueError)


def test_a_damaged_map_is_named_when_served(served, tmp_path):
    import shutil

    settings, sender, _, pb = served
    maps = tmp_path / "maps"
    shutil.copytree(settings.maps_dir / "llama-to-qwen3", maps / "broken")
    (maps / "broken" / "map.json").write_text("{not json")
    receiver = Receiver(Settings.from_parameters({"root": str(settings.root), "maps_dir": str(maps)}))
    response = heterofold_execute(pb, receiver, [request(text_input=TEXT, map="broken")])[0]
    assert "broken/map.json is damaged (not JSON" in response.error().message()
