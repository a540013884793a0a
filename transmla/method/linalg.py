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


def psd_pow(S: torch.Tensor, p: float, rel_floor: float = 1e-10) -> torch.Tensor:
    """S^p of a symmetric PSD matrix, eigenvalues floored at rel_floor * the largest (p < 0 stays finite)."""
    vals, vecs = torch.linalg.eigh(0.5 * (S + S.T))
    vals = vals.clamp_min(rel_floor * vals.max().clamp_min(1e-300))
    return (vecs * vals.pow(p)) @ vecs.T


def gram(x: torch.Tensor, blocks: int = 3) -> torch.Tensor:
    """x^T x [n, n] for x [m, n], from its upper block triangle mirrored: (blocks + 1) / (2 blocks) of the
    flops of one matmul (2/3 with 3 blocks; more, smaller blocks run slower on CPU)."""
    n = x.shape[1]
    step = -(-n // blocks)
    out = torch.empty(n, n, dtype=x.dtype, device=x.device)
    for a in range(0, n, step):
        blk = x[:, a : a + step].T @ x[:, a:]
        out[a : a + step, a:] = blk
        out[a:, a : a + step] = blk.T
    return out
