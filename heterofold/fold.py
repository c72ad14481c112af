"""Folding the calibrated correction into one affine map per receiver layer and role, and applying it.

Calibration learns y~ = y0 + (y0 B) G on top of y0 = (x / r) A + b. Since y~ = y0 (I + B G):
    A_final = A (I + B G),   b_final = b (I + B G)
so inference is one matmul plus bias per receiver layer and role (`HeteroMap.apply`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .families import Adapter, Capture
from .recolor import Affine


def fold(init: Affine, B: torch.Tensor | None, G: torch.Tensor | None) -> Affine:
    if B is None or G is None:
        return Affine(init.A.clone(), init.b.clone(), init.r)
    M = torch.eye(init.A.shape[1], dtype=torch.float64) + B.double() @ G.double()
    return Affine(init.A @ M, init.b @ M, init.r)


def unfolded(init: Affine, B: torch.Tensor, G: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The calibration-time form, kept as the reference the folded map is tested against."""
    y0 = init(x)
    return y0 + (y0 @ B.double()) @ G.double()


def gather(cap: Capture, role: str, layers: list[int], pairs: np.ndarray) -> torch.Tensor:
    """Sender features for receiver tokens: the paired rows of each sender layer, concatenated across heads."""
    feats = cap.k if role == "k" else cap.v
    idx = torch.as_tensor(pairs)
    return torch.cat([feats[s][idx] for s in layers], dim=-1)        # (T_R, len(layers) * d_kv_S)


@dataclass
class LayerMap:
    sender_layers: list[int]
    k: Affine
    v: Affine


@dataclass
class HeteroMap:
    """One affine map per receiver layer and role; `meta` holds the fingerprints (see mapfile.py)."""
    layers: list[LayerMap]
    meta: dict = field(default_factory=dict)

    def apply(self, cap: Capture, pairs: np.ndarray, dtype=torch.float32):
        """Sender capture + token pairs -> per-layer receiver pre-norm K and V, (T_R, d_kv_R) each."""
        ks, vs = [], []
        for lm in self.layers:
            ks.append(lm.k(gather(cap, "k", lm.sender_layers, pairs)).to(dtype))
            vs.append(lm.v(gather(cap, "v", lm.sender_layers, pairs)).to(dtype))
        return ks, vs

    def to(self, dtype) -> "HeteroMap":
        """Cast the maps once (float32 for inference)."""
        cast = lambda a: Affine(a.A.to(dtype), a.b.to(dtype), a.r)
        return HeteroMap([LayerMap(l.sender_layers, cast(l.k), cast(l.v)) for l in self.layers], self.meta)

    def n_params(self) -> int:
        return sum(a.A.numel() + a.b.numel() for l in self.layers for a in (l.k, l.v))


def transfer(mapper, cap: Capture, pairs: np.ndarray, receiver: Adapter):
    """Map a sender capture and install it as the receiver's cache (works for any mapper with `apply`)."""
    ks, vs = mapper.apply(cap, pairs)
    return receiver.build_cache(ks, vs)
