"""Baselines and ablations, all fitted from the same calibration samples and applied through the same harness.

Every method returns a mapper with `.apply(sender_capture, pairs) -> (ks, vs)` and `.pairing` ("ta" | "index").
"text_reprefill" is the receiver prefilling the text itself: the quality ceiling (it *is* the native receiver).
"""
from __future__ import annotations


import numpy as np
import torch

from . import align
from .calibrate import FitConfig, Sample, _stack, fit
from .families import Adapter, Capture
from .fold import HeteroMap, LayerMap, gather

# method -> FitConfig for the affine ones; Dense Latent and text re-prefill are handled separately.
AFFINE_METHODS = {
    "heterofold": FitConfig(),
    "kv_ridge_ta": FitConfig(method="ridge", calibrate_k=False, calibrate_v=False),
    "kv_ridge_index": FitConfig(method="ridge", calibrate_k=False, calibrate_v=False, pairing="index"),
    # ablations of HeteroFold
    "abl_index_pairing": FitConfig(pairing="index"),
    "abl_single_layer": FitConfig(offsets=(0,)),
    "abl_head_local": FitConfig(head_local=True),
    "abl_recolor_only": FitConfig(calibrate_k=False, calibrate_v=False),
    "abl_recolor_k_calib": FitConfig(calibrate_v=False),
    "abl_recolor_v_calib": FitConfig(calibrate_k=False),
    "abl_ridge_kv_calib": FitConfig(method="ridge"),
    "abl_span_mapped": FitConfig(span_keys="mapped"),     # the seed's calibration setting (calibrate.py)
}
# ablations that equal a composition of two fits (K maps of the first, V maps of the second)
COMPOSED = {"abl_recolor_k_calib": ("heterofold", "abl_recolor_only"),
            "abl_recolor_v_calib": ("abl_recolor_only", "heterofold")}
TRANSFER_METHODS = ["heterofold", "kv_ridge_ta", "dense_latent_ta", "kv_ridge_index"]
ALL_METHODS = ["text_reprefill", *TRANSFER_METHODS, *[m for m in AFFINE_METHODS if m.startswith("abl_")]]


class DenseLatent(torch.nn.Module):
    """Dense Latent (+TA): per receiver layer and role a two-layer MLP from the pi(l) sender layer."""

    def __init__(self, sender_layers: list[int], d_in: int, d_out: list[int], hidden_mult: int = 2):
        super().__init__()
        self.sender_layers, self.pairing = sender_layers, "ta"
        self.nets = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d_in, hidden_mult * d), torch.nn.GELU(),
                                torch.nn.Linear(hidden_mult * d, d))
            for d in d_out for _ in ("k", "v"))
        self.register_buffer("scale", torch.ones(len(self.nets)))

    def net(self, layer: int, role: str) -> int:
        return 2 * layer + (role == "v")

    @torch.no_grad()
    def apply(self, cap: Capture, pairs: np.ndarray):
        ks, vs = [], []
        for layer, s in enumerate(self.sender_layers):
            for role, out in (("k", ks), ("v", vs)):
                i = self.net(layer, role)
                out.append(self.nets[i](gather(cap, role, [s], pairs) / self.scale[i]))
        return ks, vs


def fit_dense_latent(sender: Adapter, receiver: Adapter, train: list[Sample], held: list[Sample],
                     epochs: int = 4, lr: float = 1e-3, batch: int = 256, seed: int = 0) -> DenseLatent:
    torch.manual_seed(seed)
    s_layers = [align.proportional_layer(l, receiver.layers, sender.layers) for l in range(receiver.layers)]
    m = DenseLatent(s_layers, sender.d_kv, [receiver.d_kv] * receiver.layers)
    for layer, s in enumerate(s_layers):
        for role in ("k", "v"):
            i = m.net(layer, role)
            X, Y, _ = _stack(train, role, [s], layer)
            Xh, Yh, _ = _stack(held, role, [s], layer)
            m.scale[i] = X.pow(2).mean().sqrt().float()
            X, Y, Xh, Yh = X.float() / m.scale[i], Y.float(), Xh.float() / m.scale[i], Yh.float()
            net = m.nets[i]
            opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
            best, state = float("inf"), None
            for _ in range(epochs):
                for idx in torch.randperm(X.shape[0]).split(batch):
                    loss = (net(X[idx]) - Y[idx]).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                with torch.no_grad():
                    h = float((net(Xh) - Yh).pow(2).mean())
                if h < best:
                    best, state = h, {k: v.clone() for k, v in net.state_dict().items()}
            net.load_state_dict(state)
    return m.eval()


def compose(k_from: HeteroMap, v_from: HeteroMap) -> HeteroMap:
    """K maps of one fit with V maps of another. K and V are fitted independently per layer, so the K-only and
    V-only calibration ablations are exactly (calibrated K, Recolor V) and (Recolor K, calibrated V)."""
    layers = [LayerMap(a.sender_layers, a.k, b.v) for a, b in zip(k_from.layers, v_from.layers)]
    out = HeteroMap(layers, {})
    out.pairing = k_from.pairing
    return out


def fit_method(name: str, sender: Adapter, receiver: Adapter, train: list[Sample], held: list[Sample],
               progress: bool = False):
    """Fit one named method; returns (mapper, calibration curves)."""
    if name == "dense_latent_ta":
        return fit_dense_latent(sender, receiver, train, held), {}
    cfg = AFFINE_METHODS[name]
    m, curves = fit(sender, receiver, train, held, cfg, progress=progress)
    m = m.to(torch.float32)
    m.pairing = cfg.pairing
    return m, curves
