// transmla::latent_decode_blocked_cpu: latent_decode_cpu over a block-transposed latent cache.
//
//   latent [B, NB, E, 16]: block k holds keys 16k .. 16k + 15, dim e of those keys contiguous (the keys in
//   the vector lanes), so one key block times one broadcast query element is one FMA for 16 keys: no
//   horizontal sum per key (the row-layout kernel's cost), and the value products read the same blocks.
//
// q [B, h, E], mask [1 or B, NB * 16] additive or none; out [B, h, rank]. Work items: sequence x group of
// heads x chunk of kChunkBlocks blocks, merged by their maxima and sums (flash-decoding). Built for
// AVX-512 (one zmm per block row) and AVX2 (two ymm), picked at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "latent_merge.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunkBlocks = 16;
constexpr int64_t kChunkKeys = kChunkBlocks * 16;
// blocks ahead that the score loop prefetches into L2 (past a sequence's end it touches the next work item's
// memory or none: a prefetch never faults). 30 layers, batch 8, 4,160 keys, 9 heads, 2 threads of an AMD
// EPYC: 12.1 ms without, 10.3 ms at 2 blocks ahead (1-8 tried; into L1 no faster than none).
constexpr int64_t kPrefetchBlocks = 2;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
namespace v512 {
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
// e^x for x <= 0 (scores minus their max): 2^n e^f, |f| <= ln2 / 2, degree-6 polynomial (rel. error ~2e-7)
inline V exp16(V x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  V p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
constexpr int PJ = 3, PC = 8;
#define GMAX 16
#include "latent_decode_blocked_impl.h"
#undef GMAX
}  // namespace v512
#pragma GCC pop_options

namespace v256 {
struct V {
  __m256 lo, hi;
};
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V set1(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float hmax(__m256 a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float reduce_add(V a) { return hsum(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(V a) { return hmax(_mm256_max_ps(a.lo, a.hi)); }
inline V exp16(V x) { return {transmla_latent::exp256(x.lo), transmla_latent::exp256(x.hi)}; }
constexpr int PJ = 2, PC = 2;
#define GMAX 6
#include "latent_decode_blocked_impl.h"
#undef GMAX
}  // namespace v256

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return yes;
}

at::Tensor latent_decode_blocked(const at::Tensor& q, const at::Tensor& latent, const c10::optional<at::Tensor>& mask,
                                 double scale, int64_t rank) {
  TORCH_CHECK(q.device().is_cpu() && latent.device().is_cpu(), "latent_decode_blocked runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && latent.scalar_type() == at::kFloat, "latent_decode_blocked takes float32");
  TORCH_CHECK(q.dim() == 3 && latent.dim() == 4 && latent.size(3) == 16 && q.size(0) == latent.size(0) &&
                  q.size(2) == latent.size(2),
              "latent_decode_blocked: q [B, h, E] and latent [B, NB, E, 16]");
  TORCH_CHECK(rank > 0 && rank <= latent.size(2), "latent_decode_blocked: 0 < rank <= E");
  const int64_t B = q.size(0), h = q.size(1), E = q.size(2), NB = latent.size(1), T = NB * 16;
  const at::Tensor lat = latent.stride(3) == 1 && latent.stride(2) == 16 && latent.stride(1) == E * 16
                             ? latent : latent.contiguous();
  const int64_t seq_stride = lat.stride(0);
  const transmla_latent::AdditiveMask mk = transmla_latent::additive_mask(mask, B, T, "latent_decode_blocked");
  // TRANSMLA_CPU_NO_AVX512=1: the AVX2 form on an AVX-512 CPU too (tests check both forms on one machine)
  const char* no512 = std::getenv("TRANSMLA_CPU_NO_AVX512");
  const bool wide = has_avx512() && !(no512 && *no512 && *no512 != '0');
  const int64_t gmax = wide ? 16 : 6;
  const int64_t groups = (h + gmax - 1) / gmax, chunks = (NB + kChunkBlocks - 1) / kChunkBlocks;
  const at::Tensor qc = q.contiguous();
  at::Tensor m = at::empty({B, groups, chunks, gmax}, q.options()), l = at::empty_like(m);
  at::Tensor acc = at::empty({B, groups, chunks, gmax, rank}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* lp = lat.data_ptr<float>();
  const float* mp = mk.data();
  float* mptr = m.data_ptr<float>();
  float* lptr = l.data_ptr<float>();
  float* aptr = acc.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * groups * chunks, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(gmax * kChunkKeys);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t c = w % chunks, g = (w / chunks) % groups, b = w / (chunks * groups);
      const int64_t k0 = c * kChunkBlocks, k1 = std::min(NB, k0 + kChunkBlocks);
      const int64_t item = (b * groups + g) * chunks + c;
      const int G = static_cast<int>(std::min<int64_t>(gmax, h - g * gmax));
      const float* qg = qp + (b * h + g * gmax) * E;
      const float* mb = mp ? mp + b * mk.stride : nullptr;
      if (wide)
        v512::run_chunk(G, qg, E, lp + b * seq_stride, k0, k1, mb, sc, rank, mptr + item * gmax, lptr + item * gmax,
                        aptr + item * gmax * rank, scores.data());
      else
        v256::run_chunk(G, qg, E, lp + b * seq_stride, k0, k1, mb, sc, rank, mptr + item * gmax, lptr + item * gmax,
                        aptr + item * gmax * rank, scores.data());
    }
  });
  return transmla_latent::merge_chunks(m, l, acc, h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transmla, m) {
  m.def("latent_decode_blocked_cpu(Tensor q, Tensor latent, Tensor? mask, float scale, int rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(transmla, CPU, m) {
  m.impl("latent_decode_blocked_cpu", &latent_decode_blocked);
}
