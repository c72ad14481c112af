"""Recolor in closed form restores the receiver's mean and covariance on synthetic Gaussians; ridge baseline fits."""
import torch

from heterofold.recolor import recolor, ridge, weighted_cov


def _gaussians(n=4000, dx=12, dy=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, dx, generator=g, dtype=torch.float64) @ torch.randn(dx, dx, generator=g, dtype=torch.float64)
    X = 7.0 * X + 3.0
    W = torch.randn(dx, dy, generator=g, dtype=torch.float64)
    L = torch.randn(dy, dy, generator=g, dtype=torch.float64)
    Y = (X @ W) @ L * 0.1 - 2.0 + 0.5 * torch.randn(n, dy, generator=g, dtype=torch.float64)
    return X, Y


def test_recolor_restores_receiver_mean_and_covariance():
    X, Y = _gaussians()
    m = recolor(X, Y)
    mu_hat, cov_hat = weighted_cov(m(X))
    mu, cov = weighted_cov(Y)
    assert m.A.dtype == torch.float64
    assert torch.allclose(mu_hat, mu, atol=1e-8)
    assert torch.allclose(cov_hat, cov, rtol=1e-5, atol=1e-6 * cov.abs().max())


def test_recolor_weighted_moments_and_global_rms():
    X, Y = _gaussians(seed=1)
    w = torch.rand(X.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    m = recolor(X, Y, w)
    assert abs(m.r - float(X.pow(2).mean().sqrt())) < 1e-9
    mu_hat, cov_hat = weighted_cov(m(X), w)
    mu, cov = weighted_cov(Y, w)
    assert torch.allclose(mu_hat, mu, atol=1e-8) and torch.allclose(cov_hat, cov, rtol=1e-5, atol=1e-6)


def test_recolor_rotation_recovers_an_orthogonal_map():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(3000, 8, generator=g, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    m = recolor(X, X @ Q)
    assert torch.allclose(m(X), X @ Q, atol=0.05)


def test_ridge_fits_a_linear_map():
    X, _ = _gaussians(seed=4)
    W = torch.randn(X.shape[1], 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    Y = X @ W + 1.0
    assert (ridge(X, Y, lam=1e-9)(X) - Y).abs().max() < 1e-4
