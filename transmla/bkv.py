"""Balanced-KV joint low-rank approximation (paper section 4.3, appendix D).

After RoRoPE, the NoPE keys k_nope = T[R:] W_K x and the values v = W_V x are compressed together:
PCA of [k_nope / alpha ; v] gives an orthonormal basis P [(g*d - R) + g*d, r]; the cached latent is
c = P^T [k_nope / alpha ; v] and the up-projections read k_nope ~ alpha * P_k c, v ~ P_v c.

alpha balances the two norms so the PCA is not dominated by the (larger) keys. The paper defines it
as E||k_nope|| / E||v||; we use the ratio of root-mean-square norms, which is exact from the
second moments (so no second forward pass is needed once the rotation is known).

Biases are never part of the latent: a NoPE key bias adds the same amount to every score of a query
(softmax ignores it) and a value bias passes through attention unchanged (weights sum to one), so it
moves to the output projection - both exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import TransMLAError
from .linalg import eigh_desc


@dataclass
class JointBasis:
    """alpha and the joint basis P [(g*d - R) + g*d, r] with its captured-energy fraction."""

    alpha: float
    P: torch.Tensor
    energy: float

    @property
    def rank(self) -> int:
        return self.P.shape[1]


def bkv_alpha(wk_nope: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor) -> float:
    """alpha = RMS||k_nope|| / RMS||v|| on the calibration activations."""
    k2 = torch.trace(wk_nope @ xx @ wk_nope.T).item()
    v2 = torch.trace(wv @ xx @ wv.T).item()
    if v2 <= 0:
        return 1.0
    return (max(k2, 0.0) / v2) ** 0.5 if k2 > 0 else 1.0


def joint_basis(
    wk_nope: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor | None, rank: int, alpha: float = 1.0, pca: str = "activations"
) -> JointBasis:
    """Top-`rank` principal directions of [k_nope/alpha ; v].

    pca="activations": eigenvectors of W E[x x^T] W^T (the paper); pca="weights": of W W^T, i.e. the left
    singular vectors of the stacked weights (MHA2MLA's joint SVD; no data).
    """
    W = torch.cat([wk_nope / alpha, wv], 0)
    if rank < 1 or rank > W.shape[0]:
        raise TransMLAError(
            f"kv_lora_rank={rank} is impossible here: the NoPE keys and values span at most {W.shape[0]} dims.",
            f"choose kv_lora_rank between 1 and {W.shape[0]}.",
        )
    if pca == "activations":
        if xx is None:
            raise TransMLAError("Activation-based PCA needs calibration statistics.", "run calibration first.")
        S = W @ xx @ W.T
    elif pca == "weights":
        S = W @ W.T
    else:
        raise TransMLAError(f"Unknown pca mode {pca!r}.", "use 'activations' or 'weights'.")
    vals, vecs = eigh_desc(S)
    total = vals.clamp_min(0).sum().item()
    energy = vals[:rank].clamp_min(0).sum().item() / total if total > 0 else 1.0
    return JointBasis(alpha=alpha, P=vecs[:, :rank].contiguous(), energy=energy)
