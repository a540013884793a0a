// The blocked-latent decode kernel's body (transmla::latent_decode_blocked_cpu). Included twice by
// latent_decode_blocked.cpp, inside an AVX-512 and an AVX2 target region, each with
// its own vector type V (16 floats: one zmm, or two ymm) and ops: zero, set1, load, store, fma, add, sub,
// max, reduce_add, reduce_max, exp16. GMAX: heads per group (their score accumulators stay in
// registers), PJ x PC: the value products' register tile (heads x latent dims).

// Scores of G heads for blocks [k0, k1) of one sequence, scaled and masked, into sc[j * kChunkKeys + key].
template <int G>
inline void scores(const float* qg, int64_t E, const float* lat, int64_t k0, int64_t k1, const float* mask,
                   float scale, float* sc) {
  const V vscale = set1(scale);
  for (int64_t kb = k0; kb < k1; ++kb) {
    const float* blk = lat + kb * E * 16;
    V a[G];
    for (int j = 0; j < G; ++j) a[j] = zero();
    for (int64_t e = 0; e < E; ++e) {
      // row e of the block kPrefetchBlocks ahead into L2 (one 64-byte line per row of 16 floats): the
      // scores stream the cache once, and the hardware prefetcher alone left them waiting on memory
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBlocks * E * 16 + e * 16), _MM_HINT_T1);
      const V kv = load(blk + e * 16);
      for (int j = 0; j < G; ++j) a[j] = fma(set1(qg[j * E + e]), kv, a[j]);
    }
    const V madd = mask ? load(mask + kb * 16) : zero();
    for (int j = 0; j < G; ++j) store(sc + j * kChunkKeys + (kb - k0) * 16, fma(a[j], vscale, madd));
  }
}

// acc[j][c] (j in [j0, j0 + J), c in [c0, c0 + C)) = sum over the chunk's keys of p[j][key] latent[key][c]:
// keys in the lanes, one horizontal sum per output at the end
template <int J, int C>
inline void pv_tile(const float* lat, int64_t E, int64_t k0, int64_t nb, const float* sc, int j0, int64_t c0,
                    int64_t rank, float* acc) {
  V x[J][C];
  for (int u = 0; u < J; ++u)
    for (int c = 0; c < C; ++c) x[u][c] = zero();
  for (int64_t i = 0; i < nb; ++i) {
    const float* blk = lat + (k0 + i) * E * 16 + c0 * 16;
    V p[J];
    for (int u = 0; u < J; ++u) p[u] = load(sc + (j0 + u) * kChunkKeys + i * 16);
    for (int c = 0; c < C; ++c) {
      const V v = load(blk + c * 16);
      for (int u = 0; u < J; ++u) x[u][c] = fma(p[u], v, x[u][c]);
    }
  }
  for (int u = 0; u < J; ++u)
    for (int c = 0; c < C; ++c) acc[(j0 + u) * rank + c0 + c] = reduce_add(x[u][c]);
}

template <int J>
inline void pv_heads(const float* lat, int64_t E, int64_t k0, int64_t nb, const float* sc, int j0, int64_t rank,
                     float* acc) {
  int64_t c = 0;
  for (; c + PC <= rank; c += PC) pv_tile<J, PC>(lat, E, k0, nb, sc, j0, c, rank, acc);
  for (; c < rank; ++c) pv_tile<J, 1>(lat, E, k0, nb, sc, j0, c, rank, acc);
}

// One chunk of blocks [k0, k1) of one sequence for G heads (query rows qg [G, E]): the chunk's max m[j],
// sum l[j] and unnormalised output acc[j][rank].
template <int G>
void chunk(const float* qg, int64_t E, const float* lat, int64_t k0, int64_t k1, const float* mask, float scale,
           int64_t rank, float* m_out, float* l_out, float* acc, float* sc) {
  // blocks whose 16 keys are all masked (a static cache's unused capacity) are skipped: they weigh 0
  if (mask) {
    while (k1 > k0) {
      bool all_masked = true;
      for (int t = 0; t < 16 && all_masked; ++t) all_masked = std::isinf(mask[(k1 - 1) * 16 + t]) && mask[(k1 - 1) * 16 + t] < 0;
      if (!all_masked) break;
      --k1;
    }
  }
  const int64_t nb = k1 - k0;
  if (nb == 0) {
    for (int j = 0; j < G; ++j) {
      m_out[j] = -std::numeric_limits<float>::infinity();
      l_out[j] = 0.f;
      for (int64_t c = 0; c < rank; ++c) acc[j * rank + c] = 0.f;
    }
    return;
  }
  scores<G>(qg, E, lat, k0, k1, mask, scale, sc);
  for (int j = 0; j < G; ++j) {
    float* s = sc + j * kChunkKeys;
    V mx = set1(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < nb; ++i) mx = max(mx, load(s + i * 16));
    const float m = reduce_max(mx);
    const V ms = set1(std::isinf(m) ? 0.f : m);  // all keys masked: p ~ 0, not NaN
    V sum = zero();
    for (int64_t i = 0; i < nb; ++i) {
      const V p = exp16(sub(load(s + i * 16), ms));
      store(s + i * 16, p);
      sum = add(sum, p);
    }
    m_out[j] = m;
    l_out[j] = reduce_add(sum);
  }
  int j = 0;
  for (; j + PJ <= G; j += PJ) pv_heads<PJ>(lat, E, k0, nb, sc, j, rank, acc);
  for (; j < G; ++j) pv_heads<1>(lat, E, k0, nb, sc, j, rank, acc);
}

inline void run_chunk(int G, const float* qg, int64_t E, const float* lat, int64_t k0, int64_t k1, const float* mask,
                      float scale, int64_t rank, float* m_out, float* l_out, float* acc, float* sc) {
  switch (G) {
#define TRANSMLA_CASE(n) \
  case n: chunk<n>(qg, E, lat, k0, k1, mask, scale, rank, m_out, l_out, acc, sc); break;
    TRANSMLA_CASE(1) TRANSMLA_CASE(2) TRANSMLA_CASE(3) TRANSMLA_CASE(4) TRANSMLA_CASE(5) TRANSMLA_CASE(6)
#if GMAX > 6
    TRANSMLA_CASE(7) TRANSMLA_CASE(8) TRANSMLA_CASE(9) TRANSMLA_CASE(10) TRANSMLA_CASE(11) TRANSMLA_CASE(12)
    TRANSMLA_CASE(13) TRANSMLA_CASE(14) TRANSMLA_CASE(15) TRANSMLA_CASE(16)
#endif
#undef TRANSMLA_CASE
    default: break;
  }
}
