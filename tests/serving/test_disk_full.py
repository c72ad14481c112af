"""A full disk is the server's condition, not the client's: the store's failed writes leave the journal as it was
and no file behind (no temp file, no empty quarantine copy, no lock), the engine core sends it as UNAVAILABLE with
a message that starts 'storage full:', which the guarded Triton port answers with 503 (Triton's own generate says
400 to any model error) and the OpenAI front end with 507; a stream that fails after its tokens ends with an error
event. The disk is a real 2 MiB tmpfs where this process
may mount one (root), else a simulated one: os.write refusing with ENOSPC once a byte budget is spent."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from python_backend.core.engine_core import STORAGE_FULL, error_event
from python_backend.core.events import Failed
from ced.state import delta_of
from python_backend.server.openai_api.app import _guarded
from python_backend.server.openai_api.streaming import sse as _sse
from python_backend.server.openai_api.engine_client import engine_error
from python_backend.core.store import ConversationReset, ConversationStore, StoreDamaged
from python_backend.triton.triton_io import RequestError

from test_journal import assert_same_shared, conversation, next_turn  # noqa: F401 - `conversation` is a fixture
from test_fuzz import guard_in_front
from test_triton import generate, stream_events

PAGE = 4096


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted on `path` for the block; skips the test where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(folder: Path, leave: int) -> Path:
    """A file that takes all the space of `folder`'s filesystem but `leave` bytes."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    try:
        filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    except OSError as error:  # full a little sooner than statvfs said: full all the same
        assert error.errno == errno.ENOSPC, error
    return filler


class SimulatedDisk:
    """os.write as on a disk with `room` bytes left: a write takes what fits (a short write), then ENOSPC. Only
    while `full` is on; the store writes through os.write alone."""

    def __init__(self, monkeypatch):
        self.room, self._write = None, os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, descriptor: int, data) -> int:
        if self.room is None:
            return self._write(descriptor, data)
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self._write(descriptor, bytes(data[:self.room]))
        self.room -= written
        return written


@pytest.fixture(params=["tmpfs", "simulated"])
def disk(request, tmp_path, monkeypatch):
    """(store root, fill(leave), free()): a disk that can be filled to `leave` bytes and freed again."""
    if request.param == "tmpfs":
        with tmpfs(tmp_path / "fs", "2m") as root:
            fillers = []
            yield root, lambda leave: fillers.append(fill(root, leave)), lambda: [f.unlink() for f in fillers]
    else:
        simulated, root = SimulatedDisk(monkeypatch), tmp_path / "fs"
        root.mkdir()
        yield root, lambda leave: setattr(simulated, "room", leave), lambda: setattr(simulated, "room", None)


def stray(root: Path) -> list[str]:
    """Whatever the store left besides journals and the test's filler."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.suffix != ".state" and p.name != "filler")


def test_a_full_disk_fails_an_append_and_leaves_the_journal_as_it_was(conversation, disk):
    engine, state = conversation
    root, full, free = disk
    store = ConversationStore(root, engine.config)
    store.save("c1", state)
    before = (root / "c1.state").read_bytes()
    next_turn(engine, state)
    full(PAGE)  # room for part of the record: a short write, then ENOSPC
    with pytest.raises(OSError) as failed:
        store.save("c1", state)
    assert (root / "c1.state").read_bytes() == before and stray(root) == []  # what was written of it, cut off
    assert failed.value.errno == errno.ENOSPC and str(root / "c1.state") in str(failed.value)
    free()
    store.save("c1", state)  # the disk has room again: the same turn is stored
    assert_same_shared(ConversationStore(root, engine.config).load("c1"), state)


def test_a_full_disk_fails_a_snapshot_and_leaves_no_temp_file(conversation, disk):
    engine, state = conversation
    root, full, _ = disk
    store = ConversationStore(root, engine.config)
    full(PAGE)
    with pytest.raises(OSError, match="No space left"):
        store.save("new", state)  # a new conversation: a snapshot through `new.tmp<pid>`
    assert not (root / "new.state").exists() and stray(root) == []


def test_a_full_disk_fails_a_repair_and_leaves_no_empty_quarantine_file(conversation, disk):
    engine, state = conversation
    root, full, free = disk
    store = ConversationStore(root, engine.config)
    store.save("c1", state)
    next_turn(engine, state)
    store.save("c1", state)
    path = root / "c1.state"
    cut = path.read_bytes()[:-100]  # a kill mid-write: the last record's tail is missing
    path.write_bytes(cut)
    full(0)
    with pytest.raises(OSError, match="No space left"):
        ConversationStore(root, engine.config).load("c1")  # the cut-off tail cannot be set aside
    assert path.read_bytes() == cut and stray(root) == []
    free()
    assert ConversationStore(root, engine.config).load("c1").length < state.length  # repaired now: the turn before
    assert len(stray(root)) == 1


def test_a_full_disk_refuses_a_turn_before_any_work_and_leaves_no_lock(conversation, disk):
    engine, _ = conversation
    root, full, _ = disk
    store = ConversationStore(root, engine.config)
    full(0)
    with pytest.raises(OSError) as failed:
        store.begin_turn("c1")
    assert failed.value.errno == errno.ENOSPC and "c1.lock" in str(failed.value) and stray(root) == []


def test_the_engine_core_sends_storage_conditions_as_the_servers():
    full = error_event(7, OSError(errno.ENOSPC, "No space left on device", "/store/c.state"))
    assert full == Failed(7, f"{STORAGE_FULL} [Errno 28] No space left on device: '/store/c.state'", "UNAVAILABLE")
    assert error_event(7, OSError(errno.EDQUOT, "Disk quota exceeded")).message.startswith(STORAGE_FULL)
    assert error_event(7, OSError(errno.EIO, "Input/output error")) == Failed(
        7, "engine failed: OSError: [Errno 5] Input/output error", "INTERNAL")
    assert error_event(7, ConversationReset("reset to its last good turn")) == Failed(
        7, "stored state damaged: reset to its last good turn", "INTERNAL")
    assert error_event(7, StoreDamaged("damaged and has been dropped")).code == "INTERNAL"
    assert error_event(7, RequestError("text_input is empty")) == Failed(7, "text_input is empty", "INVALID_ARG")
    assert error_event(7, RuntimeError("a bug")) == Failed(7, "engine failed: RuntimeError: a bug", "INTERNAL")


def test_the_openai_front_end_answers_a_full_disk_with_507_and_ends_a_stream_with_the_error():
    error = engine_error(f"{STORAGE_FULL} [Errno 28] No space left on device: '/store/c.state'")
    assert error.status == 507 and error.code == "storage_full" and error.kind == "server_error"
    assert engine_error("engine failed: OSError: [Errno 5] Input/output error").status == 500
    assert engine_error("in ensemble 'mol2', stored state damaged: the journal ...").status == 500
    assert engine_error("text_input is empty").status == 400

    async def tokens_then_full_disk():
        yield _sse({"choices": [{"text": "a"}]})
        yield _sse({"choices": [{"text": "b"}]})
        raise error

    async def collect():
        return [event async for event in _guarded(tokens_then_full_disk())]

    events = asyncio.run(collect())
    assert len(events) == 4 and events[-1] == _sse("[DONE]")
    assert json.loads(events[2][len("data: "):])["error"]["code"] == "storage_full"


def post(url: str, **fields) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}/v2/models/mol2/generate", method="POST",
                                     data=json.dumps(fields).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_full_disk_on_the_live_server_is_a_503_and_a_stream_ends_with_the_error(server, served_dir):
    """The session's server behind the guard, its store covered for this test by a 2 MiB tmpfs (what was there
    comes back after)."""
    with tmpfs(served_dir / "conversations", "2m") as store, guard_in_front(server.http_url) as guarded:
        started = generate(server, text_input="a conversation on a small disk", adapter="chat", max_tokens=3)
        assert "error" not in started, started
        cid = started["conversation_id_out"]
        journal = (store / f"{cid}.state").read_bytes()
        filler = fill(store, PAGE)  # the next turn's lock fits, its record does not

        events = stream_events(server, text_input="and then?", adapter="chat", max_tokens=4, ignore_eos=True,
                               conversation_id=cid)
        assert [event.get("output_tokens") for event in events[:-1]] == [1, 2, 3, 4]  # the tokens went out ...
        assert f"'mol2', {STORAGE_FULL}" in events[-1]["error"]  # ... then the error ("in ensemble 'mol2', ...")
        status, answer = post(guarded, text_input="and then?", adapter="chat", max_tokens=4, conversation_id=cid)
        assert status == 503 and f"'mol2', {STORAGE_FULL}" in answer["error"], (status, answer)
        assert post(server.http_url, text_input="and then?", adapter="chat", max_tokens=4,
                    conversation_id=cid)[0] == 400  # Triton's own port: why the guard sets the status
        assert (store / f"{cid}.state").read_bytes() == journal and stray(store) == []

        filler.unlink()
        assert "error" not in generate(server, text_input="and then?", adapter="chat", max_tokens=4,
                                       conversation_id=cid)
        assert len((store / f"{cid}.state").read_bytes()) > len(journal)
