"""Small float64 linear-algebra helpers shared by the method modules."""

from __future__ import annotations

import torch


def affine_second_moment(W: torch.Tensor, b: torch.Tensor | None, xx: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """E[(W x + b)(W x + b)^T] from E[x x^T] = xx and E[x] = mu. [out, out]"""
    S = W @ xx @ W.T
    if b is not None:
        Wm = W @ mu
        S = S + torch.outer(Wm, b) + torch.outer(b, Wm) + torch.outer(b, b)
    return S


def affine_diag(W: torch.Tensor, b: torch.Tensor | None, xx: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """diag of affine_second_moment without forming it. [out]"""
    s = ((W @ xx) * W).sum(1)
    if b is not None:
        s = s + 2 * (W @ mu) * b + b * b
    return s


def eigh_desc(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric matrix, eigenvalues descending. Returns (values, vectors as columns)."""
    S = 0.5 * (S + S.T)
    vals, vecs = torch.linalg.eigh(S)
    order = torch.argsort(vals, descending=True)
    return vals[order], vecs[:, order]
