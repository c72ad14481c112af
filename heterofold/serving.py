"""HeteroFold through Triton: what the two models of model_repository_heterofold/ do, importable and testable
without a server (the Triton utils module `pb` is passed in; tests pass a fake).

- `heterofold_sender`: text + sender family -> the sender's KV blocks (K before its key norm and RoPE, V after
  `v_proj`, every layer), each token's character end offset, and the sender's fingerprint.
- `heterofold` (BLS): text + map name -> the blocks (given by the client, or asked from `heterofold_sender` with
  `pb.InferenceRequest(...).exec()`), checked against the map (dtype, shape, sender fingerprint), mapped,
  installed as the receiver's cache; the receiver greedy-decodes with no prefill of its own. The response names
  the map it used (`map_used`: name, families, digest of the map's files).

Maps live in `<maps_dir>/<name>/` (what `heterofold fit` writes); the zoo in `<root>/zoo/`. Both load lazily, on
the first request that needs them, so the server starts (and serves other models) whether or not they are built.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from python_backend.triton.triton_io import Outputs, as_text, optional, required_text, respond_each, text_tensor

from . import mapfile
from .families import Capture
from .pipeline import continue_from_capture
from .zoo import ZooModel, load

PROJECT = Path(__file__).resolve().parent.parent
REPOSITORY = PROJECT / "model_repository_heterofold"
BLOCK_INPUTS = ("kv_keys", "kv_values", "token_ends", "sender_fingerprint")   # also the sender model's outputs
DEFAULTS = {"root": "auto", "maps_dir": "auto", "threads": "1", "sender_model": "heterofold_sender",
            "max_tokens": "16"}
_FAMILY = re.compile(r"^[a-z0-9_]{1,40}$")
_MAP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class BlockMismatch(ValueError):
    """KV blocks that the named map cannot read: wrong dtype, shape or sender fingerprint."""


@dataclass(frozen=True)
class Settings:
    root: Path           # artifact folder holding zoo/ (the sender and receiver models)
    maps_dir: Path       # folder of maps, one sub-folder per map name
    threads: int         # torch CPU threads of this model instance
    sender_model: str    # the model the BLS asks for KV blocks when the request brings text only
    max_tokens: int      # new tokens when the request does not say

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "Settings":
        """config.pbtxt parameters; a path left `auto` comes from HETEROFOLD_<NAME> or the default artifacts."""
        v = {k: parameters.get(k, d) for k, d in DEFAULTS.items()}
        v = {k: os.environ.get(f"HETEROFOLD_{k.upper()}", x) if x == "auto" else x for k, x in v.items()}
        resolve = lambda p: Path(p) if Path(p).is_absolute() else PROJECT / p
        root = resolve("artifacts/heterofold" if v["root"] == "auto" else v["root"])
        maps = root / "maps" if v["maps_dir"] == "auto" else resolve(v["maps_dir"])
        return cls(root, maps, int(v["threads"]), v["sender_model"], int(v["max_tokens"]))


@dataclass
class KVBlocks:
    """One sender prefill as it travels between the models."""
    keys: np.ndarray          # (L_S, T_S, Hkv_S * D_S) float32: pre-norm, pre-RoPE K per sender layer
    values: np.ndarray        # (L_S, T_S, Hkv_S * D_S) float32: V after v_proj
    token_ends: np.ndarray    # (T_S,) int64: character offset where each sender token ends
    fingerprint: dict         # mapfile.fingerprint of the sender model and tokenizer

    def capture(self) -> Capture:
        return Capture([torch.from_numpy(np.ascontiguousarray(k)) for k in self.keys],
                       [torch.from_numpy(np.ascontiguousarray(v)) for v in self.values])


class Zoo:
    """Zoo models loaded on first use and kept."""

    def __init__(self, root: Path):
        self.root, self.models = root, {}

    def get(self, family: str) -> ZooModel:
        if family not in self.models:
            self.models[family] = load(family, self.root)
        return self.models[family]


class Sender:
    """The `heterofold_sender` model: prefill on a sender family, export its KV blocks."""

    def __init__(self, settings: Settings):
        torch.set_num_threads(settings.threads)
        self.zoo = Zoo(settings.root)

    @torch.no_grad()
    def export(self, text: str, family: str) -> KVBlocks:
        if not text:
            raise ValueError("text_input is empty")
        if not _FAMILY.match(family):
            raise ValueError(f"sender {family!r}: a zoo family name (lower-case letters, digits, '_')")
        s = self.zoo.get(family)
        ids, ends = s.tok.encode(text)
        cap = s.adapter.capture(ids)
        return KVBlocks(torch.stack(cap.k).numpy(), torch.stack(cap.v).numpy(), np.asarray(ends, dtype=np.int64),
                        mapfile.fingerprint(s.adapter, s.tok))


@dataclass
class LoadedMap:
    name: str
    map: object               # fold.HeteroMap (float32)
    receiver: ZooModel
    digest: str               # sha256 of map.json + map.safetensors (first 16 hex digits)

    @property
    def sender_fp(self) -> dict:
        return self.map.meta["sender"]

    def used(self) -> str:
        """What the response says about the map (JSON)."""
        meta = self.map.meta
        return json.dumps({"name": self.name, "sender": meta["sender"]["family"],
                           "receiver": meta["receiver"]["family"], "digest": self.digest,
                           "calibration_hash": meta.get("calibration_hash")}, sort_keys=True)


def check_blocks(blocks: KVBlocks, m: LoadedMap, text: str) -> None:
    """Refuse blocks the map cannot read, naming what does not match."""
    for name, a in (("kv_keys", blocks.keys), ("kv_values", blocks.values)):
        if a.dtype != np.float32:
            raise BlockMismatch(f"{name}: dtype {a.dtype}, map {m.name!r} reads float32")
    problems = mapfile.mismatches(m.sender_fp, blocks.fingerprint, "sender")
    if problems:
        raise BlockMismatch(f"KV blocks from {blocks.fingerprint.get('family')!r} do not match map {m.name!r} "
                            f"(fitted on sender {m.sender_fp['family']!r}): " + "; ".join(problems))
    want = (m.sender_fp["layers"], len(blocks.token_ends), m.sender_fp["kv_heads"] * m.sender_fp["head_dim"])
    for name, a in (("kv_keys", blocks.keys), ("kv_values", blocks.values)):
        if a.shape != want:
            raise BlockMismatch(f"{name}: shape {list(a.shape)}, map {m.name!r} reads [layers={want[0]}, "
                                f"tokens={want[1]} (len(token_ends)), kv_heads*head_dim={want[2]}]")
    for name, a in (("kv_keys", blocks.keys), ("kv_values", blocks.values)):
        if not np.isfinite(a).all():
            raise BlockMismatch(f"{name}: holds NaN or infinite values")
    ends = blocks.token_ends
    if ends.ndim != 1 or len(ends) == 0 or ends[0] < 1 or np.any(np.diff(ends) < 0):
        raise BlockMismatch("token_ends must be a non-empty, non-decreasing list of character end offsets, "
                            "the first at least 1")
    if int(ends[-1]) != len(text):
        raise BlockMismatch(f"token_ends end at character {int(ends[-1])} but text_input has {len(text)} "
                            f"characters: the blocks were exported for another text")


class Receiver:
    """The `heterofold` BLS model's side: maps and receivers loaded on first use."""

    def __init__(self, settings: Settings):
        torch.set_num_threads(settings.threads)
        self.settings, self.zoo, self.maps = settings, Zoo(settings.root), {}

    def map(self, name: str) -> LoadedMap:
        if not _MAP_NAME.match(name or ""):
            raise ValueError(f"map name {name!r}: letters, digits, '_', '.', '-' only (a folder of {self.settings.maps_dir})")
        if name not in self.maps:
            path = self.settings.maps_dir / name
            if not (path / "map.json").is_file():
                known = sorted(p.name for p in self.settings.maps_dir.glob("*") if (p / "map.json").is_file())
                raise FileNotFoundError(f"no map {name!r} in {self.settings.maps_dir} (maps: {known or 'none'}; "
                                        f"`heterofold fit --sender S --receiver R` writes S-to-R)")
            meta = mapfile.read_meta(path)
            receiver = self.zoo.get(meta["receiver"]["family"])
            m = mapfile.load(path, None, mapfile.fingerprint(receiver.adapter, receiver.tok)).to(torch.float32)
            digest = hashlib.sha256((path / "map.json").read_bytes() + (path / "map.safetensors").read_bytes())
            self.maps[name] = LoadedMap(name, m, receiver, digest.hexdigest()[:16])
        return self.maps[name]

    def generate(self, text: str, blocks: KVBlocks, m: LoadedMap, max_tokens: int) -> tuple[list[int], str]:
        check_blocks(blocks, m, text)
        if not 1 <= max_tokens <= 4096:
            raise ValueError(f"max_tokens must be in 1..4096, got {max_tokens}")
        ids = continue_from_capture(m.map, blocks.capture(), blocks.token_ends, m.receiver, text, max_tokens)
        return ids, m.receiver.tok.decode(ids)


# ---- Triton glue: `pb` is triton_python_backend_utils (or a fake in tests) ----

# A refusal (bad input, a missing or mismatched map, an unknown zoo model) is the client's 400; anything else ours.
CLIENT_ERRORS = (ValueError, FileNotFoundError)


def _tensors(pb, outputs: Outputs | None, **values) -> list:
    """In the dtypes the model's config declares; without a config (tests of the glue alone), as built here."""
    if outputs is not None:
        return outputs.tensors(**values)
    return [text_tensor(pb, name, value) if isinstance(value, str) else pb.Tensor(name, value)
            for name, value in values.items()]


def blocks_to_tensors(pb, blocks: KVBlocks, outputs: Outputs | None = None) -> list:
    return _tensors(pb, outputs, kv_keys=np.ascontiguousarray(blocks.keys),
                    kv_values=np.ascontiguousarray(blocks.values), token_ends=blocks.token_ends.astype(np.int64),
                    sender_fingerprint=json.dumps(blocks.fingerprint, sort_keys=True))


def blocks_from(get) -> KVBlocks | None:
    """`get(name) -> ndarray | None` for the four block tensors; None when none is given."""
    arrays = {name: get(name) for name in BLOCK_INPUTS}
    given = [name for name, a in arrays.items() if a is not None]
    if not given:
        return None
    if len(given) != len(BLOCK_INPUTS):
        raise BlockMismatch(f"KV blocks come as {', '.join(BLOCK_INPUTS)} together; got only {', '.join(given)}")
    try:
        fingerprint = json.loads(as_text(arrays["sender_fingerprint"], "sender_fingerprint") or "")
    except json.JSONDecodeError as error:
        raise BlockMismatch(f"sender_fingerprint is not JSON: {error}") from None
    if not isinstance(fingerprint, dict):
        raise BlockMismatch("sender_fingerprint must be a JSON object")
    return KVBlocks(arrays["kv_keys"], arrays["kv_values"], arrays["token_ends"].reshape(-1).astype(np.int64),
                    fingerprint)


def sender_execute(pb, sender: Sender, requests, outputs: Outputs | None = None) -> list:
    def export(request):
        blocks = sender.export(required_text(pb, request, "text_input"), required_text(pb, request, "sender"))
        return pb.InferenceResponse(output_tensors=blocks_to_tensors(pb, blocks, outputs))

    return respond_each(pb, requests, export, "heterofold_sender", CLIENT_ERRORS)


def ask_sender(pb, model_name: str, text: str, family: str) -> KVBlocks:
    """BLS: run the sender model in this server on `text` and read its blocks."""
    response = pb.InferenceRequest(model_name=model_name, requested_output_names=list(BLOCK_INPUTS),
                                   inputs=[text_tensor(pb, "text_input", text), text_tensor(pb, "sender", family)]
                                   ).exec()
    if response.has_error():
        raise ValueError(f"{model_name}: {response.error().message()}")
    return blocks_from(lambda name: pb.get_output_tensor_by_name(response, name).as_numpy())


def heterofold_execute(pb, receiver: Receiver, requests, outputs: Outputs | None = None) -> list:
    def continue_text(request):
        text = required_text(pb, request, "text_input")
        m = receiver.map(required_text(pb, request, "map"))
        max_tokens = optional(pb, request, "max_tokens")
        max_tokens = receiver.settings.max_tokens if max_tokens is None else int(max_tokens.reshape(-1)[0])
        blocks = blocks_from(lambda name: optional(pb, request, name))
        if blocks is None:
            blocks = ask_sender(pb, receiver.settings.sender_model, text, m.sender_fp["family"])
        ids, out = receiver.generate(text, blocks, m, max_tokens)
        return pb.InferenceResponse(output_tensors=_tensors(pb, outputs, text_output=out,
                                                            output_ids=np.asarray(ids, dtype=np.int64),
                                                            map_used=m.used()))

    return respond_each(pb, requests, continue_text, "heterofold", CLIENT_ERRORS)
