"""The Triton kernel of `transmla.runtime.latent_decode` (imported only where it runs: a CUDA device, or
Triton's interpreter when TRITON_INTERPRET=1 is set before triton is first imported)."""

import triton
import triton.language as tl


@triton.jit
def _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, mask_base, t0, T, stride_lt, RANK: tl.constexpr, scaling, orr, op, rm, pm,
          BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr, FULL: tl.constexpr):
    """One tile of BLOCK_T cached tokens: scores of all heads, online-softmax update, value accumulation.
    FULL: every token of the tile is in the cache (no row mask, so loads vectorise)."""
    ot = t0 + tl.arange(0, BLOCK_T)
    tm = (ot < T) | FULL
    k_c = tl.load(l_base + ot[:, None] * stride_lt + orr[None, :], mask=tm[:, None] & rm[None, :], other=0.0)
    k_p = tl.load(l_base + ot[:, None] * stride_lt + RANK + op[None, :], mask=tm[:, None] & pm[None, :], other=0.0)
    sc = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_p, tl.trans(k_p))  # [BH, BT] float32
    sc = sc * scaling
    if HAS_MASK:
        sc += tl.load(MASK + mask_base + ot, mask=tm, other=float("-inf"))[None, :]
    if not FULL:
        sc = tl.where(tm[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
    return m_new, l_i, acc


@triton.jit
def latent_decode_kernel(
    Q, L, MASK, ACC, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_lb, stride_lt, stride_mb,
    stride_ab, stride_as, stride_ah, stride_sb, stride_ss,
    H, T, scaling, RANK: tl.constexpr, ROPE: tl.constexpr,
    CHUNK_TILES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    oh = tl.arange(0, BLOCK_H)
    orr = tl.arange(0, BLOCK_R)
    op = tl.arange(0, BLOCK_P)
    hm = oh < H
    rm = orr < RANK
    pm = op < ROPE
    q_base = Q + b * stride_qb + oh[:, None] * stride_qh
    q_c = tl.load(q_base + orr[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BH, BR]
    q_p = tl.load(q_base + RANK + op[None, :], mask=hm[:, None] & pm[None, :], other=0.0)  # [BH, BP]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_R], 0.0, tl.float32)
    l_base = L + b * stride_lb
    first = s * CHUNK_TILES * BLOCK_T
    if INTERPRET:
        # Triton's interpreter (with NumPy >= 2.4) cannot loop to a run-time bound: a constant trip
        # count with the tiles past the cache skipped; the same tile function as on the GPU
        for i in range(CHUNK_TILES):
            if first + i * BLOCK_T < T:
                m_i, l_i, acc = _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, b * stride_mb, first + i * BLOCK_T, T,
                                      stride_lt, RANK, scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, False)
    else:
        # run-time trip counts (the last chunk is short): the full tiles without a branch or row mask, so
        # loads pipeline and vectorise; then the one ragged tile, if any
        n_full = tl.minimum(CHUNK_TILES, (T - first) // BLOCK_T)
        for i in range(n_full):
            m_i, l_i, acc = _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, b * stride_mb, first + i * BLOCK_T, T,
                                  stride_lt, RANK, scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, True)
        if n_full < CHUNK_TILES and first + n_full * BLOCK_T < T:
            m_i, l_i, acc = _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, b * stride_mb, first + n_full * BLOCK_T, T,
                                  stride_lt, RANK, scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, False)
    tl.store(ACC + b * stride_ab + s * stride_as + oh[:, None] * stride_ah + orr[None, :], acc,
             mask=hm[:, None] & rm[None, :])
    tl.store(M_OUT + b * stride_sb + s * stride_ss + oh, m_i, mask=hm)
    tl.store(L_OUT + b * stride_sb + s * stride_ss + oh, l_i, mask=hm)
