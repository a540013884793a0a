"""Assemble one DeepSeek-V3 MLA attention layer from a GQA layer (paper sections 4.1-4.3).

Per query head i of KV group j (shapes for h heads, g KV heads, head dim d, RoPE dim R, rank r):

    merged key (4.1):     k = W_K x + b_K in R^{g d};  head i reads block j through E_j (exact)
    RoRoPE (4.2):         k' = T k;  q'_i = T_q E_j q_i,  T_q = T^-T (rot.query_T);  q'_i . k' = q_i . k_j
                          (T is orthogonal, T_q = T, in the key metric and for MHA2MLA; the query metric's
                          T is not)
    split:                k'[:R] keeps RoPE (shared MQA key k_pe), k'[R:] = k_nope drops it
    BKV (4.3):            c = P^T [M_k k_nope / alpha ; M_v v]  ->  k_nope ~ D_k c,  v ~ D_v c
                          (D_k, D_v = basis.decoders: alpha M_k^-1 P_k and M_v^-1 P_v; M = I unless
                          attention-aware)

DeepSeek form per head: q_i = [q_nope_i (d) ; q_rope_i (R)], k_i = [W_UK_i c (d) ; k_pe (R)],
v_i = W_UV_i c (d), with

    q_nope_i = W_Q,i x                        W_UK_i = (T_q[R:, jd:(j+1)d])^T D_k     [d, r]
    q_rope_i = T_q[:R, jd:(j+1)d] W_Q,i x     W_UV_i = D_v[jd:(j+1)d]                 [d, r]

(query biases transformed alike), so q_nope_i . W_UK_i c = (T_q[R:] E_j q_i) . (D_k c) ~ q'_i[R:] . k'[R:].
The original softmax scale d^-1/2 is folded into the queries (DeepSeek divides by sqrt(d + R)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from transmla.adapters import AttentionWeights
from transmla.method.bkv import JointBasis
from transmla.config import LATENT_NORM_EPS
from transmla.errors import TransMLAError
from transmla.method.linalg import affine_second_moment, eigh_desc
from transmla.method.merge import kv_block
from transmla.method.rope import interleave_index
from transmla.method.rorope import KeyRotation

# transformers' DeepseekV3 builds kv_a_layernorm / q_a_layernorm with its default eps (config.
# LATENT_NORM_EPS), not config.rms_norm_eps. The identity construction depends on that eps, so it is
# a parameter (`latent_norm_eps`) and recorded in the export; changing the decoder norms' eps instead
# is not an option (measured on SmolLM2: 1e-5 -> 1e-6 moves log-probs by up to 0.035).
# Norm identity: tokens with up to NORM_HEADROOM x the average latent energy stay within
# NORM_TOL relative error.
NORM_HEADROOM = 1e4
NORM_TOL = 1e-6


@dataclass
class MLALayer:
    """Weights of one DeepseekV3Attention, float64 (cast() once built), in nn.Linear [out, in] layout.

    Exactly one of q_proj / (q_a_proj, q_b_proj) is set. RoPE rows are interleaved.
    """

    kv_a_proj: torch.Tensor  # [r + R, D]
    kv_a_bias: torch.Tensor | None  # [r + R]
    kv_a_norm: torch.Tensor  # [r]
    kv_b_proj: torch.Tensor  # [h (d + d), r]
    o_proj: torch.Tensor  # [D, h d]
    o_bias: torch.Tensor | None  # [D]
    q_proj: torch.Tensor | None = None  # [h (d + R), D]
    q_a_proj: torch.Tensor | None = None  # [rq, D]
    q_a_bias: torch.Tensor | None = None  # [rq]
    q_a_norm: torch.Tensor | None = None  # [rq]
    q_b_proj: torch.Tensor | None = None  # [h (d + R), rq]
    k_norm_proj: torch.Tensor | None = None  # [g d, D]: Qwen3's raw key projection, for its per-head key norm

    def state_dict(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        names = {
            "kv_a_proj_with_mqa.weight": self.kv_a_proj, "kv_a_proj_with_mqa.bias": self.kv_a_bias,
            "kv_a_layernorm.weight": self.kv_a_norm, "kv_b_proj.weight": self.kv_b_proj,
            "o_proj.weight": self.o_proj, "o_proj.bias": self.o_bias, "q_proj.weight": self.q_proj,
            "q_a_proj.weight": self.q_a_proj, "q_a_proj.bias": self.q_a_bias,
            "q_a_layernorm.weight": self.q_a_norm, "q_b_proj.weight": self.q_b_proj,
            "k_norm_proj.weight": self.k_norm_proj,
        }
        return {prefix + k: v.to(dtype).contiguous() for k, v in names.items() if v is not None}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """float64 weights under DeepseekV3Attention's parameter names."""
        return self.state_dict("", torch.float64)

    def cast(self, dtype: torch.dtype) -> "MLALayer":
        """The same layer stored in `dtype` (the export's: a converter holds every built layer until export)."""
        return MLALayer.from_tensors(self.state_dict("", dtype))

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "MLALayer":
        g = t.get
        return cls(kv_a_proj=t["kv_a_proj_with_mqa.weight"], kv_a_bias=g("kv_a_proj_with_mqa.bias"),
                   kv_a_norm=t["kv_a_layernorm.weight"], kv_b_proj=t["kv_b_proj.weight"], o_proj=t["o_proj.weight"],
                   o_bias=g("o_proj.bias"), q_proj=g("q_proj.weight"), q_a_proj=g("q_a_proj.weight"),
                   q_a_bias=g("q_a_proj.bias"), q_a_norm=g("q_a_layernorm.weight"), q_b_proj=g("q_b_proj.weight"),
                   k_norm_proj=g("k_norm_proj.weight"))


def head_value_bias(bv: torch.Tensor | None, h: int, g: int, d: int) -> torch.Tensor | None:
    """The value bias per query head [h*d] (each KV head's bias repeated for its h/g query heads)."""
    return None if bv is None else bv.view(g, d).repeat_interleave(h // g, 0).reshape(-1)


def norm_identity_scale(mean_sq: float, eps: float) -> float:
    """s such that RMSNorm(c / s) * s sqrt(eps) = c to NORM_TOL for mean(c^2) up to HEADROOM x mean_sq.

    RMSNorm(y) = y / sqrt(mean(y^2) + eps) * w; with mean(y^2) << eps it is y / sqrt(eps) * w, and the
    relative error is about mean(c^2) / (2 s^2 eps).
    """
    mean_sq = max(mean_sq, 1e-12)
    return math.sqrt(NORM_HEADROOM * mean_sq / (2 * NORM_TOL * eps))


def query_weights(w: AttentionWeights, rot: KeyRotation, h: int, g: int, d: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head [q_nope (d) ; q_rope (R, interleaved)] rows with the softmax scale folded in. [h (d+R), D]"""
    R = rot.rope_dim
    D = w.wq.shape[1]
    scale = math.sqrt((d + R) / d)  # DeepSeek divides by sqrt(d + R); the original by sqrt(d)
    il = interleave_index(R)
    wq = w.wq.view(h, d, D)
    bq = None if w.bq is None else w.bq.view(h, d)
    rows, biases = [], []
    for i in range(h):
        Tj = rot.query_T[:R, kv_block(i, h, g, d)][il]  # [R, d]: RoRoPE of the merged key, seen by head i
        rows += [wq[i], Tj @ wq[i]]
        if bq is not None:
            biases += [bq[i], Tj @ bq[i]]
    W = torch.cat(rows, 0) * scale
    b = torch.cat(biases, 0) * scale if bq is not None else None
    return W, b


def check_q_lora_rank(q_lora_rank: int | None, h: int, d: int, R: int, D: int, q_bias: bool = False) -> None:
    """Refuse a q_lora_rank the queries cannot have: they are [h (d + R), D], so rank <= min of those;
    with a query bias they are affine, q = [W_Q, b_Q] [x; 1], and D + 1 is their (exact) full rank.
    Shapes alone decide it, so the converter checks it from the config before any weight is read
    (q_bias from the config too: GQASpec.q_bias)."""
    top = min(h * (d + R), D + 1 if q_bias else D)
    if q_lora_rank is not None and not 1 <= q_lora_rank <= top:
        raise TransMLAError(
            f"q_lora_rank={q_lora_rank} is impossible: the queries span at most {top} dims.",
            f"choose --q-lora-rank between 1 and {top}, or leave it unset.",
        )


def check_finite(layer: MLALayer, step: str = "built") -> None:
    """Refuse a layer with inf/NaN weights: exported, it would give NaN logits with no error at all."""
    bad = [k for k, v in layer.to_tensors().items() if not torch.isfinite(v).all()]
    if bad:
        raise TransMLAError(
            f"The {step} MLA attention has non-finite weights ({', '.join(bad)}): the source weights or the "
            "calibration statistics are degenerate (inf/NaN in the model, or a projection the data never excites).",
            "check the source model for inf/NaN weights, calibrate on more data (--cal-nsamples), "
            "or use --rorope-metric key.",
        )


def build_mla_layer(
    w: AttentionWeights,
    rot: KeyRotation,
    basis: JointBasis,
    h: int,
    g: int,
    d: int,
    xx: torch.Tensor,
    mu: torch.Tensor,
    q_lora_rank: int | None = None,
    norm_eps: float = LATENT_NORM_EPS,
) -> tuple[MLALayer, dict]:
    """The MLA layer for (rotation, joint basis); xx, mu = E[x x^T], E[x] size the norm identities
    and the low-rank Q. Returns the layer and diagnostics."""
    R, L, D = rot.rope_dim, g * d, w.wq.shape[1]
    T, P, alpha = rot.T, basis.P, basis.alpha
    r = P.shape[1]
    Pk, Pv = basis.decoders(L - R)  # alpha P_k, P_v (metrics undone in attention-aware mode)
    il = interleave_index(R)

    # kv_a_proj_with_mqa = [latent rows (r) ; k_pe rows (R)]
    latent = P.T @ basis.encoder(T[R:] @ w.wk, w.wv)  # [r, D]
    k_pe = (T[:R] @ w.wk)[il]
    k_pe_bias = None if w.bk is None else (T[:R] @ w.bk)[il]  # the NoPE part of b_K is dropped (softmax-invariant)
    s_kv = norm_identity_scale(torch.trace(latent @ xx @ latent.T).item() / r, norm_eps)
    kv_a = torch.cat([latent / s_kv, k_pe], 0)
    kv_norm = torch.full((r,), s_kv * math.sqrt(norm_eps), dtype=torch.float64)

    # kv_b_proj rows per head: [W_UK_i (d) ; W_UV_i (d)]
    kv_b = []
    for i in range(h):
        blk = kv_block(i, h, g, d)
        kv_b += [rot.query_T[R:, blk].T @ Pk, Pv[blk]]
    kv_b = torch.cat(kv_b, 0)

    # o_proj; the value bias moves here: sum_t a_t (v_t + b) = sum_t a_t v_t + b
    o_bias = w.bo.clone() if w.bo is not None else None
    if w.bv is not None:
        o_bias = (o_bias if o_bias is not None else 0) + w.wo @ head_value_bias(w.bv, h, g, d)

    wq, bq = query_weights(w, rot, h, g, d)
    has_bias = any(b is not None for b in (w.bq, w.bk, w.bv, w.bo))
    layer = MLALayer(
        kv_a_proj=kv_a,
        kv_a_bias=(torch.cat([torch.zeros(r, dtype=torch.float64), k_pe_bias if k_pe_bias is not None else torch.zeros(R, dtype=torch.float64)]) if has_bias else None),
        kv_a_norm=kv_norm,
        kv_b_proj=kv_b,
        o_proj=w.wo.clone(),
        o_bias=(o_bias if o_bias is not None else torch.zeros(D, dtype=torch.float64)) if has_bias else None,
    )
    diag = {"alpha": alpha, "kv_norm_scale": s_kv, "rope_energy": rot.energy, "kv_energy": basis.energy}
    if q_lora_rank is None and bq is None:
        layer.q_proj = wq
        check_finite(layer)
        return layer, diag

    if q_lora_rank is None:
        # DeepSeek's q_proj has no bias. Carry it exactly through a (D+1)-rank "low-rank" Q whose extra
        # latent coordinate is the constant 1 (made by q_a_proj's bias): q = [W_Q, b_Q] [x; 1].
        qa = torch.cat([torch.eye(D, dtype=torch.float64), torch.zeros(1, D, dtype=torch.float64)], 0)
        qa_b = torch.cat([torch.zeros(D, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
        qb = torch.cat([wq, bq[:, None]], 1)
        mean_sq = (torch.trace(xx).item() + 1.0) / (D + 1)
        diag["q_bias_carrier"] = True
    else:
        check_q_lora_rank(q_lora_rank, h, d, R, D, q_bias=bq is not None)
        Sq = affine_second_moment(wq, bq, xx, mu)
        vals, vecs = eigh_desc(Sq)
        if q_lora_rank >= min(h * d, D + int(bq is not None)):
            # every direction the queries use is kept: the weights' column space, exactly. The calibration's
            # eigenvectors span it only with at least D tokens; with fewer, Sq is rank-deficient and its null-space
            # eigenvectors are arbitrary, dropping directions the weights use (a wrong model with q_energy 1.0).
            A = wq if bq is None else torch.cat([wq, bq[:, None]], 1)
            Pq = torch.linalg.svd(A, full_matrices=False)[0][:, :q_lora_rank]
        else:
            Pq = vecs[:, :q_lora_rank]
        qa, qa_b, qb = Pq.T @ wq, (Pq.T @ bq if bq is not None else None), Pq
        kept = torch.einsum("ik,ij,jk->", Pq, Sq, Pq).clamp_min(0).item()  # trace(Pq^T Sq Pq)
        mean_sq = kept / q_lora_rank
        diag["q_energy"] = kept / vals.clamp_min(0).sum().item()
    s_q = norm_identity_scale(mean_sq, norm_eps)
    layer.q_a_proj = qa / s_q
    layer.q_a_bias = (qa_b / s_q if qa_b is not None else torch.zeros(qa.shape[0], dtype=torch.float64)) if has_bias else None
    layer.q_a_norm = torch.full((qa.shape[0],), s_q * math.sqrt(norm_eps), dtype=torch.float64)
    layer.q_b_proj = qb
    diag["q_norm_scale"] = s_q
    check_finite(layer)
    return layer, diag
