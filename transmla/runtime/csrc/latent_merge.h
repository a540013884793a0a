// Shared by the latent decode kernels (latent_decode.cpp, latent_decode_blocked.cpp): the AVX2 exp, the
// additive mask's checks and the flash-decoding merge of per-chunk softmax partials.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace transmla_latent {

// e^x for x in [-88, 0] (callers clamp): 2^n e^f, |f| <= ln2 / 2, degree-6 polynomial (rel. error ~2e-7)
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// An optional additive mask [1 or B, T] as contiguous float32 and its per-sequence stride (0: shared).
struct AdditiveMask {
  at::Tensor values;
  int64_t stride = 0;
  const float* data() const { return values.defined() ? values.data_ptr<float>() : nullptr; }
};

inline AdditiveMask additive_mask(const c10::optional<at::Tensor>& mask, int64_t B, int64_t T, const char* what) {
  AdditiveMask out;
  if (mask.has_value() && mask->defined()) {
    out.values = mask->to(at::kFloat).contiguous();
    TORCH_CHECK(out.values.numel() == T || out.values.numel() == B * T, what, ": mask [1 or B, T] (additive)");
    out.stride = out.values.numel() == T ? 0 : T;
  }
  return out;
}

// Merge per-chunk partials, rows [r0, r1) of out [B, h, rank] (row = b h + j): out = sum_c e^(m_c - M) acc_c /
// sum_c e^(m_c - M) l_c. m, l [B, groups, chunks, lanes]; acc [B, groups, chunks, lanes, rank]; head j is lane
// j % lanes of group j / lanes. A head whose keys are all masked (every m_c = -inf) gets zeros, not NaN.
inline void merge_rows(const float* mptr, const float* lptr, const float* aptr, int64_t h, int64_t groups,
                       int64_t chunks, int64_t lanes, int64_t rank, float* op, int64_t r0, int64_t r1) {
  for (int64_t bj = r0; bj < r1; ++bj) {
    const int64_t b = bj / h, j = bj % h, g = j / lanes, lane = j % lanes;
    const int64_t base = (b * groups + g) * chunks;
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) M = std::max(M, mptr[(base + c) * lanes + lane]);
    const float Ms = std::isinf(M) ? 0.f : M;
    float L = 0.f;
    float* o = op + bj * rank;
    for (int64_t d = 0; d < rank; ++d) o[d] = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float mc = mptr[(base + c) * lanes + lane];
      const float wgt = std::isinf(mc) ? 0.f : std::exp(mc - Ms);
      if (wgt == 0.f) continue;
      L += wgt * lptr[(base + c) * lanes + lane];
      const float* a = aptr + ((base + c) * lanes + lane) * rank;
      for (int64_t d = 0; d < rank; ++d) o[d] += wgt * a[d];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int64_t d = 0; d < rank; ++d) o[d] *= inv;
  }
}

// merge_rows over all of out [B, h, rank], rows split over ATen's threads
inline at::Tensor merge_chunks(const at::Tensor& m, const at::Tensor& l, const at::Tensor& acc, int64_t h) {
  const int64_t B = m.size(0), groups = m.size(1), chunks = m.size(2), lanes = m.size(3), rank = acc.size(4);
  at::Tensor out = at::empty({B, h, rank}, acc.options());
  const float* mptr = m.data_ptr<float>();
  const float* lptr = l.data_ptr<float>();
  const float* aptr = acc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * h, 1, [&](int64_t r0, int64_t r1) {
    merge_rows(mptr, lptr, aptr, h, groups, chunks, lanes, rank, op, r0, r1);
  });
  return out;
}

}  // namespace transmla_latent
