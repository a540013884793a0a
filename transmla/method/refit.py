"""Output-aware least-squares refit of the value up-projections W_UV (an extension of paper 4.3).

BKV PCA picks the latent c to reconstruct [k_nope; v]. What the layer outputs, though, is per head

    y_i(t) = sum_s p_i(t, s) v_i(s)                  original:  p from the original scores
    y'_i(t) = W_UV_i sum_s p'_i(t, s) c(s) = W_UV_i z_i(t)     converted: p' from the MLA scores

so with the latent fixed, the W_UV_i that makes the converted layer reproduce the original one on
calibration inputs is a linear least squares in z, solved from second moments (damped normal equations):

    W_UV_i = E[y_i z_i^T] (E[z_i z_i^T] + lambda I)^-1,   lambda = damp * tr(E[z z^T]) / r

It corrects for the scores' error (dropped RoPE, cut rank) as well as the values'. At full rank with
all RoPE kept, p' = p and v_i = W_UV_i c exactly, so the refit returns the same W_UV (to the damping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RefitMoments:
    """zz = E[z z^T] [h, r, r], yz = E[y z^T] [h, d, r], yy = E[|y|^2] [h], float64, over calibration tokens."""

    zz: torch.Tensor
    yz: torch.Tensor
    yy: torch.Tensor

    def residual(self, w_uv: torch.Tensor) -> float:
        """E|y - W_UV z|^2 / E|y|^2 over all heads, for W_UV [h, d, r]."""
        err = self.yy - 2 * torch.einsum("hdr,hdr->h", w_uv, self.yz) + torch.einsum("hdr,hrs,hds->h", w_uv, self.zz, w_uv)
        return float(err.sum() / self.yy.sum())


def refit_values(m: RefitMoments, damp: float) -> tuple[torch.Tensor, dict]:
    """W_UV per head [h, d, r] and its relative residual on the calibration tokens."""
    r = m.zz.shape[-1]
    eye = torch.eye(r, dtype=torch.float64)
    lam = damp * torch.diagonal(m.zz, dim1=-2, dim2=-1).sum(-1) / r  # [h]
    A = m.zz + lam[:, None, None] * eye
    w_uv = torch.linalg.solve(A, m.yz.transpose(1, 2)).transpose(1, 2)  # A symmetric: (yz A^-1)^T = A^-1 yz^T
    return w_uv, {"refit_residual": m.residual(w_uv)}
