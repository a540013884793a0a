// The tiled decode GEMM's register kernel (transmla::tiled_linear, tiled_linear.cpp; the native decode step,
// native_decode.cpp): M rows of x against one tile of 48 output columns of a weight packed k-major
// (`cpu_kernels.tile_weight`). In an anonymous namespace: each translation unit has its own copy.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "decode_gemm.h"

namespace {

constexpr int64_t kVecs = 3;              // AVX-512 vectors per tile row
constexpr int64_t kWidth = 16 * kVecs;    // output columns per tile (48)

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
// y[m, n0 : n0 + cols] for m < M: M rows of x [M, K] (row stride K) against one packed tile [K, 48]
template <int M, bool Accumulate = false>
void tile(const float* x, int64_t K, const float* p, float* y, int64_t N, int64_t n0, int64_t cols,
          const float* bias) {
  __m512 acc[M][kVecs];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = p + k * kWidth;
    __m512 w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = _mm512_loadu_ps(pk + 16 * v);
    for (int m = 0; m < M; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_fmadd_ps(w[v], xm, acc[m][v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      float* out = y + m * N + n0 + 16 * v;
      __m512 val = _mm512_add_ps(acc[m][v], b);
      if (Accumulate) val = _mm512_add_ps(val, _mm512_maskz_loadu_ps(mask, out));
      _mm512_mask_storeu_ps(out, mask, val);
    }
  }
}
#pragma GCC pop_options


// tiles [t0, t1) of y [rows, N] (row stride N) = x [rows, K] W^T (+ bias), or y += that with Accumulate (a residual
// added in the same pass): packed [tiles, K, 48]
template <bool Accumulate = false>
inline void tile_range(const float* x, int64_t rows, int64_t K, const float* packed, const float* bias, float* y,
                       int64_t N, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kWidth, cols = std::min(kWidth, N - n0);
    const float* pt = packed + t * K * kWidth;
    // more than 8 rows re-read the tile (K x 48 floats) from cache, not from memory
    transmla_gemm::row_blocks(rows, [&](auto M, int64_t m0) {
      tile<decltype(M)::value, Accumulate>(x + m0 * K, K, pt, y + m0 * N, N, n0, cols, bias);
    });
  }
}

}  // namespace
