// transmla::latent_decode_cpu: one query token per sequence attending over MLA's shared latent, on CPU.
//
//   out[b, j] = sum_t p[b, j, t] latent[b, t, :rank],  p = softmax_t(scale q[b, j] . latent[b, t] + mask[b, t])
//
// q [B, h, E], latent [B, T, E] (rows may be strided: a static cache's capacity), mask [Bm, T] additive
// (Bm = 1 or B) or none. The latent is read once: each sequence's keys go in chunks of kChunk tokens
// (parallel over sequences x chunks, so one long sequence still uses every thread), a chunk's scores
// [kChunk, heads] are computed key by key (all heads' dot products from one load of the key, eight
// sums folded together at a time), its softmax runs with the heads in the vector lanes, and the values are the
// same cached rows, still in L2. Chunks are merged by their maxima and sums (flash-decoding). AVX2 + FMA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "latent_merge.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kChunk = 256;  // keys per work item

// the eight horizontal sums of a[0..7], in order
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[j], acc[j + 1] columns [c, c + 8 W) = sum_i p[i][j or j + 1] latent[t0 + i][c : c + 8 W]; W fixed at
// compile time so the accumulators stay in registers (a runtime-bounded tile spilled them: 3x slower)
template <int W>
inline void pv_tile(const float* lat, int64_t row_stride, int64_t t0, int64_t n, const float* sc, int j, int64_t c,
                    int64_t rank, float* acc) {
  __m256 x0[W], x1[W];
  for (int u = 0; u < W; ++u) x0[u] = x1[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = lat + (t0 + i) * row_stride + c;
    const __m256 p0 = _mm256_set1_ps(sc[i * 16 + j]), p1 = _mm256_set1_ps(sc[i * 16 + j + 1]);
    for (int u = 0; u < W; ++u) {
      const __m256 vv = _mm256_loadu_ps(v + 8 * u);
      x0[u] = _mm256_fmadd_ps(p0, vv, x0[u]);
      x1[u] = _mm256_fmadd_ps(p1, vv, x1[u]);
    }
  }
  for (int u = 0; u < W; ++u) {
    _mm256_storeu_ps(acc + j * rank + c + 8 * u, x0[u]);
    _mm256_storeu_ps(acc + (j + 1) * rank + c + 8 * u, x1[u]);
  }
}

// One chunk [t0, t1) of one sequence for G <= 16 heads, query rows qg [G, E] (lanes beyond G are unused).
// Writes the chunk's max m[16], sum l[16] and unnormalised output acc[16][rank].
template <int G>
void chunk(const float* qg, int64_t E, const float* lat, int64_t row_stride, int64_t t0, int64_t t1,
           const float* mask, float scale, int64_t rank, float* m_out, float* l_out, float* acc, float* sc) {
  constexpr int V = G > 8 ? 2 : 1;  // score vectors per key (8 heads each)
  const int64_t n = t1 - t0, E8 = E & ~int64_t(7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax[V];
  for (int v = 0; v < V; ++v) vmax[v] = ninf;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; ++i) {
    const float* k = lat + (t0 + i) * row_stride;
    __m256 a[8 * V];
    for (int j = 0; j < 8 * V; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t e = 0; e < E8; e += 8) {
      const __m256 kv = _mm256_loadu_ps(k + e);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j * E + e), kv, a[j]);
    }
    alignas(32) float tail[16] = {0.f};
    if (E8 < E) {
      for (int j = 0; j < G; ++j) {
        float t = 0.f;
        for (int64_t e = E8; e < E; ++e) t += qg[j * E + e] * k[e];
        tail[j] = t;
      }
    }
    const __m256 madd = mask ? _mm256_set1_ps(mask[t0 + i]) : _mm256_setzero_ps();
    for (int v = 0; v < V; ++v) {
      __m256 s = _mm256_add_ps(hsum8(a + 8 * v), _mm256_load_ps(tail + 8 * v));
      s = _mm256_add_ps(_mm256_mul_ps(s, vscale), madd);
      _mm256_storeu_ps(sc + i * 16 + 8 * v, s);
      vmax[v] = _mm256_max_ps(vmax[v], s);
    }
  }
  for (int v = 0; v < V; ++v) {
    // a lane whose keys are all masked: max -inf; subtract 0 instead so its p are ~0, not NaN
    const __m256 safe = _mm256_blendv_ps(vmax[v], _mm256_setzero_ps(), _mm256_cmp_ps(vmax[v], ninf, _CMP_EQ_OQ));
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 p = transmla_latent::exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i * 16 + 8 * v), safe));
      _mm256_storeu_ps(sc + i * 16 + 8 * v, p);
      vsum = _mm256_add_ps(vsum, p);
    }
    _mm256_storeu_ps(m_out + 8 * v, vmax[v]);
    _mm256_storeu_ps(l_out + 8 * v, vsum);
  }
  // acc[j][:] = sum_i p[i][j] latent[t0 + i][:rank], rank in tiles of 8, two heads at a time
  const int64_t R8 = rank & ~int64_t(7);
  for (int j = 0; j < G; j += 2) {
    int64_t c = 0;
    for (; c + 32 <= R8; c += 32) pv_tile<4>(lat, row_stride, t0, n, sc, j, c, rank, acc);
    for (; c < R8; c += 8) pv_tile<1>(lat, row_stride, t0, n, sc, j, c, rank, acc);
    for (int64_t c = R8; c < rank; ++c) {
      float s0 = 0.f, s1 = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = lat[(t0 + i) * row_stride + c];
        s0 += sc[i * 16 + j] * v;
        s1 += sc[i * 16 + j + 1] * v;
      }
      acc[j * rank + c] = s0;
      acc[(j + 1) * rank + c] = s1;
    }
  }
}

at::Tensor latent_decode(const at::Tensor& q, const at::Tensor& latent, const c10::optional<at::Tensor>& mask,
                         double scale, int64_t rank) {
  TORCH_CHECK(q.device().is_cpu() && latent.device().is_cpu(), "latent_decode runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && latent.scalar_type() == at::kFloat, "latent_decode takes float32");
  TORCH_CHECK(q.dim() == 3 && latent.dim() == 3 && q.size(0) == latent.size(0) && q.size(2) == latent.size(2),
              "latent_decode: q [B, h, E] and latent [B, T, E]");
  TORCH_CHECK(rank > 0 && rank <= latent.size(2), "latent_decode: 0 < rank <= E");
  const int64_t B = q.size(0), h = q.size(1), E = q.size(2), T = latent.size(1);
  const at::Tensor lat = latent.stride(2) == 1 && latent.stride(1) >= E ? latent : latent.contiguous();
  const int64_t row_stride = lat.stride(1), seq_stride = lat.stride(0);
  const transmla_latent::AdditiveMask mk = transmla_latent::additive_mask(mask, B, T, "latent_decode");
  const int64_t groups = (h + 15) / 16, chunks = std::max<int64_t>(1, (T + kChunk - 1) / kChunk);
  // groups of up to 16 heads; chunk<G> reads only its group's G query rows, so q needs no padding
  const at::Tensor qc = q.contiguous();
  at::Tensor m = at::empty({B, groups, chunks, 16}, q.options()), l = at::empty_like(m);
  at::Tensor acc = at::empty({B, groups, chunks, 16, rank}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* lp = lat.data_ptr<float>();
  const float* mp = mk.data();
  float* mptr = m.data_ptr<float>();
  float* lptr = l.data_ptr<float>();
  float* aptr = acc.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * groups * chunks, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(kChunk * 16);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t c = w % chunks, g = (w / chunks) % groups, b = w / (chunks * groups);
      const int64_t t0 = c * kChunk, t1 = std::min(T, t0 + kChunk);
      const int64_t item = (b * groups + g) * chunks + c;
      const int n_heads = static_cast<int>(std::min<int64_t>(16, h - g * 16));
      auto run = [&](auto tag) {
        chunk<decltype(tag)::value>(qp + (b * h + g * 16) * E, E, lp + b * seq_stride, row_stride, t0, t1,
                                    mp ? mp + b * mk.stride : nullptr, sc, rank, mptr + item * 16, lptr + item * 16,
                                    aptr + item * 16 * rank, scores.data());
      };
      switch (n_heads) {
        case 16: run(std::integral_constant<int, 16>{}); break;
        case 15: run(std::integral_constant<int, 15>{}); break;
        case 14: run(std::integral_constant<int, 14>{}); break;
        case 13: run(std::integral_constant<int, 13>{}); break;
        case 12: run(std::integral_constant<int, 12>{}); break;
        case 11: run(std::integral_constant<int, 11>{}); break;
        case 10: run(std::integral_constant<int, 10>{}); break;
        case 9: run(std::integral_constant<int, 9>{}); break;
        case 8: run(std::integral_constant<int, 8>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
    }
  });
  return transmla_latent::merge_chunks(m, l, acc, h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transmla, m) {
  m.def("latent_decode_cpu(Tensor q, Tensor latent, Tensor? mask, float scale, int rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(transmla, CPU, m) {
  m.impl("latent_decode_cpu", &latent_decode);
}
