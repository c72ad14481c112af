"""Fitting a direction: calibration data, Recolor per receiver layer and role, output-aware calibration, fold.

Output-aware calibration (seed step 5) trains only a rank-16 correction y~ = y0 + (y0 B) G per receiver layer and
role against the receiver's own attention on the calibration prompts, scored (as in the seed) only at the query
positions of the prompt's question span -- the receiver queries that read the mapped cache; here the span is the
last `query_span` receiver tokens of each prompt, so every scored row reads (almost) the whole mapped context.
The span's own K/V: by default (`span_keys="native"`) the receiver's, as in the decoding protocol, where the mapped
cache holds the context and the receiver computes the tokens it then reads; `span_keys="mapped"` maps the whole
prompt, the span included (the seed's setting, where the question is part of what the sender prefilled). "native"
was chosen on a selection split of its own: the 112 held-out calibration prompts scored as the evaluation scores
(mapped context, the last 16 receiver tokens teacher-forced), where it had the lower attention KL in all six
directions and the lower next-token KL in four (heterofold/README.md). Losses per prompt, over the span's query rows:
    K: KL(P* || P^) + ||P^ V* - P* V*||^2 / d_model      (P^ from the mapped key after the receiver's norm + RoPE)
    V: ||P* V^ - O*||_F^2 / max(||O*||_F^2, eps)
with AdamW (lr 3e-4, weight decay 1e-4), gradient clipping 1, 4 epochs, keeping the checkpoint with the lowest
held-out loss (the Recolor initialisation counts as epoch 0), then folds it (fold.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from . import align
from .families import Adapter, Capture, attention
from .fold import HeteroMap, LayerMap, fold, gather
from .recolor import Affine, recolor, ridge


@dataclass
class FitConfig:
    pairing: str = "ta"                    # "ta" | "index" (ablation)
    offsets: tuple = (-4, 0, 4)            # sender layers pi(l) + offsets; (0,) is the single-layer ablation
    head_local: bool = False               # ablation: receiver KV head h reads only sender KV head h mod H_S
    calibrate_k: bool = True
    calibrate_v: bool = True
    rank: int = 16
    lr: float = 3e-4
    weight_decay: float = 1e-4
    clip: float = 1.0
    epochs: int = 4
    init_std: float = 0.02
    seed: int = 0
    method: str = "recolor"                # "recolor" | "ridge" (KV Ridge baseline)
    ridge_lambda: float = 1e-2
    ridge_layers: int = 8                  # KV Ridge reads this many sender layers nearest pi(l)
    query_span: int = 16                   # calibration scores the last N query rows of each prompt (0: all rows)
    span_keys: str = "native"              # the span's own K/V: "native" (the receiver's own) | "mapped" (the seed's)


@dataclass
class Sample:
    """One calibration prompt: both captures and the token pairing."""
    sender: Capture
    receiver: Capture            # with q
    pairs: np.ndarray            # (T_R,) sender index per receiver token
    weights: np.ndarray          # (T_R,) 1 / multiplicity


def collect(sender: Adapter, receiver: Adapter, s_tok, r_tok, texts: list[str], pairing: str = "ta",
            desc: str = "capture") -> list[Sample]:
    out = []
    for t in tqdm(texts, desc=desc, mininterval=2, leave=False):
        s_ids, s_ends = s_tok.encode(t)
        r_ids, r_ends = r_tok.encode(t)
        if len(s_ids) < 2 or len(r_ids) < 2:
            continue
        pairs = align.pair(s_ends, r_ends, pairing)
        out.append(Sample(sender.capture(s_ids), receiver.capture(r_ids, want_q=True), pairs,
                          align.multiplicity_weights(pairs)))
    return out


def with_pairing(samples: list[Sample], mode: str) -> list[Sample]:
    """Same captures, other pairing (index pairing ablation without recapturing)."""
    if mode == "ta":
        return samples
    out = []
    for s in samples:
        p = align.index_pairing(s.sender.k[0].shape[0], s.receiver.k[0].shape[0])
        out.append(Sample(s.sender, s.receiver, p, align.multiplicity_weights(p)))
    return out


def layer_plan(cfg: FitConfig, n_receiver: int, n_sender: int, layer: int) -> list[int]:
    if cfg.method == "ridge":                  # the ridge_layers sender layers closest to pi(l)
        p = align.proportional_layer(layer, n_receiver, n_sender)
        near = sorted(range(n_sender), key=lambda s: (abs(s - p), s))[: cfg.ridge_layers]
        return sorted(near)
    return align.sender_layers(layer, n_receiver, n_sender, cfg.offsets)


def _stack(samples: list[Sample], role: str, s_layers: list[int], layer: int):
    X = torch.cat([gather(s.sender, role, s_layers, s.pairs) for s in samples]).double()
    Y = torch.cat([(s.receiver.k if role == "k" else s.receiver.v)[layer] for s in samples]).double()
    w = torch.from_numpy(np.concatenate([s.weights for s in samples]))
    return X, Y, w


def _head_local_recolor(X, Y, w, n_layers: int, s_heads: int, r_heads: int, s_dim: int, r_dim: int) -> Affine:
    """Recolor fitted per receiver KV head from sender head (h mod H_S) of each sender layer; zeros elsewhere."""
    A = torch.zeros(X.shape[1], Y.shape[1], dtype=torch.float64)
    b = torch.zeros(Y.shape[1], dtype=torch.float64)
    r = float(X.pow(2).mean().sqrt())
    for h in range(r_heads):
        sh = h % s_heads
        cols = torch.cat([torch.arange(l * s_heads * s_dim + sh * s_dim, l * s_heads * s_dim + (sh + 1) * s_dim)
                          for l in range(n_layers)])
        ycols = torch.arange(h * r_dim, (h + 1) * r_dim)
        part = recolor(X[:, cols] / r, Y[:, ycols], w)
        A[cols[:, None], ycols[None, :]] = part.A / part.r
        b[ycols] = part.b
    return Affine(A, b, r)


class _Targets:
    """The receiver's native attention quantities for one layer and prompt (no grad), at the query rows of the
    scored span (the last `span` positions; all of them when span <= 0) against every key of the prompt."""

    def __init__(self, receiver: Adapter, layer: int, s: Sample, span: int = 0):
        T = s.receiver.k[layer].shape[0]
        self.off = T - span if 0 < span < T else 0
        self.pos = torch.arange(T)
        q = receiver.query_post(layer, s.receiver.q[layer], self.pos)                # (H, T, D)
        self.q = q[:, self.off:]                                                       # (H, Tq, D)
        k = receiver.key_post(layer, s.receiver.k[layer], self.pos)                 # (Hkv, T, D)
        self.v = receiver.heads_view(s.receiver.v[layer], receiver.kv_heads)       # (Hkv, T, D)
        self.group, self.scale = receiver.kv_group(), receiver.scaling(layer)
        self.p = attention(self.q, k, self.group, self.scale, self.off)             # (H, Tq, T)
        self.o = self.p @ self.v[self.group]                                          # (H, Tq, D)
        self.k_span, self.v_span = s.receiver.k[layer][self.off:], s.receiver.v[layer][self.off:]


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Mean over heads and query rows of KL(p || q) along the last axis."""
    pos = p > 0
    terms = torch.where(pos, p * (torch.log(p.clamp_min(1e-30)) - torch.log(q.clamp_min(1e-30))), 0.0)
    return terms.sum(-1).mean()


def k_loss(receiver: Adapter, layer: int, tg: _Targets, y: torch.Tensor) -> torch.Tensor:
    k_hat = receiver.key_post(layer, y, tg.pos)
    p_hat = attention(tg.q, k_hat, tg.group, tg.scale, tg.off)
    d_o = (p_hat - tg.p) @ tg.v[tg.group]                                             # (H, T, D)
    return _kl(tg.p, p_hat) + d_o.pow(2).sum((0, 2)).mean() / receiver.d_model


def v_loss(receiver: Adapter, tg: _Targets, y: torch.Tensor) -> torch.Tensor:
    o_hat = tg.p @ receiver.heads_view(y, receiver.kv_heads)[tg.group]
    return (o_hat - tg.o).pow(2).sum() / tg.o.pow(2).sum().clamp_min(1e-8)


def calibrate(receiver: Adapter, layer: int, role: str, init: Affine, train: list, held: list, cfg: FitConfig,
              gen: torch.Generator):
    """Train (B, G) for one receiver layer and role; returns (B, G, held-out loss per epoch)."""
    if not held:  # the held-out loss picks the checkpoint: without it no epoch could ever be kept
        raise ValueError("calibration needs held-out prompts (none were given)")
    d = init.A.shape[1]
    B = (torch.randn(d, cfg.rank, generator=gen) * cfg.init_std).requires_grad_(True)
    G = torch.zeros(cfg.rank, d, requires_grad=True)
    A32, b32 = init.A.float(), init.b.float()

    def loss_of(x, tg):
        y0 = (x / init.r) @ A32 + b32
        y = y0 + (y0 @ B) @ G
        if cfg.span_keys == "native" and tg.off > 0:
            y = torch.cat([y[:tg.off], tg.k_span if role == "k" else tg.v_span])
        return k_loss(receiver, layer, tg, y) if role == "k" else v_loss(receiver, tg, y)

    def held_loss():
        with torch.no_grad():
            return float(sum(loss_of(x, tg) for x, tg in held) / max(len(held), 1))

    opt = torch.optim.AdamW([B, G], lr=cfg.lr, weight_decay=cfg.weight_decay)
    best = (held_loss(), None, None)
    curve = [best[0]]
    order = torch.arange(len(train))
    for _ in range(cfg.epochs):
        for i in order[torch.randperm(len(train), generator=gen)]:
            x, tg = train[int(i)]
            loss = loss_of(x, tg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([B, G], cfg.clip)
            opt.step()
        curve.append(held_loss())
        if curve[-1] < best[0]:
            best = (curve[-1], B.detach().clone(), G.detach().clone())
    return best[1], best[2], curve


def fit(sender: Adapter, receiver: Adapter, train: list[Sample], held: list[Sample], cfg: FitConfig,
        progress: bool = True) -> tuple[HeteroMap, dict]:
    """Fit one direction from collected samples; returns the folded map and per-layer calibration curves."""
    train, held = with_pairing(train, cfg.pairing), with_pairing(held, cfg.pairing)
    receiver.model.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed)
    layers, curves = [], {}
    bar = tqdm(range(receiver.layers), desc="fit layers", disable=not progress, leave=False)
    for layer in bar:
        s_layers = layer_plan(cfg, receiver.layers, sender.layers, layer)
        maps = {}
        for role in ("k", "v"):
            X, Y, w = _stack(train, role, s_layers, layer)
            if cfg.method == "ridge":
                init = ridge(X, Y, cfg.ridge_lambda)
            elif cfg.head_local:
                init = _head_local_recolor(X, Y, w, len(s_layers), sender.kv_heads, receiver.kv_heads,
                                           sender.head_dim, receiver.head_dim)
            else:
                init = recolor(X, Y, w)
            if (cfg.calibrate_k if role == "k" else cfg.calibrate_v):
                tr = [(gather(s.sender, role, s_layers, s.pairs).float(), _Targets(receiver, layer, s, cfg.query_span)) for s in train]
                he = [(gather(s.sender, role, s_layers, s.pairs).float(), _Targets(receiver, layer, s, cfg.query_span)) for s in held]
                B, G, curve = calibrate(receiver, layer, role, init, tr, he, cfg, gen)
                curves[f"{layer}.{role}"] = curve
                maps[role] = fold(init, B, G)
            else:
                maps[role] = init
        layers.append(LayerMap(s_layers, maps["k"], maps["v"]))
    return HeteroMap(layers, {"fit": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}}), curves
