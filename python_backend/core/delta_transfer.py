"""The disaggregated pair's delta transfer: each server sends the other only what it lacks of a conversation's state.

A full transfer (python_backend/core/transfer.py) carries every token and every global KV / indexer-key row, so its
bytes grow with the history. But the global rows are append-only, and the two servers each hold the state of the
last turn: the decode server keeps the final state of every conversation it served (`DecodeTransfers`, an LRU
bounded by bytes, each state under a version id it mints), and the relay on the prefill server remembers, per
conversation, that version and the state it committed from it (`RelayTransfers`). So a turn sends:

  to decode:   the tokens and the global rows appended since that base (the last turn's answer and the new user
               turn), and the W-bounded parts whole (windows, pending partial blocks, stream, selection, the
               adapter-bound windows), with the base's version, counts and fingerprint;
  to prefill:  the same relative to the state decode received (the answer's tokens and rows, the windows), with
               the version decode cached the final state under; not the adapter-bound windows, which the relay's
               store never keeps (every turn rebuilds them by replay), so its commit is the same without them.

O(new tokens + W) bytes per turn, whatever the history. A delta is applied only to exactly its base (version,
token count, global entries per layer, fingerprint); decode refuses any other with an error carrying
BASE_REFUSED, and the relay sends that turn again whole (the old path). Rebuilt states are bitwise the states
a full transfer gives (tests/serving/test_delta_transfer.py).

Records are safetensors, never pickle, with the full transfer's checksum (sha256 over every tensor and every
metadata field): a damaged or foreign delta is refused with TransferError. The seals (python_backend/core/seal.py)
cover the bytes that travel, delta or full.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors.torch import save

from ced.config import CEDConfig
from ced.families import family_of_config
from ced.state import ConversationState, dense

from .settings import number_setting
from .transfer import (TransferError, _checksum, _read_metadata, config_fingerprint, decode_state, encode_state,
                       read_checked, record_delta, state_tensors)

DELTA_FORMAT = "mol2-delta-1"
TO_DECODE, TO_PREFILL = "to_decode", "to_prefill"
DELTA, FULL = "delta", "full"
# In the refusal's message, so the relay recognises it after it crossed gRPC as plain text.
BASE_REFUSED = "[delta base refused]"
DEFAULT_CACHE_MB = 256
_COVERED = ("format", "config", "direction", "base_version", "base_tokens", "base_entries", "base_fingerprint",
            "version", "bound_adapter", "bound_length", "bound_digest", "bound_windows")
_TAIL = 16  # the base's last tokens that its fingerprint covers

Count = Callable[..., None]  # Counters.count(name, value, **labels)


class BaseRefused(TransferError):
    """A delta whose base this decode server does not hold: the relay retries the turn with the full state."""

    def __init__(self, conversation_id: str, why: str):
        super().__init__(f"{BASE_REFUSED} conversation {conversation_id!r}: {why}; the prefill server must send "
                         "the turn's whole state")


# -- the codec -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """What a delta is taken against: a state's counts and fingerprint, and the version the decode server holds it
    under ("" for the state decode received, which the relay holds as it sent it)."""

    version: str
    tokens: int
    entries: tuple[tuple[str, int], ...]  # rows of each append-only tensor (by its delta name), sorted by name
    fingerprint: str


def _verbs(config: CEDConfig):
    return family_of_config(config).state_verbs()


def _entry_counts(state: ConversationState, config: CEDConfig) -> dict[str, int]:
    return {name: tensor.shape[1] for name, tensor in _verbs(config).entry_tensors(state).items()}


def base_of(state: ConversationState, config: CEDConfig, version: str = "") -> Base:
    entries = tuple(sorted(_entry_counts(state, config).items()))
    return Base(version, state.length, entries, fingerprint(state, config, state.length, entries))


def fingerprint(state: ConversationState, config: CEDConfig, tokens: int, entries: tuple[tuple[str, int], ...]) -> str:
    """A cheap check that `state` begins with a given base: the counts, the last tokens and each append-only
    tensor's last row before them. O(1) in the history; the version id does the rest."""
    digest = hashlib.sha256(json.dumps([tokens, [list(e) for e in entries],
                                        state.shared.tokens[max(0, tokens - _TAIL):tokens]]).encode())
    held = _verbs(config).entry_tensors(state)
    for name, count in entries:
        if count:
            digest.update(_bytes(held[name][:, count - 1]))
    return digest.hexdigest()[:32]


def extends(state: ConversationState, config: CEDConfig, base: Base) -> bool:
    """Whether `state` holds `base` as its prefix (by counts and fingerprint)."""
    if state.length < base.tokens:
        return False
    held = _entry_counts(state, config)
    if any(held.get(name, 0) < count for name, count in base.entries):
        return False
    return fingerprint(state, config, base.tokens, base.entries) == base.fingerprint


def encode_delta(state: ConversationState, base: Base, config: CEDConfig, direction: str, version: str = "",
                 bound_windows: bool = True) -> bytes:
    """What `state` holds beyond `base` (which it must extend), as one checksummed safetensors record: the
    family's delta since the base's tokens (transfer.state_tensors). `version`: the id the sender keeps `state`
    under (decode's reply), "" for none. Without `bound_windows` the adapter-bound windows stay behind: the state
    rebuilt has them empty, as the store gives a state back."""
    if not extends(state, config, base):
        raise TransferError(f"cannot take a delta: the state ({state.length} tokens) does not extend its base "
                            f"({base.tokens} tokens)")
    verbs, counts = _verbs(config), dict(base.entries)
    delta = verbs.delta_of(state, base.tokens)
    held = _entry_counts(state, config)
    for name, rows in delta.appended.items():  # the rows after the base's, no more, no fewer
        if counts.get(name, 0) + rows.shape[1] != held[name]:
            raise TransferError(f"cannot take a delta: {name} holds {held[name]} rows, the base "
                                f"{counts.get(name, 0)} and the delta {rows.shape[1]}")
    tensors = state_tensors(delta, verbs.bound_tensors(state) if bound_windows else None)
    metadata = {"format": DELTA_FORMAT, "config": config_fingerprint(config), "direction": direction,
                "base_version": base.version, "base_tokens": str(base.tokens),
                "base_entries": json.dumps([list(e) for e in base.entries]), "base_fingerprint": base.fingerprint,
                "version": version, "bound_adapter": json.dumps(state.bound.adapter),
                "bound_length": str(state.bound.length if bound_windows else 0),
                "bound_digest": json.dumps(state.bound.digest if bound_windows else None),
                "bound_windows": "1" if bound_windows else "0"}
    metadata["checksum"] = _checksum(tensors, metadata, _COVERED)
    return save(tensors, metadata=metadata)


@dataclass
class Delta:
    """A decoded delta record, checked whole (format, model config, checksum, direction)."""

    base: Base
    version: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def is_delta(data: bytes) -> bool:
    """Whether transfer bytes are a delta record (else a full state, or bytes neither decoder accepts)."""
    try:
        return _read_metadata(data).get("format") == DELTA_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def decode_delta(data: bytes, config: CEDConfig, direction: str) -> Delta:
    tensors, metadata = read_checked(data, config, DELTA_FORMAT, "delta", _COVERED)
    if metadata.get("direction") != direction:
        raise TransferError(f"a {metadata.get('direction')} delta was sent {direction}")
    try:
        entries = tuple((str(name), int(count)) for name, count in json.loads(metadata["base_entries"]))
        base = Base(metadata["base_version"], int(metadata["base_tokens"]), entries, metadata["base_fingerprint"])
    except (KeyError, ValueError, TypeError) as error:
        raise TransferError(f"delta metadata is incomplete: {error}") from None
    return Delta(base, metadata.get("version", ""), tensors, metadata)


def rebuild(base_state: ConversationState, delta: Delta, config: CEDConfig) -> ConversationState:
    """`base_state` (which must be exactly the delta's base) extended by the delta: a new state, bitwise what a full
    transfer of the sender's state decodes to. `base_state` is left as it was."""
    try:
        return _rebuild(base_state, delta, config)
    except TransferError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as error:
        raise TransferError(f"delta does not fit its base: {type(error).__name__}: {error}") from None


def _rebuild(base_state: ConversationState, delta: Delta, config: CEDConfig) -> ConversationState:
    verbs, metadata = _verbs(config), delta.metadata
    if base_state.length != delta.base.tokens:
        raise TransferError(f"the base holds {base_state.length} tokens, the delta is on {delta.base.tokens}")
    bound_adapter = json.loads(metadata["bound_adapter"])
    changes, bound = record_delta(delta.tensors, delta.base.tokens, bound_adapter)
    state = verbs.copy_state(base_state)  # new containers: the base's tensors are never written
    verbs.apply_delta(state, changes)
    verbs.set_bound(state, bound, bound_adapter, int(metadata["bound_length"]), json.loads(metadata["bound_digest"]))
    return state


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _state_nbytes(state: ConversationState) -> int:
    return sum(state.nbytes().values())


def _own_copy(state: ConversationState, config: CEDConfig) -> ConversationState:
    """A copy in host memory, each tensor dense and its own (the cache's bytes are then what it counts)."""
    verbs = _verbs(config)
    copy = verbs.empty_state(config)
    verbs.apply_delta(copy, verbs.delta_of(state, 0))  # a delta's tensors are dense copies
    bound = {name: dense(tensor.detach().cpu()) for name, tensor in verbs.bound_tensors(state).items()}
    verbs.set_bound(copy, bound, state.bound.adapter, state.bound.length, state.bound.digest)
    return copy


def no_count(*args, **labels) -> None:
    pass


# -- the decode server's side --------------------------------------------------------------------------------


def cache_bytes(value: str = "auto") -> int:
    """The decode cache's limit: the `transfer_cache_mb` config parameter, else MOL2_TRANSFER_CACHE_MB, else 256."""
    return int(number_setting("transfer_cache_mb", value, str(DEFAULT_CACHE_MB), "megabytes") * 2**20)


@dataclass
class Received:
    """A turn's state as decode received it: the state, and its base for the reply (taken before the engine runs,
    which may change the state in place)."""

    state: ConversationState
    base: Base


@dataclass
class _Cached:
    base: Base  # its version is the id the relay names
    state: ConversationState
    nbytes: int


class DecodeTransfers:
    """The decode server's copy of each conversation's last final state, LRU under `limit_bytes` (0: none kept, so
    every turn goes whole). One entry per conversation, replaced at the end of each turn."""

    def __init__(self, config: CEDConfig, limit_bytes: int = DEFAULT_CACHE_MB * 2**20, count: Count = no_count):
        self.config, self.limit_bytes, self.count = config, limit_bytes, count
        self._states: OrderedDict[str, _Cached] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def receive(self, conversation_id: str, data: bytes) -> Received:
        """The state the transfer bytes carry: a full state, or a delta on the cached state it names (else
        BaseRefused, before anything else is done)."""
        if not is_delta(data):
            self.count("mol2_transfer_bytes_total", len(data), direction=TO_DECODE, kind=FULL)
            state = decode_state(data, self.config)
        else:
            self.count("mol2_transfer_bytes_total", len(data), direction=TO_DECODE, kind=DELTA)
            delta = decode_delta(data, self.config, TO_DECODE)
            with self._lock:
                cached = self._states.get(conversation_id)
                if cached is not None:
                    self._states.move_to_end(conversation_id)
            if cached is None or cached.base != delta.base:
                reason = "missing" if cached is None else "mismatch"
                self.count("mol2_transfer_fallbacks_total", reason=reason)
                raise BaseRefused(conversation_id, "this decode server holds no state of it" if cached is None else
                                  f"it holds version {cached.base.version} ({cached.base.tokens} tokens), the delta "
                                  f"is on version {delta.base.version} ({delta.base.tokens} tokens)")
            state = rebuild(cached.state, delta, self.config)
        return Received(state, base_of(state, self.config))

    def reply(self, conversation_id: str, received: Received, final: ConversationState, end: bool) -> bytes:
        """The bytes that hand `final` back to the relay: a delta on the state decode received, or the full state
        if the engine did not keep that state as its prefix. The final state is cached for the next turn (not at
        the end of the conversation)."""
        self.forget(conversation_id)
        kept = None if end else _own_copy(final, self.config)
        if kept is not None and _state_nbytes(kept) > self.limit_bytes:
            kept = None  # larger than the whole cache: its next turn goes whole
        version = "" if kept is None else secrets.token_hex(8)  # "": the relay sends the next turn whole
        if extends(final, self.config, received.base):
            data = encode_delta(final, received.base, self.config, TO_PREFILL, version, bound_windows=False)
            kind = DELTA
        else:  # never seen: the engine's global rows are append-only; the full state is right whatever happened
            data, kind, kept = encode_state(final, self.config), FULL, None
        self.count("mol2_transfer_bytes_total", len(data), direction=TO_PREFILL, kind=kind)
        if kept is not None:
            self._keep(conversation_id, _Cached(base_of(kept, self.config, version), kept, _state_nbytes(kept)))
        return data

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            dropped = self._states.pop(conversation_id, None)
            if dropped is not None:
                self._bytes -= dropped.nbytes

    def _keep(self, conversation_id: str, cached: _Cached) -> None:
        with self._lock:
            self._states[conversation_id] = cached
            self._bytes += cached.nbytes
            while self._bytes > self.limit_bytes:  # least recently used first
                _, dropped = self._states.popitem(last=False)
                self._bytes -= dropped.nbytes


# -- the relay's side (the prefill server) -----------------------------------------------------------------------


@dataclass
class Outgoing:
    """One turn's transfer to decode: what is sent (`data`, a delta or the full state) and what the relay keeps
    to rebuild the answer's state (`full`, and the state decoded from it, once needed)."""

    conversation_id: str
    kind: str
    data: bytes
    full: bytes
    state: ConversationState | None = None


class RelayTransfers:
    """What the relay knows of the decode server's cache: per conversation, the base (version, counts,
    fingerprint) of the state it committed after decode's last answer, and how long the journal was then. At
    most `max_conversations` are remembered (least recently used forgotten: their next turn goes whole)."""

    def __init__(self, store, config: CEDConfig, count: Count = no_count, max_conversations: int = 65536):
        self.store, self.config, self.count, self.max_conversations = store, config, count, max_conversations
        self._bases: OrderedDict[str, Base] = OrderedDict()
        self._lock = threading.Lock()

    def outgoing(self, conversation_id: str, full: bytes) -> Outgoing:
        """A delta on the base decode holds, if the relay knows one and the store still begins with it; else the
        full state."""
        with self._lock:
            base = self._bases.get(conversation_id)
        if base is None:
            return self._send(Outgoing(conversation_id, FULL, full, full))
        # The journal as this process committed it (no other process wrote it since), and the turn's state built
        # on it: else the store's history is not the one decode holds (another relay's turn, a repaired journal).
        state = decode_state(full, self.config)
        if self.store.written_length(conversation_id) != base.tokens or not extends(state, self.config, base):
            self.forget(conversation_id)
            self.count("mol2_transfer_fallbacks_total", reason="store_changed")
            return self._send(Outgoing(conversation_id, FULL, full, full, state))
        delta = encode_delta(state, base, self.config, TO_DECODE)
        return self._send(Outgoing(conversation_id, DELTA, delta, full, state))

    def whole(self, sent: Outgoing) -> Outgoing:
        """The same turn again, full: decode refused the delta's base."""
        self.forget(sent.conversation_id)
        self.count("mol2_transfer_fallbacks_total", reason="refused")
        return self._send(Outgoing(sent.conversation_id, FULL, sent.full, sent.full, sent.state))

    def incoming(self, sent: Outgoing, data: bytes) -> tuple[ConversationState, str]:
        """The turn's final state from decode's answer (a delta on what was sent, or a full state) and the
        version decode cached it under ("": none)."""
        if not is_delta(data):
            self.count("mol2_transfer_bytes_total", len(data), direction=TO_PREFILL, kind=FULL)
            return decode_state(data, self.config), ""
        self.count("mol2_transfer_bytes_total", len(data), direction=TO_PREFILL, kind=DELTA)
        delta = decode_delta(data, self.config, TO_PREFILL)
        if sent.state is None:
            sent.state = decode_state(sent.full, self.config)
        if delta.base != base_of(sent.state, self.config):
            raise TransferError(f"the decode server answered conversation {sent.conversation_id!r} with a delta on "
                                f"another state ({delta.base.tokens} tokens; {sent.state.length} were sent)")
        return rebuild(sent.state, delta, self.config), delta.version

    def remember(self, conversation_id: str, version: str, state: ConversationState) -> None:
        """After a commit: decode holds `state` under `version` (none: forget)."""
        if not version:
            self.forget(conversation_id)
            return
        base = base_of(state, self.config, version)
        with self._lock:
            self._bases[conversation_id] = base
            self._bases.move_to_end(conversation_id)
            while len(self._bases) > self.max_conversations:
                self._bases.popitem(last=False)

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            self._bases.pop(conversation_id, None)

    def _send(self, outgoing: Outgoing) -> Outgoing:
        self.count("mol2_transfer_bytes_total", len(outgoing.data), direction=TO_DECODE, kind=outgoing.kind)
        return outgoing
