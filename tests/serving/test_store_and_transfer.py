"""The state transfer codec and the conversation store: exact round trips, refusal of damaged or foreign records,
one turn at a time per conversation, expiry, and the 31-bit FNV-1a adapter id."""

import os
import time

import pytest
import torch

from ced import CEDConfig
from python_backend.core.fnv import adapter_hash
from python_backend.core.store import ConversationBusy, ConversationStore, StoreError, UnknownConversation
from python_backend.core.transfer import TransferError, decode_state, encode_state


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
    reopened = ConversationStore(tmp_path, engine.config)  # another model process of the same server
    assert reopened.load("c1").shared.tokens == state.shared.tokens
    store.begin_turn("c1")
    with pytest.raises(ConversationBusy, match="already has a turn in progress"):
        reopened.begin_turn("c1")
    with pytest.raises(ConversationBusy, match="already has a turn in progress"):
        store.begin_turn("c1")  # the same store, a second turn
    assert store.expire(now=time.time() + 300) == []  # idle past the timeout, but a turn runs
    assert reopened.expire(now=time.time() + 300) == []  # seen from another store: its lock is held
    reopened.end_turn("c1")  # not its lock: left alone
    with pytest.raises(ConversationBusy):
        reopened.begin_turn("c1")
    store.end_turn("c1")
    assert not (tmp_path / "c1.lock").exists()
    assert store.expire(now=time.time() + 300) == ["c1"]
    with pytest.raises(UnknownConversation, match="unknown conversation_id 'c1'"):
        store.load("c1")


def test_a_lock_file_left_unheld_neither_blocks_nor_lingers(conversation, tmp_path):
    """A lock file whose holder died (the kernel released its flock; tests/serving/test_store_locks.py kills a real
    process) is taken at once and swept by expiry."""
    engine, state = conversation
    store = ConversationStore(tmp_path, engine.config, idle_timeout_s=60)
    store.save("c1", state)
    (tmp_path / "c1.lock").write_text("4242 1700000000\n")  # as a killed process leaves it
    (tmp_path / "never-saved.lock").write_text("4242 1700000000\n")
    store.begin_turn("c1")
    store.end_turn("c1")
    assert store.expire(now=time.time() + 300) == ["c1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the orphan lock is swept too


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
    from python_backend.server.repo_build import build

    repository = tmp_path / "repo"
    written = build(served_dir / "adapter_set.json", repository, name="support")
    assert written == ["engine_support", "router_support", "decode_support", "route_support", "mol2_support"]
    ensemble = (repository / "mol2_support" / "config.pbtxt").read_text()
    assert 'name: "mol2_support"' in ensemble and 'model_name: "tokenize"' in ensemble  # the shared tokenizer
    assert 'model_name: "engine_support"' in ensemble  # the set's engine: its registry and router head
    decode = (repository / "decode_support" / "config.pbtxt").read_text()
    assert str((served_dir / "adapter_set.json").resolve()) in decode and "decoupled: true" in decode
    assert (repository / "decode_support" / "1" / "model.py").is_file()
    route = (repository / "route_support" / "config.pbtxt").read_text()
    assert 'name: "route_support"' in route and 'string_value: "router_support"' in route
    # a new repository is whole (the shared models beside the set's); the committed one is never written
    from python_backend.server.repo_build import GENERATED, TEMPLATES

    assert {"tokenize", "engine", "mol2"} <= {p.name for p in repository.iterdir()}
    assert not (TEMPLATES / "mol2_support").exists() and GENERATED != TEMPLATES


def test_a_set_kept_away_from_a_router_head_routes_with_the_models(served_dir, tmp_path):
    from python_backend.server.repo_build import build

    elsewhere = tmp_path / "sets" / "two.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text((served_dir / "alt_set.json").read_text())
    build(elsewhere, tmp_path / "repo", name="two")
    router = (tmp_path / "repo" / "router_two" / "config.pbtxt").read_text()
    assert 'key: "router_dir" value: { string_value: "auto" }' in router  # not sets/router, which does not exist
    with pytest.raises(FileNotFoundError, match="holds no router head"):
        build(elsewhere, tmp_path / "repo2", name="two", router_dir=tmp_path)


def test_an_adapter_set_gives_each_entry_its_own_directory(tmp_path):
    import json

    from python_backend.core.adapter_set import AdapterSetError, parse_adapter_set

    entries = [{"name": "code", "path": "adapters/coding", "description": "code"},
               {"name": "code_v2", "path": "adapters/../adapters/coding", "description": "the same weights"}]
    (tmp_path / "set.json").write_text(json.dumps({"adapters": entries}))
    with pytest.raises(AdapterSetError, match="'code_v2' has the same directory as 'code'"):
        parse_adapter_set(tmp_path / "set.json")


def test_an_adapter_that_failed_to_load_is_named_with_its_error(engine, adapter_dirs, tmp_path):
    import json

    from python_backend.core.adapter_set import parse_adapter_set, sync_registry
    from python_backend.core.serving import Served
    from python_backend.triton.triton_io import RequestError

    entries = [{"name": "A1", "path": adapter_dirs["A1"], "description": "fine"},
               {"name": "broken", "path": str(tmp_path / "missing"), "description": "no such directory"}]
    (tmp_path / "set.json").write_text(json.dumps({"adapters": entries}))
    adapter_set, fingerprints, failures = parse_adapter_set(tmp_path / "set.json"), {}, {}
    sync_registry(engine.adapters, adapter_set, fingerprints, failures)
    assert list(failures) == ["broken"] and "does not exist" in failures["broken"]
    served = Served(None, engine, None, None, None, fingerprints, failures)
    assert served.adapter_for(adapter_set, adapter_set.by_name("A1").hash) == "A1"
    with pytest.raises(RequestError, match="'broken' is in the adapter set but failed to load: .*does not exist"):
        served.adapter_for(adapter_set, adapter_set.by_name("broken").hash)
    (tmp_path / "set.json").write_text(json.dumps({"adapters": entries[:1]}))
    sync_registry(engine.adapters, parse_adapter_set(tmp_path / "set.json"), fingerprints, failures)
    assert failures == {}   # dropped from the set: nothing to report any more
