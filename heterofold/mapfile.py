"""The map artifact: `<dir>/map.safetensors` (A, b per receiver layer and role) + `<dir>/map.json` (fingerprints).

The JSON names the sender and the receiver by fingerprint (family, config hash, tokenizer hash, parameter
count) and the calibration data by hash. Loading checks both models against it and refuses a map fitted for
another pair, naming each field that differs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .fold import HeteroMap, LayerMap
from .recolor import Affine

FORMAT = "heterofold-map/1"
_VOLATILE = {"transformers_version", "_attn_implementation", "_attn_implementation_internal", "torch_dtype",
             "dtype", "architectures", "_name_or_path", "use_cache", "output_attentions"}


class MapMismatch(ValueError):
    """A map was loaded for a sender/receiver pair it was not fitted on."""


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(adapter, tok) -> dict:
    return {
        "family": adapter.spec.name,
        "config_hash": config_hash(adapter.model.config),
        "tokenizer_hash": tok.fingerprint(),
        "n_params": int(sum(p.numel() for p in adapter.model.parameters())),
        "layers": adapter.layers,
        "kv_heads": adapter.kv_heads,
        "head_dim": adapter.head_dim,
    }


def save(m: HeteroMap, path: Path, sender_fp: dict, receiver_fp: dict, calib_hash: str, extra: dict | None = None):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, layers = {}, []
    for i, lm in enumerate(m.layers):
        for role in ("k", "v"):
            a = getattr(lm, role)
            tensors[f"layers.{i}.{role}.A"] = (a.A / a.r).float().contiguous()     # the 1/r scale folded in
            tensors[f"layers.{i}.{role}.b"] = a.b.float().contiguous()
        layers.append({"sender_layers": lm.sender_layers})
    save_file(tensors, path / "map.safetensors")
    meta = {"format": FORMAT, "sender": sender_fp, "receiver": receiver_fp, "calibration_hash": calib_hash,
            "layers": layers, "n_params": m.n_params(), **m.meta, **(extra or {})}
    (path / "map.json").write_text(json.dumps(meta, indent=1))


def mismatches(expected: dict, got: dict, role: str) -> list[str]:
    return [f"{role} {k}: map has {expected.get(k)!r}, model has {got.get(k)!r}"
            for k in ("family", "config_hash", "tokenizer_hash", "n_params", "layers", "kv_heads", "head_dim")
            if expected.get(k) != got.get(k)]


def read_meta(path: Path) -> dict:
    """A map's map.json, checked to be one: a damaged or foreign file is refused, named."""
    path = Path(path)
    try:
        meta = json.loads((path / "map.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MapMismatch(f"{path / 'map.json'} is damaged (not JSON: {error}): fit the map again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise MapMismatch(f"{path}: format {got!r}, expected {FORMAT!r}")
    return meta


def load(path: Path, sender_fp: dict | None = None, receiver_fp: dict | None = None) -> HeteroMap:
    """Load a map; when fingerprints are given, refuse a map fitted for another pair."""
    path = Path(path)
    meta = read_meta(path)
    problems = []
    if sender_fp is not None:
        problems += mismatches(meta["sender"], sender_fp, "sender")
    if receiver_fp is not None:
        problems += mismatches(meta["receiver"], receiver_fp, "receiver")
    if problems:
        raise MapMismatch(f"map {path} was fitted for {meta['sender']['family']} -> {meta['receiver']['family']} "
                          f"and does not match this pair: " + "; ".join(problems))
    try:
        t = load_file(path / "map.safetensors")
    except (SafetensorError, OSError) as error:
        raise MapMismatch(f"{path / 'map.safetensors'} cannot be read ({error}): fit the map again") from None
    missing = [f"layers.{i}.{role}.{part}" for i in range(len(meta["layers"])) for role in "kv" for part in "Ab"
               if f"layers.{i}.{role}.{part}" not in t]
    if missing:
        raise MapMismatch(f"{path / 'map.safetensors'} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}: "
                          "fit the map again")
    layers = [LayerMap(l["sender_layers"],
                       Affine(t[f"layers.{i}.k.A"], t[f"layers.{i}.k.b"], 1.0),
                       Affine(t[f"layers.{i}.v.A"], t[f"layers.{i}.v.b"], 1.0))
              for i, l in enumerate(meta["layers"])]
    return HeteroMap(layers, meta)
