"""The Triton kernel of `transmla.runtime.latent_decode` (imported only where it runs: a CUDA device, or
Triton's interpreter when TRITON_INTERPRET=1 is set before triton is first imported)."""

import triton
import triton.language as tl


@triton.jit
def _load_tile(l_base, t0, T, stride_lt, RANK: tl.constexpr, orr, op, rm, pm, BLOCK_T: tl.constexpr, FULL: tl.constexpr):
    """BLOCK_T cached tokens from t0: (c_kv [BT, BR], k_pe [BT, BP], in-cache row mask [BT]).
    FULL: every token of the tile is in the cache (no row mask, so loads vectorise)."""
    ot = t0 + tl.arange(0, BLOCK_T)
    tm = (ot < T) | FULL
    k_c = tl.load(l_base + ot[:, None] * stride_lt + orr[None, :], mask=tm[:, None] & rm[None, :], other=0.0)
    k_p = tl.load(l_base + ot[:, None] * stride_lt + RANK + op[None, :], mask=tm[:, None] & pm[None, :], other=0.0)
    return k_c, k_p, ot, tm


@triton.jit
def _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, mask_base, t0, T, stride_lt, RANK: tl.constexpr, scaling, orr, op, rm, pm,
          BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr, FULL: tl.constexpr):
    """One tile, heads as the rows of both products: scores [BH, BT] = q k^T, acc [BH, BR] += p c_kv.
    For a large batch (many programs): the dots' M dimension is the head block."""
    k_c, k_p, ot, tm = _load_tile(l_base, t0, T, stride_lt, RANK, orr, op, rm, pm, BLOCK_T, FULL)
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
def _tile_swapped(q_cT, q_pT, m_i, l_i, accT, l_base, MASK, mask_base, t0, T, stride_lt, RANK: tl.constexpr, scaling, orr, op,
                  rm, pm, BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr, FULL: tl.constexpr):
    """The same tile with the products transposed: scores^T [BT, BH] = k q^T, acc^T [BR, BH] += c_kv^T p^T.
    For a small batch (few, long programs): the dots' M dimension is the token tile / the rank (>= 64),
    which the tensor cores' large-M instructions want, instead of 32 heads."""
    k_c, k_p, ot, tm = _load_tile(l_base, t0, T, stride_lt, RANK, orr, op, rm, pm, BLOCK_T, FULL)
    sc = tl.dot(k_c, q_cT) + tl.dot(k_p, q_pT)  # [BT, BH] float32
    sc = sc * scaling
    if HAS_MASK:
        sc += tl.load(MASK + mask_base + ot, mask=tm, other=float("-inf"))[:, None]
    if not FULL:
        sc = tl.where(tm[:, None], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    accT = accT * alpha[None, :] + tl.dot(tl.trans(k_c), p.to(k_c.dtype))
    return m_new, l_i, accT


@triton.jit
def _step(q_c, q_p, m_i, l_i, acc, l_base, MASK, mask_base, t0, T, stride_lt, RANK: tl.constexpr, scaling, orr, op, rm, pm,
          BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr, FULL: tl.constexpr, SWAP: tl.constexpr):
    """One tile in the product form SWAP picks (resolved at compile time)."""
    if SWAP:
        return _tile_swapped(q_c, q_p, m_i, l_i, acc, l_base, MASK, mask_base, t0, T, stride_lt, RANK, scaling, orr, op,
                             rm, pm, BLOCK_T, HAS_MASK, FULL)
    else:
        return _tile(q_c, q_p, m_i, l_i, acc, l_base, MASK, mask_base, t0, T, stride_lt, RANK, scaling, orr, op, rm, pm,
                     BLOCK_T, HAS_MASK, FULL)


@triton.jit
def latent_decode_kernel(
    Q, L, MASK, ACC, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_lb, stride_lt, stride_mb,
    stride_ab, stride_as, stride_ah, stride_sb, stride_ss, stride_sh,
    H, T, scaling, chunk_tiles, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_MASK: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr,
    CHUNK_TILES_INTERP: tl.constexpr,
):
    """Program (b, s): the chunk of `chunk_tiles` tiles from s * chunk_tiles * BLOCK_T of sequence b.
    chunk_tiles is a run-time argument (one compiled variant for every length and split count, so a
    CUDA graph or torch.compile sees one kernel); Triton's interpreter cannot loop to a run-time bound,
    so there the same count comes as the constexpr CHUNK_TILES_INTERP."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    oh = tl.arange(0, BLOCK_H)
    orr = tl.arange(0, BLOCK_R)
    op = tl.arange(0, BLOCK_P)
    hm = oh < H
    rm = orr < RANK
    pm = op < ROPE
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    l_base = L + b.to(tl.int64) * stride_lb  # int64: B x capacity x (r + R) passes 2^31 at large batches
    mb = b * stride_mb
    q_base = Q + b * stride_qb
    if INTERPRET:
        first = s * CHUNK_TILES_INTERP * BLOCK_T
    else:
        first = s * chunk_tiles * BLOCK_T
    # The two product forms hold q and acc transposed to each other; the tile loop is the same.
    if SWAP:
        q_c = tl.load(q_base + oh[None, :] * stride_qh + orr[:, None], mask=hm[None, :] & rm[:, None], other=0.0)  # [BR, BH]
        q_p = tl.load(q_base + oh[None, :] * stride_qh + RANK + op[:, None], mask=hm[None, :] & pm[:, None], other=0.0)
        acc = tl.full([BLOCK_R, BLOCK_H], 0.0, tl.float32)
    else:
        q_c = tl.load(q_base + oh[:, None] * stride_qh + orr[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BH, BR]
        q_p = tl.load(q_base + oh[:, None] * stride_qh + RANK + op[None, :], mask=hm[:, None] & pm[None, :], other=0.0)
        acc = tl.full([BLOCK_H, BLOCK_R], 0.0, tl.float32)
    if INTERPRET:
        for i in range(CHUNK_TILES_INTERP):
            if first + i * BLOCK_T < T:
                m_i, l_i, acc = _step(q_c, q_p, m_i, l_i, acc, l_base, MASK, mb, first + i * BLOCK_T, T, stride_lt, RANK,
                                      scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, False, SWAP)
    else:
        # the full tiles without a branch or row mask (loads pipeline and vectorise), then the one ragged tile
        n_full = tl.minimum(chunk_tiles, (T - first) // BLOCK_T)
        for i in range(n_full):
            m_i, l_i, acc = _step(q_c, q_p, m_i, l_i, acc, l_base, MASK, mb, first + i * BLOCK_T, T, stride_lt, RANK,
                                  scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, True, SWAP)
        if n_full < chunk_tiles and first + n_full * BLOCK_T < T:
            m_i, l_i, acc = _step(q_c, q_p, m_i, l_i, acc, l_base, MASK, mb, first + n_full * BLOCK_T, T, stride_lt, RANK,
                                  scaling, orr, op, rm, pm, BLOCK_T, HAS_MASK, False, SWAP)
    if SWAP:
        tl.store(ACC + b * stride_ab + s * stride_as + oh[None, :] * stride_ah + orr[:, None], acc,
                 mask=hm[None, :] & rm[:, None])
    else:
        tl.store(ACC + b * stride_ab + s * stride_as + oh[:, None] * stride_ah + orr[None, :], acc,
                 mask=hm[:, None] & rm[None, :])
    tl.store(M_OUT + b * stride_sb + s * stride_ss + oh * stride_sh, m_i, mask=hm)
    tl.store(L_OUT + b * stride_sb + s * stride_ss + oh * stride_sh, l_i, mask=hm)
