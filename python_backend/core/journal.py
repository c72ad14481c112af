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

from safetensors import SafetensorError
from safetensors.torch import load, save

from ced.config import CEDConfig
from ced.families import family_of_config
from ced.state import DeltaError, StateDelta

from .transfer import config_fingerprint, record_delta, state_tensors

MAGIC = b"MJR1"
FORMAT = "mol2-journal-1"
_HEAD = len(MAGIC) + 8  # magic + payload length
DIGEST_SIZE = _DIGEST = 16  # a record ends with its digest


# A delta that does not fit the state it is applied to (ced/state.py raises it), or a record that cannot be read.
JournalError = DeltaError


class TornRecord(JournalError):
    """The file ends inside a record: a write cut off (a kill mid-append), or a damaged length field."""


# -- records ------------------------------------------------------------------------------------------------


def encode_record(delta: StateDelta, config: CEDConfig) -> bytes:
    tensors = state_tensors(delta)
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
    delta, bound = record_delta(tensors, start_length, bound_adapter)
    if bound:
        raise JournalError(f"record at token {start_length} holds adapter-bound windows, which a journal never keeps")
    expected = family_of_config(config).state_verbs().new_entries(config, start_length, delta.end_length)
    for name, tensor in delta.appended.items():
        part = name.rsplit(".", 1)[0]
        if part not in expected:
            raise JournalError(f"record at token {start_length} holds {name!r}, a part this model does not have")
        if tensor.shape[1] != expected[part]:  # anything else would put every later entry at the wrong place
            raise JournalError(f"record at token {start_length} holds {tensor.shape[1]} global entries of layer "
                               f"{part.split('.')[1]}, its {len(tokens)} tokens complete {expected[part]}")
    missing = [part for part, count in expected.items() if count and not any(n.startswith(part + ".")
                                                                              for n in delta.appended)]
    if missing:
        part = missing[0]
        raise JournalError(f"record at token {start_length} holds 0 global entries of layer {part.split('.')[1]}, "
                           f"its {len(tokens)} tokens complete {expected[part]}")
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
