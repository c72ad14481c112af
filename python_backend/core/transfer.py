"""A conversation's state as bytes: what prefill hands to decode, and what the store keeps on disk.

safetensors, never pickle. The metadata carries a format version, the model config's fingerprint, the adapter
that owns the bound windows (its name, length and digest), and a sha256 of every tensor's bytes and every one of
those fields: a damaged or foreign record is refused, whichever field the damage is in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import Tensor
from safetensors import SafetensorError
from safetensors.torch import load, save

from ced.config import CEDConfig
from ced.state import AdapterState, ConversationState, GlobalKV, LocalWindow, Selection, SharedState

from .fnv import BASE
from .inputs import RequestError

FORMAT = "mol2-state-2"  # 2: the checksum covers the metadata fields too


class TransferError(ValueError):
    """State bytes that cannot be used: damaged, from another model, or of an unknown format."""


def config_fingerprint(config: CEDConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


COVERED = ("format", "config", "bound_adapter", "bound_length", "bound_digest")  # the metadata the checksum covers


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str], covered: tuple[str, ...] = COVERED) -> str:
    """sha256 over the `covered` metadata fields and every tensor (python_backend/core/delta_transfer.py covers more)."""
    digest = hashlib.sha256()
    for key in covered:  # length-prefixed, so no two different sets of fields hash alike
        value = str(metadata.get(key, "")).encode()
        digest.update(f"{key}:{len(value)}:".encode() + value)
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def encode_state(state: ConversationState, config: CEDConfig) -> bytes:
    tensors: dict[str, torch.Tensor] = {"tokens": torch.tensor(state.shared.tokens, dtype=torch.int64)}

    def put(prefix: str, **values):
        for name, value in values.items():
            if value is not None:  # dense strides: a size-1 dim may carry stride 0 (ONNX Runtime outputs do)
                tensors[f"{prefix}.{name}"] = value.clone(memory_format=torch.contiguous_format)

    for layer, window in state.shared.windows.items():
        put(f"shared.window.{layer}", k=window.k, v=window.v)
    for layer, store in state.shared.globals.items():
        put(f"shared.global.{layer}", k=store.k, v=store.v, index_keys=store.index_keys, pending=store.pending)
    put("shared", stream=state.shared.stream)
    if state.shared.selection is not None:
        put("shared.selection", idx=state.shared.selection.idx, valid=state.shared.selection.valid)
    for layer, window in state.bound.windows.items():
        put(f"bound.window.{layer}", k=window.k, v=window.v)
    metadata = {"format": FORMAT, "config": config_fingerprint(config),
                "bound_adapter": json.dumps(state.bound.adapter), "bound_length": str(state.bound.length),
                "bound_digest": json.dumps(state.bound.digest)}
    metadata["checksum"] = _checksum(tensors, metadata)
    return save(tensors, metadata=metadata)


def decode_state(data: bytes, config: CEDConfig) -> ConversationState:
    try:
        return _decode_state(data, config)
    except TransferError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as error:
        # the checksum is no secret: bytes a client made can pass it (a direct decode call is refused by its seal)
        raise TransferError(f"state bytes do not hold a conversation state: {type(error).__name__}: {error}") from None


def read_checked(data: bytes, config: CEDConfig, fmt: str, what: str,
                 covered: tuple[str, ...] = COVERED) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and metadata of a record of format `fmt` ("state", "delta": `what`, for the messages), refused
    unless readable, of that format, written for this model config and matching its checksum."""
    try:
        tensors, metadata = load(data), _read_metadata(data)
    except (SafetensorError, ValueError, UnicodeDecodeError) as error:
        raise TransferError(f"{what} bytes are not a readable safetensors record: {error}") from None
    if metadata.get("format") != fmt:
        raise TransferError(f"{what} format {metadata.get('format')!r} is not {fmt!r}")
    if metadata.get("config") != config_fingerprint(config):
        raise TransferError(f"{what} was written for another model config "
                            f"({metadata.get('config')} != {config_fingerprint(config)})")
    if metadata.get("checksum") != _checksum(tensors, metadata, covered):
        raise TransferError(f"{what} checksum does not match its contents: the record is damaged")
    return tensors, metadata


def _decode_state(data: bytes, config: CEDConfig) -> ConversationState:
    tensors, metadata = read_checked(data, config, FORMAT, "state")
    try:
        bound_adapter, bound_length = json.loads(metadata["bound_adapter"]), int(metadata["bound_length"])
        bound_digest = json.loads(metadata["bound_digest"])
    except (KeyError, ValueError) as error:
        raise TransferError(f"state metadata is incomplete: {error}") from None

    def window(prefix: str) -> LocalWindow:
        return LocalWindow(config.window, tensors.get(f"{prefix}.k"), tensors.get(f"{prefix}.v"))

    E = config.decoder_start
    stores = {layer: GlobalKV(*(tensors.get(f"shared.global.{layer}.{n}") for n in ("k", "v", "index_keys", "pending")))
              for layer in config.source_layers}
    selection = None
    if "shared.selection.idx" in tensors:
        selection = Selection(tensors["shared.selection.idx"], tensors["shared.selection.valid"])
    shared = SharedState({i: window(f"shared.window.{i}") for i in range(E + 1)}, stores,
                         tensors.get("shared.stream"), selection, tensors["tokens"].tolist())
    bound = AdapterState(bound_adapter, {i: window(f"bound.window.{i}") for i in config.adapter_bound_layers},
                         bound_length, bound_digest)
    return ConversationState(shared, bound)


def _read_metadata(data: bytes) -> dict:
    header_length = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + header_length]).get("__metadata__", {})


@dataclass
class TransferMeta:
    """The per-request row that travels with the state: [length, adapter hash]."""

    length: int
    adapter_hash: int = BASE

    def to_tensor(self) -> Tensor:
        return torch.tensor([self.length, self.adapter_hash], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values) -> "TransferMeta":
        values = [int(v) for v in values]
        if len(values) != 2:
            raise RequestError(f"transfer metadata has {len(values)} fields, expected 2")
        return cls(*values)
