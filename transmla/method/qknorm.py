"""Qwen3's QK-norm carried into an MLA layer (the model side: transmla.models.Qwen3MLAAttention).

Qwen3 scores s_j = rho_q,j rho_k,i <RoPE(g_q * W_q,j x), RoPE(g_k * W_k,i x')> / sqrt(d), with
rho = 1 / rms of the raw head vector. The converter builds the MLA layer of the bracket (norm weights
folded: W'_q = g_q * W_q, W'_k = g_k * W_k; adapters.attention_weights), whose query rows for head j
are Q_j W'_q,j for some per-head map Q_j [d + R, d]. Re-based on the normalised raw query
n_j = rho_q,j g_q * W_q,j x = rho_q,j W'_q,j x, the same map gives rho_q,j times the bracket's query:

    q_a_proj = W_q (raw) [h d, D],   q_a_layernorm = g_q (per head, HeadRMSNorm),   q_b_proj = blockdiag(Q_j)

Q_j is recovered from the built rows by the pseudo-inverse of W'_q,j (exact: the rows are Q_j W'_q,j
by construction; the residual is checked). The key factor rho_k,i needs the raw key: k_norm_proj = W_k.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from transmla.adapters import AttentionWeights
from transmla.method.mla import MLALayer


def rebase_query(layer: MLALayer, w: AttentionWeights, h: int, d: int) -> MLALayer:
    """The layer with its query re-based on Qwen3's normalised raw query (see the module docstring);
    a layer already in that form is returned as is."""
    if layer.q_proj is None and layer.k_norm_proj is not None:
        return layer
    if layer.q_proj is None:
        raise ValueError("QK-norm layers are built with a plain q_proj (no q_lora_rank)")
    D = w.wq.shape[1]
    rows = layer.q_proj.double().view(h, -1, D)  # [h, d + R, D]
    wf = w.wq.double().view(h, d, D)  # W'_q per head (norm weight folded)
    # Q_j = rows_j pinv(W'_j): the pseudo-inverse, since a norm weight may be exactly zero (Gemma-3-270M
    # has dims with 1 + w = 0), which zeroes rows of W'_j; those columns of Q_j then meet only zeros
    Q = rows @ torch.linalg.pinv(wf)  # [h, d + R, D] x [h, D, d] -> [h, d + R, d]
    err = (Q @ wf - rows).norm() / rows.norm()
    if err > max(1e-6, 50 * torch.finfo(layer.q_proj.dtype).eps):  # rows may come stored in the export dtype
        raise RuntimeError(f"query rows are not a per-head map of the folded query (relative residual {err:.2e})")
    return replace(layer, q_proj=None, q_a_proj=w.wq_raw.double(), q_a_bias=None, q_a_norm=w.q_norm.double(),
                   q_b_proj=torch.block_diag(*Q), k_norm_proj=w.wk_raw.double())
