"""Output-aware least-squares refit of the value side: W_UV and o_proj together (an extension of paper 4.3).

BKV PCA picks the latent c to reconstruct [k_nope; v]. What the layer adds to the residual stream,
though, is

    Y(t)  = sum_i W_O,i y_i(t),   y_i(t) = sum_s p_i(t, s) v_i(s)        original (value bias excluded)
    Y'(t) = sum_i W_O,i' W_UV_i z_i(t),   z_i(t) = sum_s p'_i(t, s) c(s)  converted: p' from the MLA scores

With the latent and the scores fixed, Y' is linear in Z = [z_1; ...; z_h] through M = [W_O,1' W_UV_1, ...]
[D, h r], so the M that makes the converted layer reproduce the original one on the calibration inputs
is a linear least squares, solved from second moments (normal equations damped towards the layer as
built, M0 = [W_O,i W_UV_i]: directions the calibration latents barely span keep M0 instead of shrinking
to zero):

    M = M0 + (E[Y Z^T] - M0 E[Z Z^T]) (E[Z Z^T] + lambda I)^-1,   lambda = damp * tr(E[Z Z^T]) / (h r)

Fitting all heads jointly lets every head's latent correct every other head's error (dropped RoPE,
cut rank): a per-head fit of W_UV_i to y_i cannot. Each block M_i [D, r] is then factored back into
DeepSeek's shapes, o_proj_i [D, d] and W_UV_i [d, r]: exactly when r <= d, else the rank-d truncation
that loses least on the calibration latents. At full rank with all RoPE kept, p' = p and v_i = W_UV_i c,
so E[Y Z^T] = M0 E[Z Z^T] and M = M0: the refit is exact whatever the damping.

Heads are fitted in blocks of at most `max_dim` latent coordinates (every head in one block for the
models this project runs; a 32-head, rank-512 model gets blocks of 8 heads, each reproducing its own
heads' share of Y), so memory stays O(max_dim^2 + D h r).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transmla.method.linalg import psd_pow


def head_blocks(h: int, r: int, max_dim: int) -> list[range]:
    """Consecutive heads fitted jointly: as many as fit in max_dim latent coordinates (at least one)."""
    k = max(1, min(h, max_dim // r))
    return [range(a, min(a + k, h)) for a in range(0, h, k)]


@dataclass
class RefitMoments:
    """One block of heads, float64, over calibration tokens: zz = E[Z Z^T] [k r, k r] (Z: the block's
    attention-weighted latents stacked), yz = E[Y Z^T] [D, k r] (Y: the block's original output
    sum_{i in block} W_O,i y_i), yy = E|Y|^2."""

    heads: range
    zz: torch.Tensor
    yz: torch.Tensor
    yy: float

    def residual(self, m: torch.Tensor) -> float:
        """E|Y - M Z|^2 / E|Y|^2 for M [D, k r]."""
        err = self.yy - 2 * (m * self.yz).sum() + torch.einsum("ij,jk,ik->", m, self.zz, m)
        return float(err / self.yy) if self.yy > 0 else 0.0


def composite(o_proj: torch.Tensor, w_uv: torch.Tensor, heads: range) -> torch.Tensor:
    """M = [W_O,i W_UV_i for i in heads] [D, k r] from o_proj [D, h d] and W_UV [h, d, r]."""
    d = w_uv.shape[1]
    return torch.cat([o_proj[:, i * d : (i + 1) * d] @ w_uv[i] for i in heads], 1)


def solve_block(m: RefitMoments, damp: float, prior: torch.Tensor | None = None) -> torch.Tensor:
    """The least-squares M [D, k r] of one block, damped towards `prior` (zero if None)."""
    n = m.zz.shape[0]
    lam = damp * torch.diagonal(m.zz).sum() / n
    A = m.zz + lam * torch.eye(n, dtype=torch.float64)
    rhs = m.yz if prior is None else m.yz - prior @ m.zz
    step = torch.linalg.solve(A, rhs.T).T  # A symmetric
    return step if prior is None else prior + step


def factor_head(mi: torch.Tensor, zz_i: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj_i [D, d], W_UV_i [d, r] with o_proj_i W_UV_i = M_i [D, r] (r <= d: exact), else its rank-d
    truncation in the metric of the head's latents (zz_i = E[z_i z_i^T]): the one that loses least on them."""
    D, r = mi.shape
    o = torch.zeros(D, d, dtype=torch.float64)
    w = torch.zeros(d, r, dtype=torch.float64)
    # k = min(D, r) singular vectors at most: a model narrower than its heads (D < d) has fewer than d or r
    if r <= d:
        U, S, Vh = torch.linalg.svd(mi, full_matrices=False)  # U [D, min(D, r)]
        k = U.shape[1]
        o[:, :k], w[:k] = U, S[:, None] * Vh
        return o, w
    half, inv_half = psd_pow(zz_i, 0.5), psd_pow(zz_i, -0.5)
    U, S, Vh = torch.linalg.svd(mi @ half, full_matrices=False)
    k = min(U.shape[1], d)
    o[:, :k], w[:k] = U[:, :k], (S[:k, None] * Vh[:k]) @ inv_half
    return o, w


def refit_output(blocks: list[RefitMoments], o_proj: torch.Tensor, w_uv: torch.Tensor,
                 damp: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The refit (o_proj [D, h d], W_UV [h, d, r]) and the relative output residual before and after
    (blocks weighted by their output energy E|Y|^2: the blocks' summed residual energy over their summed
    output energy; with one block, the layer's relative residual)."""
    h, d, r = w_uv.shape
    o_new, w_new = torch.zeros_like(o_proj), torch.zeros_like(w_uv)
    before = after = total = 0.0
    for m in blocks:
        M0 = composite(o_proj, w_uv, m.heads)
        M = solve_block(m, damp, M0)
        for a, i in enumerate(m.heads):
            o_new[:, i * d : (i + 1) * d], w_new[i] = factor_head(M[:, a * r : (a + 1) * r],
                                                                  m.zz[a * r : (a + 1) * r, a * r : (a + 1) * r], d)
        before += m.residual(M0) * m.yy
        after += m.residual(composite(o_new, w_new, m.heads)) * m.yy
        total += m.yy
    total = total if total > 0 else 1.0
    return o_new, w_new, {"refit_residual_before": before / total, "refit_residual": after / total}
