// The blocked-latent attention's vector kernels (v512::run_chunk, v256::run_chunk) and their constants, shared by
// transmla::latent_decode_blocked_cpu (latent_decode_blocked.cpp) and the native decode step (native_decode.cpp).
// In an anonymous namespace: each translation unit has its own copy.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "latent_merge.h"

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

}  // namespace
