"""A conversation's state as an append-only journal: one record per turn holding only what that turn added.

The global KV grows by one entry per block of m tokens and is never rewritten, so a record carries the entries
the turn completed plus the parts bounded by the window W, which it replaces whole (encoder windows, the first
decoder layer's window, stream, selection, pending blocks). Bytes per turn are O(new tokens + W), not O(context).
Adapter-bound windows are not stored: every turn rebuilds them by bounded replay from stream and selection.

One record: b"MJR1", the payload's length (8 bytes, little-endian), the payload (safetensors, never pickle) and a
16-byte blake2b digest of length + payload. Everything else (start length, tokens, adapter name, config
fingerprint, format version) lives inside the payload, so the digest covers every field: a kill mid-write leaves a
truncated tail and a flipped bit a digest mismatch, both caught before anything is replayed. The two are told
apart (`JournalScan.torn`): a write cut off loses only the turn it was writing, which was never answered; damage to
a complete record loses answered turns, and whoever reads it must say so. The record digests, in order, are the
journal's identity: what the store compares with what it wrote.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor

from ced.config import CEDConfig
from ced.state import AdapterState, ConversationState, GlobalKV, LocalWindow, Selection, SharedState, StateDelta

from .transfer import config_fingerprint

MAGIC = b"MJR1"
FORMAT = "mol2-journal-1"
_HEAD = len(MAGIC) + 8  # magic + payload length
DIGEST_SIZE = _DIGEST = 16  # a record ends with its digest


class JournalError(ValueError):
    """A delta that does not fit the state it is applied to, or a record that cannot be read."""


class TornRecord(JournalError):
    """The file ends inside a record: a write cut off (a kill mid-append), or a damaged length field."""


def _dense(tensor: Tensor) -> Tensor:
    """A dense copy: a size-1 dim may carry stride 0 (ONNX Runtime outputs do), and a delta must not share storage
    with the live state it was taken from."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def empty_state(config: CEDConfig) -> ConversationState:
    """A conversation with no tokens, as CEDEngine.new_conversation builds it, from the config alone."""
    windows = lambda layers: {i: LocalWindow(config.window) for i in layers}  # noqa: E731
    shared = SharedState(windows(range(config.decoder_start + 1)), {i: GlobalKV() for i in config.source_layers})
    return ConversationState(shared, AdapterState(None, windows(config.adapter_bound_layers)))


def _first_new_entry(globals_: dict[int, GlobalKV], length: int, since_length: int) -> int:
    """since_length // m, with m read off the state (a source holds length // m entries and length % m pending
    rows), so that a delta is taken without the config."""
    store = next(iter(globals_.values()), None)
    if store is None or store.n_entries == 0:
        return 0
    pending = 0 if store.pending is None else store.pending.shape[1]
    return since_length // ((length - pending) // store.n_entries)


def delta_of(state: ConversationState, since_length: int) -> StateDelta:
    """What `state` holds beyond its first `since_length` tokens (0: the whole state, a snapshot)."""
    shared = state.shared
    if not 0 <= since_length <= shared.length:
        raise JournalError(f"cannot take a delta since token {since_length} of a state of {shared.length} tokens")
    first = _first_new_entry(shared.globals, shared.length, since_length)
    entries = {layer: (_dense(g.k[:, first:]), _dense(g.v[:, first:]), _dense(g.index_keys[:, first:]))
               for layer, g in shared.globals.items() if g.k is not None}
    pending = {layer: None if g.pending is None or g.pending.shape[1] == 0 else _dense(g.pending)
               for layer, g in shared.globals.items()}
    windows = {layer: (_dense(w.k), _dense(w.v)) for layer, w in shared.windows.items() if w.k is not None}
    stream = None if shared.stream is None else _dense(shared.stream)
    selection = None if shared.selection is None else (_dense(shared.selection.idx), _dense(shared.selection.valid))
    return StateDelta(since_length, list(shared.tokens[since_length:]), entries, pending, windows, stream, selection,
                      state.bound.adapter)


def apply_delta(state: ConversationState, delta: StateDelta) -> None:
    """Extend `state` (of exactly delta.start_length tokens) by `delta`. The adapter-bound windows come back empty,
    for `delta.bound_adapter` at length 0: the next turn rebuilds them by replay."""
    shared = state.shared
    if shared.length != delta.start_length:
        raise JournalError(f"the delta starts at token {delta.start_length}, the state holds {shared.length}")
    unknown = sorted(set(delta.entries) - set(shared.globals)) + sorted(set(delta.windows) - set(shared.windows))
    if unknown:
        raise JournalError(f"the delta names layers {unknown} this state does not have")
    shared.tokens.extend(delta.tokens)
    for layer, store in shared.globals.items():
        if layer in delta.entries:
            store.add_entries(*delta.entries[layer])
        store.pending = delta.pending.get(layer)
    for layer, window in shared.windows.items():
        window.k, window.v = delta.windows.get(layer, (None, None))
    shared.stream = delta.stream
    shared.selection = None if delta.selection is None else Selection(*delta.selection)
    state.bound = AdapterState(delta.bound_adapter, {i: LocalWindow(w.size) for i, w in state.bound.windows.items()})


# -- records ------------------------------------------------------------------------------------------------


def encode_record(delta: StateDelta, config: CEDConfig) -> bytes:
    tensors = {"tokens": torch.tensor(delta.tokens, dtype=torch.int64)}

    def put(name: str, tensor: Tensor | None) -> None:
        if tensor is not None:
            tensors[name] = _dense(tensor)

    for layer, (k, v, index_keys) in delta.entries.items():
        put(f"entries.{layer}.k", k), put(f"entries.{layer}.v", v), put(f"entries.{layer}.index_keys", index_keys)
    for layer, pending in delta.pending.items():
        put(f"pending.{layer}", pending)
    for layer, (k, v) in delta.windows.items():
        put(f"window.{layer}.k", k), put(f"window.{layer}.v", v)
    put("stream", delta.stream)
    if delta.selection is not None:
        put("selection.idx", delta.selection[0]), put("selection.valid", delta.selection[1])
    metadata = {"format": FORMAT, "config": config_fingerprint(config), "start_length": str(delta.start_length),
                "bound_adapter": json.dumps(delta.bound_adapter)}
    payload = save(tensors, metadata=metadata)
    length = len(payload).to_bytes(8, "little")
    return MAGIC + length + payload + _digest(length, payload)


def _digest(length: bytes, payload) -> bytes:
    digest = hashlib.blake2b(length, digest_size=_DIGEST)
    digest.update(payload)
    return digest.digest()


def _payload_at(data: memoryview, offset: int) -> tuple[memoryview, int]:
    """The payload of the record at `offset` once its framing and digest check out, and where the record ends."""
    head = data[offset: offset + _HEAD]
    if len(head) < _HEAD:
        raise TornRecord(f"truncated record at byte {offset}: {len(head)} of {_HEAD} header bytes")
    if head[:len(MAGIC)] != MAGIC:
        raise JournalError(f"bad magic {bytes(head[:len(MAGIC)])!r} at byte {offset}")
    size = int.from_bytes(head[len(MAGIC):], "little")
    end = offset + _HEAD + size + _DIGEST
    if end > len(data):
        raise TornRecord(f"truncated record at byte {offset}: {size + _DIGEST} bytes announced, "
                           f"{len(data) - offset - _HEAD} present")
    payload = data[offset + _HEAD: end - _DIGEST]
    if _digest(bytes(head[len(MAGIC):]), payload) != data[end - _DIGEST: end]:
        raise JournalError(f"digest mismatch in the record at byte {offset}: the record is damaged")
    return payload, end


def _decode_payload(payload: bytes, config: CEDConfig) -> StateDelta:
    try:
        tensors = load(payload)
        header = json.loads(payload[8: 8 + int.from_bytes(payload[:8], "little")])
        metadata = header.get("__metadata__", {})
        start_length, bound_adapter = int(metadata["start_length"]), json.loads(metadata["bound_adapter"])
        tokens = tensors["tokens"].tolist()
    except (SafetensorError, ValueError, KeyError, UnicodeDecodeError) as error:
        raise JournalError(f"a record's payload is not a readable journal record: {error}") from None
    if metadata.get("format") != FORMAT:
        raise JournalError(f"record format {metadata.get('format')!r} is not {FORMAT!r}")
    if metadata.get("config") != config_fingerprint(config):
        raise JournalError(f"record was written for another model config "
                           f"({metadata.get('config')} != {config_fingerprint(config)})")
    delta = StateDelta(start_length, tokens, bound_adapter=bound_adapter)
    m = config.block_size
    added = delta.end_length // m - start_length // m  # the blocks its tokens completed (a snapshot: all of them)
    for layer in config.source_layers:
        if f"entries.{layer}.k" in tensors:
            delta.entries[layer] = tuple(tensors[f"entries.{layer}.{n}"] for n in ("k", "v", "index_keys"))
        held = delta.entries[layer][0].shape[1] if layer in delta.entries else 0
        if held != added:  # anything else would put every later entry at the wrong block
            raise JournalError(f"record at token {start_length} holds {held} global entries of layer {layer}, "
                               f"its {len(tokens)} tokens complete {added}")
        delta.pending[layer] = tensors.get(f"pending.{layer}")
    for layer in range(config.decoder_start + 1):
        if f"window.{layer}.k" in tensors:
            delta.windows[layer] = (tensors[f"window.{layer}.k"], tensors[f"window.{layer}.v"])
    delta.stream = tensors.get("stream")
    if "selection.idx" in tensors:
        delta.selection = (tensors["selection.idx"], tensors["selection.valid"])
    return delta


def decode_record(data: bytes, config: CEDConfig) -> StateDelta:
    """Exactly one record; raises JournalError naming what is wrong with it."""
    payload, end = _payload_at(memoryview(data), 0)
    if end != len(data):
        raise JournalError(f"{len(data) - end} bytes follow the record")
    return _decode_payload(bytes(payload), config)


def record_digest(data: bytes) -> bytes:
    """The digest of the one record `data` holds, once its framing and digest check out (its tensors unread)."""
    _, end = _payload_at(memoryview(data), 0)
    if end != len(data):
        raise JournalError(f"{len(data) - end} bytes follow the record")
    return bytes(data[end - _DIGEST: end])


@dataclass
class JournalScan:
    """What read_journal found: the good records from the start, and the first problem after them."""

    deltas: list[StateDelta] = field(default_factory=list)
    good: int = 0  # bytes of the good records
    digests: list[bytes] = field(default_factory=list)  # theirs, in order
    tail: int = 0  # where the last good record starts
    problem: str | None = None  # None: the whole journal is good
    torn: bool = False  # the problem is the last record cut off mid-write, not damage to a complete one


def read_journal(data: bytes, config: CEDConfig) -> JournalScan:
    """The good records from the start and the first problem found after them. An empty journal is a problem: it
    holds no state."""
    view, scan, length = memoryview(data), JournalScan(), 0
    if not data:
        scan.problem = "the journal holds no record"
        return scan
    while scan.good < len(data):
        offset = scan.good
        try:
            payload, end = _payload_at(view, offset)
            delta = _decode_payload(bytes(payload), config)
            if delta.start_length != length:
                raise JournalError(f"record at byte {offset} starts at token {delta.start_length}, "
                                   f"the records before it hold {length}")
        except JournalError as error:
            scan.problem = str(error)
            scan.torn = isinstance(error, TornRecord) and not _record_after(data, offset + len(MAGIC))
            return scan
        scan.deltas.append(delta)
        scan.digests.append(bytes(view[end - _DIGEST: end]))
        scan.good, scan.tail, length = end, offset, delta.end_length
    return scan


def _record_after(data: bytes, start: int) -> bool:
    """Whether a complete record that checks out begins at or after `start`. A write cut off leaves nothing after
    it; a damaged length field that announces more than the file holds does (the records behind it): that is
    damage to answered turns, not a torn write."""
    view, offset = memoryview(data), data.find(MAGIC, start)
    while offset != -1:
        try:
            _payload_at(view, offset)
            return True
        except JournalError:
            offset = data.find(MAGIC, offset + 1)
    return False


def journal_length(file: BinaryIO) -> int:
    """The token count of a journal's complete records, read from their headers alone (digests unchecked)."""
    file.seek(0, 2)
    size, offset, length = file.tell(), 0, 0
    while offset + _HEAD <= size:
        file.seek(offset)
        head = file.read(_HEAD)
        end = offset + _HEAD + int.from_bytes(head[len(MAGIC):], "little") + _DIGEST
        if head[:len(MAGIC)] != MAGIC or end > size:
            break
        try:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
            length = int(header["__metadata__"]["start_length"]) + header["tokens"]["shape"][0]
        except (ValueError, KeyError, TypeError, IndexError):
            break
        offset = end
    return length
