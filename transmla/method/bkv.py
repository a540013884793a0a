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

from transmla.errors import TransMLAError
from transmla.method.linalg import eigh_desc, psd_pow

# Key or value energy below this fraction of their sum is rounding noise, not something to balance.
NEGLIGIBLE_ENERGY = 1e-12


@dataclass
class JointBasis:
    """alpha and the joint basis P [(g*d - R) + g*d, r] with its captured-energy fraction.

    Optional metrics (attention-aware mode): the PCA runs on [M_k k_nope / alpha ; M_v v] and the
    up-projections undo them (M^-1), so at full rank the model is still unchanged.
    """

    alpha: float
    P: torch.Tensor
    energy: float
    metric_k: torch.Tensor | None = None
    metric_v: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.P.shape[1]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        t = {"P": self.P, "alpha": torch.tensor([self.alpha], dtype=torch.float64),
             "energy": torch.tensor([self.energy], dtype=torch.float64)}
        if self.metric_k is not None:
            t.update(metric_k=self.metric_k, metric_v=self.metric_v)
        return t

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "JointBasis":
        return cls(float(t["alpha"].item()), t["P"], float(t["energy"].item()), t.get("metric_k"), t.get("metric_v"))

    def encoder(self, wk_nope: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """Rows whose projection on P is the cached latent: [M_k W_k_nope / alpha ; M_v W_v]."""
        k = wk_nope if self.metric_k is None else self.metric_k @ wk_nope
        v = wv if self.metric_v is None else self.metric_v @ wv
        return torch.cat([k / self.alpha, v], 0)

    def decoders(self, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha M_k^-1 P_k, M_v^-1 P_v): the latent -> k_nope and latent -> v maps."""
        Pk, Pv = self.P[:n_k], self.P[n_k:]
        if self.metric_k is not None:
            Pk = torch.linalg.solve(self.metric_k, Pk)
        if self.metric_v is not None:
            Pv = torch.linalg.solve(self.metric_v, Pv)
        return self.alpha * Pk, Pv


def bkv_alpha(wk_nope: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor) -> float:
    """alpha = RMS||k_nope|| / RMS||v|| on the calibration activations; 1 when either side is negligible."""
    k2 = torch.trace(wk_nope @ xx @ wk_nope.T).item()
    v2 = torch.trace(wv @ xx @ wv.T).item()
    # NoPE keys that vanish (RoRoPE moved all key energy into RoPE) are rounding noise: balancing would
    # blow that noise up to the values' scale and spend latent rank on it. Likewise for vanishing values.
    if min(k2, v2) <= NEGLIGIBLE_ENERGY * (max(k2, 0.0) + max(v2, 0.0)):
        return 1.0
    return (k2 / v2) ** 0.5


def attention_metrics(w, Tq: torch.Tensor, rope_dim: int, xx, mu, h: int, g: int, d: int):
    """Metrics that make the joint PCA minimise what attention actually sees (our extension).

    Key error e = k_nope - k_hat changes head i's score by q_nope_i . e, so summed over heads its mean
    square is tr(Q E[e e^T]) with Q = sum_i E[q'_i q'_i^T] (queries in the rotated NoPE coordinates).
    Value error changes the output through o_proj: tr(O E[dv dv^T]), O = blockdiag_j sum_{i in j}
    W_O,i^T W_O,i. PCA of [Q^1/2 k_nope ; O^1/2 v] minimises these (up to the alpha balance).
    """
    from transmla.method.linalg import affine_second_moment
    from transmla.method.merge import kv_block

    L, R = g * d, rope_dim
    Q = torch.zeros(L - R, L - R, dtype=torch.float64)
    O = torch.zeros(L, L, dtype=torch.float64)
    for i in range(h):
        blk = kv_block(i, h, g, d)
        B = Tq[R:, blk]  # the queries' NoPE coordinates (RoRoPE's query-side basis)
        bq = None if w.bq is None else w.bq[i * d : (i + 1) * d]
        Q += B @ affine_second_moment(w.wq[i * d : (i + 1) * d], bq, xx, mu) @ B.T
        Wo = w.wo[:, i * d : (i + 1) * d]
        O[blk, blk] += Wo.T @ Wo
    return psd_pow(Q, 0.5, 1e-6), psd_pow(O, 0.5, 1e-6)


def joint_basis(
    wk_nope: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor | None, rank: int, alpha: float = 1.0,
    pca: str = "activations", metric_k: torch.Tensor | None = None, metric_v: torch.Tensor | None = None,
) -> JointBasis:
    """Top-`rank` principal directions of [k_nope/alpha ; v].

    pca="activations": eigenvectors of W E[x x^T] W^T (the paper); pca="weights": of W W^T, i.e. the left
    singular vectors of the stacked weights (MHA2MLA's joint SVD; no data).
    """
    W = JointBasis(alpha, torch.empty(0), 0.0, metric_k, metric_v).encoder(wk_nope, wv)
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
    return JointBasis(alpha=alpha, P=vecs[:, :rank].contiguous(), energy=energy, metric_k=metric_k, metric_v=metric_v)
