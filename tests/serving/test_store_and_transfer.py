"""The state transfer codec and the conversation store: exact round trips, refusal of damaged or foreign records,
one turn at a time per conversation, expiry, and the 31-bit FNV-1a adapter id."""

import os
import time

import pytest
import torch

from ced import CEDConfig
from python_backend.fnv import adapter_hash
from python_backend.store import ConversationBusy, ConversationStore, StoreError, UnknownConversation
from python_backend.transfer import TransferError, decode_state, encode_state


@pytest.fixture()
def conversation(engine):
    state = engine.new_conversation()
    result = engine.turn(state, list(range(40)), "A1")
    list(engine.generate(state, "A1", result.logits, max_tokens=5))
    return engine, state


def test_fnv1a_known_values():
    assert adapter_hash(None) == 0
    assert adapter_hash("a") == 0xE40C292C & 0x7FFFFFFF  # FNV-1a 32 of "a", folded to 31 bits
    assert adapter_hash("") == 0x811C9DC5 & 0x7FFFFFFF
    assert 0 < adapter_hash("/srv/adapters/coding") < 2**31


def test_round_trip_continues_bit_for_bit(conversation):
    engine, state = conversation
    restored = decode_state(encode_state(state, engine.config), engine.config)
    assert restored.shared.tokens == state.shared.tokens and restored.nbytes() == state.nbytes()
    assert torch.equal(engine.step(restored, 7, "A1"), engine.step(state, 7, "A1"))
    assert torch.equal(engine.turn(restored, [1, 2], "L0").logits, engine.turn(state, [1, 2], "L0").logits)


def test_tensors_with_zero_strides_are_encoded(conversation):
    """ONNX Runtime hands back size-1 dims with stride 0: the codec stores them densely, values unchanged."""
    engine, state = conversation
    window = next(w for w in state.shared.windows.values() if w.k is not None)
    narrow = window.k[..., :1].contiguous()
    window.k = torch.as_strided(narrow, narrow.shape, (*narrow.stride()[:-1], 0))
    restored = decode_state(encode_state(state, engine.config), engine.config)
    restored_k = next(w.k for w in restored.shared.windows.values() if w.k is not None)
    assert torch.equal(restored_k, window.k)


def test_damaged_and_foreign_records_are_refused(conversation):
    engine, state = conversation
    data = bytearray(encode_state(state, engine.config))
    data[-3] ^= 0xFF
    with pytest.raises(TransferError, match="damaged"):
        decode_state(bytes(data), engine.config)
    with pytest.raises(TransferError, match="another model config"):
        decode_state(encode_state(state, engine.config), CEDConfig.from_name("tiny", window=32))
    with pytest.raises(TransferError, match="not a readable"):
        decode_state(b"\x05" * 30, engine.config)


def test_store_persists_refuses_busy_and_expires(conversation, tmp_path):
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config, idle_timeout_s=60)
    store.save("c1", state)
    reopened = ConversationStore(tmp_path, engine.config)  # a restarted server
    assert reopened.load("c1").shared.tokens == state.shared.tokens
    store.begin_turn("c1")
    with pytest.raises(ConversationBusy, match="already has a turn in progress"):
        reopened.begin_turn("c1")
    assert store.expire(now=time.time() + 3600) == []  # never while a turn runs
    store.end_turn("c1")
    assert store.expire(now=time.time() + 3600) == ["c1"]
    with pytest.raises(UnknownConversation, match="unknown conversation_id 'c1'"):
        store.load("c1")


def test_damaged_record_is_dropped_not_loaded(conversation, tmp_path):
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config)
    store.save("c2", state)
    path = tmp_path / "c2.state"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="damaged and has been dropped"):
        store.load("c2")
    assert not path.exists()


@pytest.mark.parametrize("bad", ["../etc/passwd", "", ".hidden", "a" * 129, "x/y", None])
def test_conversation_ids_cannot_name_files(tmp_path, bad, tiny_config):
    store = ConversationStore(tmp_path, tiny_config)
    with pytest.raises(StoreError, match="conversation_id"):
        store.exists(bad)
    assert os.listdir(tmp_path) == []


def test_repo_build_writes_one_ensemble_per_set(served_dir, tmp_path):
    from python_backend.repo_build import build

    repository = tmp_path / "repo"
    written = build(served_dir / "adapter_set.json", repository, name="support")
    assert written == ["router_support", "decode_support", "route_support", "mol2_support"]
    ensemble = (repository / "mol2_support" / "config.pbtxt").read_text()
    assert 'name: "mol2_support"' in ensemble and 'model_name: "prefill"' in ensemble  # shared adapter-free stage
    assert 'model_name: "router_support"' in ensemble and 'model_name: "decode_support"' in ensemble
    decode = (repository / "decode_support" / "config.pbtxt").read_text()
    assert str((served_dir / "adapter_set.json").resolve()) in decode and "decoupled: true" in decode
    assert (repository / "decode_support" / "1" / "model.py").is_file()
    route = (repository / "route_support" / "config.pbtxt").read_text()
    assert 'name: "route_support"' in route and 'string_value: "router_support"' in route
