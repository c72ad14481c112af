"""Folding the rank-16 correction into one affine map equals the unfolded two-step map; apply gathers pairs."""
import numpy as np
import torch

from heterofold.families import Capture
from heterofold.fold import HeteroMap, LayerMap, fold, gather, unfolded
from heterofold.recolor import Affine


def test_fold_equals_unfolded():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(24, 10, generator=g, dtype=torch.float64)
    init = Affine(A, torch.randn(10, generator=g, dtype=torch.float64), r=3.7)
    B, G = torch.randn(10, 16, generator=g) * 0.1, torch.randn(16, 10, generator=g) * 0.1
    x = torch.randn(50, 24, generator=g, dtype=torch.float64)
    assert torch.allclose(fold(init, B, G)(x), unfolded(init, B, G, x), atol=1e-10)
    assert torch.allclose(fold(init, None, None)(x), init(x))


def test_apply_concatenates_sender_layers_at_paired_tokens():
    k = [torch.arange(12.0).view(4, 3) + 100 * l for l in range(3)]
    cap = Capture(k=k, v=[t + 0.5 for t in k])
    pairs = np.array([0, 0, 2, 3, 3])
    x = gather(cap, "k", [0, 2], pairs)
    assert x.shape == (5, 6) and torch.equal(x[2], torch.cat([k[0][2], k[2][2]]))
    ident = Affine(torch.eye(6, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 1.0)
    m = HeteroMap([LayerMap([0, 2], ident, ident)])
    ks, vs = m.apply(cap, pairs)
    assert torch.equal(ks[0], k[0][pairs].float()) and torch.equal(vs[0], (k[0] + 0.5)[pairs].float())
