"""RoRoPE and FreqFold (paper section 4.2, appendix C).

After the KV heads are merged into one latent key of width g*d (section 4.1), the RoPE term of every
score is a sum over frequencies l of products of 2g-dim (real, imag) vectors. Any orthogonal U_l
applied identically to the real parts [k_{i*d+l}]_i and the imaginary parts [k_{i*d+l+d/2}]_i of
query and key leaves q.k unchanged (eq. 6). RoRoPE picks U_l by PCA of the keys, using ONE rotation for
the real and imaginary parts: eigenvectors of Sigma_re + Sigma_im. FreqFold M treats M adjacent
frequencies as one and runs the PCA on g*M-dim vectors jointly, so a few components gather more of the
positional energy.

The result is an orthogonal basis change T of the merged key, [g*d, g*d]. Its first R rows are the
coordinates that keep RoPE, laid out as a rotate_half RoPE head of dim R (R/2 real rows, then R/2
imaginary rows; pair p rotates at original frequency plan[p]); the other g*d - R rows are NoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transmla.config import FREQFOLDS
from transmla.errors import TransMLAError
from transmla.method.linalg import eigh_desc, psd_pow

# A frequency group's query energy (trace of its moment) at or below this fraction of all the queries'
# is treated as none (rounding noise of exactly zero queries is ~1e-16; real models' groups are far above).
NEGLIGIBLE_QUERY = 1e-12


@dataclass
class KeyRotation:
    """An orthogonal change of basis of the merged key and which rows keep RoPE.

    T: [g*d, g*d] float64, rows = new coordinates of the key (first 2*len(plan) are RoPE, rotate_half layout).
    plan: original frequency index of each RoPE pair.
    energy: fraction of the key's RoPE-carrying energy (or score energy, in the query metric) in the kept rows.
    Tq: the queries' change of basis, T^-T (None: T is orthogonal and is its own); q' . k' = q . k.
    """

    T: torch.Tensor
    plan: list[int]
    energy: float
    Tq: torch.Tensor | None = None

    @property
    def query_T(self) -> torch.Tensor:
        return self.T if self.Tq is None else self.Tq

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.plan)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        t = {"T": self.T, "plan": torch.tensor(self.plan, dtype=torch.int64),
             "energy": torch.tensor([self.energy], dtype=torch.float64)}
        return t if self.Tq is None else {**t, "Tq": self.Tq}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "KeyRotation":
        Tq = t.get("Tq")
        return cls(t["T"].to(torch.float64), t["plan"].tolist(), float(t["energy"].item()),
                   None if Tq is None else Tq.to(torch.float64))


def _pair_indices(g: int, d: int, freqs: range) -> tuple[list[int], list[int]]:
    """Merged-key indices of the real and imaginary parts of `freqs` across all g heads (rotate_half)."""
    half = d // 2
    re = [i * d + l for l in freqs for i in range(g)]
    return re, [k + half for k in re]


def validate_freqfold(freqfold: int, d: int) -> None:
    if freqfold not in FREQFOLDS or (d // 2) % freqfold:
        raise TransMLAError(
            f"freqfold={freqfold} is not valid for head dim {d}.",
            f"use one of {[m for m in FREQFOLDS if (d // 2) % m == 0]}.",
        )


def rorope(cov_k: torch.Tensor, g: int, d: int, plan: list[int], freqfold: int = 1,
           cov_q: torch.Tensor | None = None) -> KeyRotation:
    """RoRoPE (+FreqFold) rotation from the merged-key second moment cov_k = E[k k^T], [g*d, g*d].

    Each frequency group (M = freqfold adjacent frequencies) gets one PCA over its g*M real and g*M
    imaginary coordinates. Its top components go to the RoPE pairs whose planned frequency falls in the
    group (in order); the rest become NoPE coordinates.

    cov_q (our extension): the merged queries' second moment sum_i E[(E_j q_i)(E_j q_i)^T]. The PCA then
    runs in the query metric: keys Q^1/2 k, queries Q^-1/2 q (scores unchanged), so components are ranked
    by the score energy they carry, E[(q'_c k'_c)^2] ~ lambda_c, not by key energy: RoPE stays where
    the queries read position. Each component is then balanced (key and query variances equal). A group
    whose query energy is negligible (NEGLIGIBLE_QUERY of the total) gets the key-metric PCA instead.
    """
    validate_freqfold(freqfold, d)
    half, L, R = d // 2, g * d, 2 * len(plan)
    T = torch.zeros(L, L, dtype=torch.float64)
    Tq = None if cov_q is None else torch.zeros(L, L, dtype=torch.float64)
    # A group whose queries carry (next to) nothing has no score energy to rank by, and Q^-1/2 of a
    # (near-)zero Qf is floored relative to Qf's own top eigenvalue, i.e. to ~0: ~1e154 entries, inf/NaN
    # weights. Such a group takes the key metric's PCA instead (queries read nothing from it either way).
    q_scale = 0.0 if cov_q is None else torch.trace(cov_q).item()
    nope_row = R
    kept, total = 0.0, 0.0
    for j in range(half // freqfold):
        freqs = range(j * freqfold, (j + 1) * freqfold)
        re, im = _pair_indices(g, d, freqs)
        Kf = cov_k[re][:, re] + cov_k[im][:, im]
        Qf = None if cov_q is None else cov_q[re][:, re] + cov_q[im][:, im]
        key_pca = Qf is None or torch.trace(Qf).item() <= NEGLIGIBLE_QUERY * q_scale
        if key_pca:
            vals, U = eigh_desc(Kf)
            A = B = U.T  # rows: key / query coordinates of each component
        else:
            Qh, Qih = psd_pow(Qf, 0.5, 1e-8), psd_pow(Qf, -0.5, 1e-8)
            vals, U = eigh_desc(Qh @ Kf @ Qh)
            gamma = vals.clamp_min(1e-30 * vals[0].clamp_min(1e-30)).pow(-0.25)  # balance key/query variance
            A, B = gamma[:, None] * (U.T @ Qh), (U.T @ Qih) / gamma[:, None]
        slots = [p for p, l in enumerate(plan) if l in freqs]
        if len(slots) > A.shape[0]:
            raise TransMLAError(
                f"{len(slots)} RoPE pairs planned in a frequency group with only {U.shape[1]} components.",
                "lower qk_rope_head_dim or raise freqfold.",
            )
        if freqfold > 1 and len(slots) == A.shape[0]:
            # every coordinate of the group keeps RoPE (e.g. one KV head with all M frequencies planned): the exact
            # basis is none at all, each coordinate at its own frequency; the PCA would mix M frequencies into
            # components that each rotate at one of them, losing a layer that converts exactly
            seen: dict[int, int] = {}
            order = []
            for p in slots:  # coordinate (head i, frequency l) is row (l - first) * g + i of the group (re)
                i = seen[plan[p]] = seen.get(plan[p], -1) + 1
                order.append((plan[p] - freqs.start) * g + i)
            A = B = torch.eye(A.shape[0], dtype=torch.float64)[order]
        for a in range(A.shape[0]):
            if a < len(slots):
                r_re, r_im = slots[a], R // 2 + slots[a]
            else:
                r_re, r_im = nope_row, nope_row + 1
                nope_row += 2
            T[r_re, re] = A[a]
            T[r_im, im] = A[a]
            if Tq is not None:
                Tq[r_re, re] = B[a]
                Tq[r_im, im] = B[a]
        if key_pca and q_scale > 0:
            continue  # key energies are not score energies: a query-less group adds ~0 score energy
        kept += vals[: len(slots)].clamp_min(0).sum().item()
        total += vals.clamp_min(0).sum().item()
    assert nope_row == L
    return KeyRotation(T=T, plan=list(plan), energy=kept / total if total > 0 else 1.0, Tq=Tq)

