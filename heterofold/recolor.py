"""Recolor: the closed-form affine initialisation, and KV Ridge, its regression counterpart. All in float64.

Recolor (seed eqs. 3-5), for paired rows X (N, dx) and Y (N, dy) with sample weights w:
    r = sqrt(mean(X^2)),  Z = X / r
    mu_Z, mu_Y, Sigma_Z, Sigma_Y, Sigma_ZY   (weighted)
    Sigma_Z^-1/2 Sigma_ZY Sigma_Y^-1/2 = U Lambda Q^T,  R = U Q^T
    A = Sigma_Z^-1/2 R Sigma_Y^1/2,  b = mu_Y - mu_Z A,   y0 = (x / r) A + b
so y0 has the receiver's mean and, when dx >= dy, its covariance exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Affine:
    """y = (x / r) A + b."""
    A: torch.Tensor   # (dx, dy)
    b: torch.Tensor   # (dy,)
    r: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.A.dtype) / self.r) @ self.A + self.b


def _sym_pow(S: torch.Tensor, p: float, eps: float) -> torch.Tensor:
    """S^p for symmetric PSD S, eigenvalues floored at eps * mean eigenvalue."""
    evals, evecs = torch.linalg.eigh(S)
    floor = eps * evals.clamp_min(0).mean().clamp_min(1e-30)
    return (evecs * evals.clamp_min(floor).pow(p)) @ evecs.T


def weighted_moments(X: torch.Tensor, w: torch.Tensor):
    w = w / w.sum()
    mu = w @ X
    Xc = X - mu
    return mu, Xc, w


def recolor(X: torch.Tensor, Y: torch.Tensor, w: torch.Tensor | None = None, eps: float = 1e-6) -> Affine:
    X, Y = X.double(), Y.double()
    w = torch.ones(X.shape[0], dtype=torch.float64) if w is None else torch.as_tensor(w, dtype=torch.float64)
    r = float(X.pow(2).mean().sqrt().clamp_min(1e-12))
    Z = X / r
    mu_z, Zc, wn = weighted_moments(Z, w)
    mu_y, Yc, _ = weighted_moments(Y, w)
    S_z = (Zc * wn[:, None]).T @ Zc
    S_y = (Yc * wn[:, None]).T @ Yc
    S_zy = (Zc * wn[:, None]).T @ Yc
    Sz_mh, Sy_mh, Sy_h = _sym_pow(S_z, -0.5, eps), _sym_pow(S_y, -0.5, eps), _sym_pow(S_y, 0.5, eps)
    U, _, Qh = torch.linalg.svd(Sz_mh @ S_zy @ Sy_mh, full_matrices=False)
    R = U @ Qh                                                          # (dx, dy) Procrustes rotation
    A = Sz_mh @ R @ Sy_h
    return Affine(A, mu_y - mu_z @ A, r)


def ridge(X: torch.Tensor, Y: torch.Tensor, lam: float = 1e-2) -> Affine:
    """KV Ridge: least squares with an L2 penalty lam * mean(diag(X^T X)), intercept unpenalised."""
    X, Y = X.double(), Y.double()
    r = float(X.pow(2).mean().sqrt().clamp_min(1e-12))
    Z = X / r
    mu_z, mu_y = Z.mean(0), Y.mean(0)
    Zc, Yc = Z - mu_z, Y - mu_y
    G = Zc.T @ Zc
    G = G + lam * G.diagonal().mean() * torch.eye(G.shape[0], dtype=G.dtype)
    A = torch.linalg.solve(G, Zc.T @ Yc)
    return Affine(A, mu_y - mu_z @ A, r)


def weighted_cov(Y: torch.Tensor, w: torch.Tensor | None = None):
    """(mean, covariance) of rows of Y under weights w; used by tests and diagnostics."""
    Y = Y.double()
    w = torch.ones(Y.shape[0], dtype=torch.float64) if w is None else torch.as_tensor(w, dtype=torch.float64)
    mu, Yc, wn = weighted_moments(Y, w)
    return mu, (Yc * wn[:, None]).T @ Yc
