"""A conversation's state as bytes: what prefill hands to decode (and a decode server back to its relay).

One codec for every state's bytes, whatever the model family: a state is its family's delta since token 0
(`delta_of`: the append-only `entries.*` and the W-bounded parts, by name; ced/state.py), plus its adapter-bound
windows (`bound_tensors`) where a transfer carries them; the journal's records (journal.py) and the delta transfer
(delta_transfer.py) are the same tensors with their own framing. safetensors, never pickle. The metadata carries
a format version, the model config's fingerprint, the adapter that owns the bound windows (its name, length and
digest), and a sha256 of every tensor's bytes and every one of those fields: a damaged or foreign record is
refused, whichever field the damage is in.
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
from ced.families import family_of_config
from ced.state import ConversationState, StateDelta, dense, split_delta

from .fnv import BASE
from .inputs import RequestError

FORMAT = "mol2-state-3"  # 2: the checksum covers the metadata fields too; 3: any family, its delta's names


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


def state_tensors(delta: StateDelta, bound: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """A delta's tensors (and adapter-bound windows) as a record holds them: tokens, then every part by name, each
    dense (a size-1 dim may carry stride 0: ONNX Runtime outputs do)."""
    parts = {**delta.appended, **delta.replaced, **(bound or {})}
    return {"tokens": torch.tensor(delta.tokens, dtype=torch.int64),
            **{name: dense(tensor) for name, tensor in parts.items()}}


def record_delta(tensors: dict[str, Tensor], start_length: int, bound_adapter: str | None
                 ) -> tuple[StateDelta, dict[str, Tensor]]:
    """`state_tensors` read back: the delta and the adapter-bound windows."""
    tensors = dict(tensors)
    tokens = tensors.pop("tokens").tolist()
    bound = {name: tensors.pop(name) for name in [n for n in tensors if n.startswith("bound.")]}
    return StateDelta(start_length, tokens, *split_delta(tensors), bound_adapter=bound_adapter), bound


def encode_state(state: ConversationState, config: CEDConfig) -> bytes:
    verbs = family_of_config(config).state_verbs()
    tensors = state_tensors(verbs.delta_of(state, 0), verbs.bound_tensors(state))
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
    verbs = family_of_config(config).state_verbs()
    delta, bound = record_delta(tensors, 0, bound_adapter)
    state = verbs.empty_state(config)
    verbs.apply_delta(state, delta)
    verbs.set_bound(state, bound, bound_adapter, bound_length, bound_digest)
    return state


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
