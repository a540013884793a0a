// transmla::absorbed_decode_step: one decode step of an absorbed DeepseekV3 (runtime.absorb with the query and
// output folded, no query LoRA, dense SiLU MLPs) in one call: every decoder layer, the final norm and the head,
// on weights packed by runtime.packed's "tiled" kernel, over the blocked static latent cache of
// runtime.compiled_decode. Python side: runtime.native_decode.
//
// Why: the compiled step (runtime.compiled_decode) is ~120 kernel calls and as many small inductor kernels per
// token, each an OpenMP fork and join, with the main thread's serial work (dispatch, the graph's wrapper, dynamo's
// lookup) in between while the other threads wait: about 4 ms of a 30 ms step on the 2-core EPYC of
// reports/throughput. Here the whole step is one parallel region; its phases (norm, GEMM, latent, attention,
// merge, ...) are separated by barriers, each thread taking one contiguous share of every phase (`in_share`).
// Against the compiled step, alternated in one process (SmolLM2 87.5%, batch 8, 4K, 2 threads): 24.5 against
// 29.1 ms per step in a fast hour (faster in 14 of 16 rounds), 32.8 against 36.5 ms in a slow one (19 of 20).
//
// Per layer, for rows b of x [B, D] (the residual stream):
//   xn = rms_norm(x) w_in                                   (rows split over the threads)
//   qkv = xn [W_q_folded ; W_kv_a]^T (+ b)                  (one fused GEMM, tiles shared)
//   latent = [rms_norm(c) w_kv ; rope(k_pe)] -> cache[b, position];  q_rope = rope(q_rope) per head   (rows)
//   per (sequence, head group, chunk of keys): softmax partials of [q_lat ; q_rope] . latent      (items shared)
//   att = merge of the partials [B, h r]                    (rows b h + j shared)
//   x += att W_o_folded^T (+ b)                             (GEMM, the residual added in its epilogue)
//   xn = rms_norm(x) w_post;  gu = xn [W_gate ; W_up]^T;  act = silu(gate) up;  x += act W_down^T   (likewise)
// then logits = rms_norm(x) w_final W_head^T.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include "latent_decode_blocked_kernels.h"
#include "latent_merge.h"
#include "tiled_tile.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

// per layer, in runtime.native_decode.layer_tensors' order; an empty tensor = no bias
enum LayerTensor { kInNorm, kQkv, kQkvBias, kKvNorm, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kPerLayer };
// per layer ints: kv_a's first column in the fused query/latent output, up's first column in the fused gate/up
// output, the MLP's intermediate size; floats: the input, latent and post-attention norms' eps, the softmax scale
constexpr int kInts = 3, kFloats = 4;
constexpr int64_t kMaxRope = 1024, kMaxLatent = 4096;  // stack buffers of one head's RoPE dims, one latent

inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

const float* ptr_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// f(a, b) on this thread's share [a, b) of a phase's work items [0, n): one contiguous run per thread, so each
// thread streams one run of weight tiles (or of sequences' latents) that the hardware prefetcher follows. Measured
// against items claimed from an atomic counter, which interleaves the two threads' tiles (SmolLM2 87.5%, batch 8,
// 4K, 2 threads, 16 rounds alternated in one process, a fast hour): 24.53 ms per step against 29.24 claimed one
// at a time and 25.63 claimed in shrinking runs (guided), the compiled step 29.08. (In a slow hour, claimed one at
// a time was the faster by 2%: 32.20 against 32.80 ms.) The split does not change any result: the logits are the
// same bits at any thread count.
template <class F>
inline void in_share(int64_t n, int tid, int nt, F&& f) {
  int64_t a, b;
  share(n, tid, nt, a, b);
  if (a < b) f(a, b);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
// y = x / sqrt(mean(x^2) + eps) * w over n values (DeepseekV3RMSNorm in float32)
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    s = _mm512_fmadd_ps(v, v, s);
  }
  float sum = _mm512_reduce_add_ps(s);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m512 vi = _mm512_set1_ps(inv);
  i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(x + i), vi)));
  for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// out[i] = silu(gate[i]) up[i] = gate[i] up[i] / (1 + e^-gate[i]), i < n
void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  const __m512 one = _mm512_set1_ps(1.f), cap = _mm512_set1_ps(87.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    // e^-g for -g <= 87 (v512::exp16 clamps below at -87; above 87 the sigmoid is 0 to float32 anyway)
    const __m512 e = v512::exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), cap));
    _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_mul_ps(g, _mm512_loadu_ps(up + i)), _mm512_add_ps(one, e)));
  }
  for (; i < n; ++i) out[i] = gate[i] * up[i] / (1.f + std::exp(-gate[i]));
}
#pragma GCC pop_options

// RoPE of one head's R values in place, as transformers' DeepseekV3 applies it: the interleaved pairs
// (x[2i], x[2i+1]) rotated by angle i and written as [evens ; odds] (apply_rotary_pos_emb_interleave), or
// rotate_half's halves (apply_rotary_pos_emb). cos, sin: [R], cat(freqs, freqs) as the rotary embedding gives them.
void rope(float* x, const float* cos, const float* sin, int64_t R, bool interleave) {
  float a[kMaxRope / 2], b[kMaxRope / 2];
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    a[i] = interleave ? x[2 * i] : x[i];
    b[i] = interleave ? x[2 * i + 1] : x[half + i];
  }
  for (int64_t i = 0; i < half; ++i) {
    x[i] = a[i] * cos[i] - b[i] * sin[i];
    x[half + i] = b[i] * cos[half + i] + a[i] * sin[half + i];
  }
}

at::Tensor absorbed_decode_step(const at::Tensor& x_in, at::TensorList w, at::TensorList caches, at::IntArrayRef ints,
                                at::ArrayRef<double> floats, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& final_norm, const at::Tensor& head, const at::Tensor& head_bias,
                                int64_t h, int64_t r, int64_t R, int64_t vocab, int64_t position, bool interleave,
                                double final_eps) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"),
              "absorbed_decode_step needs a CPU with AVX-512 (use the compiled decode step elsewhere)");
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(w.size()) == kPerLayer * L && static_cast<int64_t>(ints.size()) == kInts * L &&
                  static_cast<int64_t>(floats.size()) == kFloats * L,
              "absorbed_decode_step: ", kPerLayer, " tensors, ", kInts, " ints and ", kFloats, " floats per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "absorbed_decode_step: x [B, D] float32 on CPU");
  const int64_t B = x_in.size(0), D = x_in.size(1), E = r + R;
  TORCH_CHECK(h > 0 && r > 0 && R > 0 && R % 2 == 0 && R <= kMaxRope && E <= kMaxLatent,
              "absorbed_decode_step: heads, rank > 0, an even RoPE dim <= ", kMaxRope, ", rank + RoPE dim <= ", kMaxLatent);
  TORCH_CHECK(cos.numel() == R && sin.numel() == R && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "absorbed_decode_step: cos and sin [R] float32");
  auto tiled = [&](const at::Tensor& t, int64_t K, int64_t min_cols, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 3 && t.size(1) == K && t.size(2) == kWidth &&
                    t.is_contiguous() && t.size(0) * kWidth >= min_cols,
                what, ": packed [tiles, ", K, ", 48] float32, contiguous, for ", min_cols, " columns");
  };
  auto vec = [&](const at::Tensor& t, int64_t n, bool optional, const char* what) {
    TORCH_CHECK((optional && t.numel() == 0) ||
                    (t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.numel() == n),
                what, ": [", n, "] float32", optional ? " or empty" : "");
  };
  const int64_t tiles_d = (D + kWidth - 1) / kWidth;
  int64_t max_qkv = 0, max_gu = 0, max_inter = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* t = &w[kPerLayer * l];
    const int64_t kv_off = ints[kInts * l], up_off = ints[kInts * l + 1], inter = ints[kInts * l + 2];
    TORCH_CHECK(kv_off >= h * E && inter > 0 && up_off >= inter, "absorbed_decode_step: layer ", l, ": column offsets");
    vec(t[kInNorm], D, false, "input norm");
    tiled(t[kQkv], D, kv_off + E, "fused query / kv_a");
    vec(t[kQkvBias], t[kQkv].size(0) * kWidth, true, "fused query / kv_a bias");
    vec(t[kKvNorm], r, false, "latent norm");
    tiled(t[kO], h * r, D, "folded output");
    TORCH_CHECK(t[kO].size(0) == tiles_d, "folded output: ", tiles_d, " tiles");
    vec(t[kOBias], D, true, "output bias");
    vec(t[kPostNorm], D, false, "post-attention norm");
    tiled(t[kGateUp], D, up_off + inter, "fused gate / up");
    vec(t[kGateUpBias], t[kGateUp].size(0) * kWidth, true, "fused gate / up bias");
    tiled(t[kDown], inter, D, "down");
    TORCH_CHECK(t[kDown].size(0) == tiles_d, "down: ", tiles_d, " tiles");
    vec(t[kDownBias], D, true, "down bias");
    const at::Tensor& c = caches[l];
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.device().is_cpu() && c.dim() == 4 && c.size(0) == B && c.size(2) == E &&
                    c.size(3) == 16 && c.is_contiguous() && c.size(1) == caches[0].size(1),
                "absorbed_decode_step: cache ", l, ": [B, NB, r + R, 16] float32, contiguous, one capacity");
    max_qkv = std::max(max_qkv, t[kQkv].size(0) * kWidth);
    max_gu = std::max(max_gu, t[kGateUp].size(0) * kWidth);
    max_inter = std::max(max_inter, inter);
  }
  const int64_t NB = caches[0].size(1), T = position + 1;
  TORCH_CHECK(position >= 0 && T <= NB * 16, "absorbed_decode_step: position ", position, " outside the cache's ", NB * 16, " tokens");
  vec(final_norm, D, false, "final norm");
  tiled(head, D, vocab, "head");
  TORCH_CHECK(head.size(0) == (vocab + kWidth - 1) / kWidth, "head: packed for ", vocab, " columns");
  vec(head_bias, vocab, true, "head bias");

  const at::TensorOptions f32 = x_in.options();
  at::Tensor x = x_in.contiguous().clone(), xn = at::empty({B, D}, f32), qkv = at::empty({B, max_qkv}, f32);
  at::Tensor att = at::empty({B, h * r}, f32), gu = at::empty({B, max_gu}, f32), act = at::empty({B, max_inter}, f32);
  at::Tensor logits = at::empty({B, vocab}, f32);
  // the attention's work items and partials: sequence x group of <= 16 heads x chunk of keys
  const int64_t gmax = 16, groups = (h + gmax - 1) / gmax, nb = (T + 15) / 16;
  const int64_t chunks = (nb + kChunkBlocks - 1) / kChunkBlocks, items = B * groups * chunks;
  std::vector<float> mpart(items * gmax), lpart(items * gmax), apart(items * gmax * r);
  std::vector<float> mask(nb * 16, 0.f);  // the last block's keys past the current token: not attended
  for (int64_t t = T; t < nb * 16; ++t) mask[t] = -std::numeric_limits<float>::infinity();

  float* xp = x.data_ptr<float>();
  float* xnp = xn.data_ptr<float>();
  float* qp = qkv.data_ptr<float>();
  float* ap = att.data_ptr<float>();
  float* gp = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int nthreads = at::get_num_threads();

#pragma omp parallel num_threads(nthreads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<float> scores(gmax * kChunkKeys);
    int64_t b0, b1;
    share(B, tid, nt, b0, b1);  // this thread's rows for the row-wise phases
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* t = &w[kPerLayer * l];
      const int64_t kv_off = ints[kInts * l], up_off = ints[kInts * l + 1], inter = ints[kInts * l + 2];
      const float eps_in = static_cast<float>(floats[kFloats * l]), eps_kv = static_cast<float>(floats[kFloats * l + 1]);
      const float eps_post = static_cast<float>(floats[kFloats * l + 2]), scale = static_cast<float>(floats[kFloats * l + 3]);
      const int64_t wq = t[kQkv].size(0) * kWidth, wg = t[kGateUp].size(0) * kWidth;
      float* lat = caches[l].data_ptr<float>();
      const int64_t seq_stride = NB * E * 16;

      for (int64_t b = b0; b < b1; ++b) rms_norm(xp + b * D, t[kInNorm].data_ptr<float>(), D, eps_in, xnp + b * D);
#pragma omp barrier
      in_share(t[kQkv].size(0), tid, nt, [&](int64_t i0, int64_t i1) {
        tile_range<false>(xnp, B, D, t[kQkv].data_ptr<float>(), ptr_or_null(t[kQkvBias]), qp, wq, i0, i1);
      });
#pragma omp barrier
      for (int64_t b = b0; b < b1; ++b) {
        float* row = qp + b * wq;
        float latent[kMaxLatent];
        const float* c = row + kv_off;
        rms_norm(c, t[kKvNorm].data_ptr<float>(), r, eps_kv, latent);
        for (int64_t i = 0; i < R; ++i) latent[r + i] = c[r + i];
        rope(latent + r, cs, sn, R, interleave);
        // token `position`, dim e of sequence b: block position / 16, row e, lane position % 16
        float* dst = lat + b * seq_stride + (position / 16) * E * 16 + position % 16;
        for (int64_t e = 0; e < E; ++e) dst[e * 16] = latent[e];
        for (int64_t j = 0; j < h; ++j) rope(row + j * E + r, cs, sn, R, interleave);
      }
#pragma omp barrier
      in_share(items, tid, nt, [&](int64_t i0, int64_t i1) {
        for (int64_t it = i0; it < i1; ++it) {
          const int64_t c = it % chunks, g = (it / chunks) % groups, b = it / (chunks * groups);
          const int64_t k0 = c * kChunkBlocks, k1 = std::min(nb, k0 + kChunkBlocks);
          const int G = static_cast<int>(std::min<int64_t>(gmax, h - g * gmax));
          v512::run_chunk(G, qp + b * wq + g * gmax * E, E, lat + b * seq_stride, k0, k1, mask.data(), scale, r,
                          mpart.data() + it * gmax, lpart.data() + it * gmax, apart.data() + it * gmax * r, scores.data());
        }
      });
#pragma omp barrier
      in_share(B * h, tid, nt, [&](int64_t i0, int64_t i1) {
        transmla_latent::merge_rows(mpart.data(), lpart.data(), apart.data(), h, groups, chunks, gmax, r, ap, i0, i1);
      });
#pragma omp barrier
      in_share(tiles_d, tid, nt, [&](int64_t i0, int64_t i1) {
        tile_range<true>(ap, B, h * r, t[kO].data_ptr<float>(), ptr_or_null(t[kOBias]), xp, D, i0, i1);
      });
#pragma omp barrier
      for (int64_t b = b0; b < b1; ++b) rms_norm(xp + b * D, t[kPostNorm].data_ptr<float>(), D, eps_post, xnp + b * D);
#pragma omp barrier
      in_share(t[kGateUp].size(0), tid, nt, [&](int64_t i0, int64_t i1) {
        tile_range<false>(xnp, B, D, t[kGateUp].data_ptr<float>(), ptr_or_null(t[kGateUpBias]), gp, wg, i0, i1);
      });
#pragma omp barrier
      for (int64_t b = b0; b < b1; ++b) silu_mul(gp + b * wg, gp + b * wg + up_off, inter, actp + b * inter);
#pragma omp barrier
      in_share(tiles_d, tid, nt, [&](int64_t i0, int64_t i1) {
        tile_range<true>(actp, B, inter, t[kDown].data_ptr<float>(), ptr_or_null(t[kDownBias]), xp, D, i0, i1);
      });
#pragma omp barrier
    }
    for (int64_t b = b0; b < b1; ++b) rms_norm(xp + b * D, final_norm.data_ptr<float>(), D, static_cast<float>(final_eps), xnp + b * D);
#pragma omp barrier
    in_share(head.size(0), tid, nt, [&](int64_t i0, int64_t i1) {
      tile_range<false>(xnp, B, D, head.data_ptr<float>(), ptr_or_null(head_bias), logits.data_ptr<float>(), vocab, i0, i1);
    });
  }
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transmla, m) {
  m.def("absorbed_decode_step(Tensor x, Tensor[] weights, Tensor(a!)[] caches, int[] layer_ints, float[] layer_floats, "
        "Tensor cos, Tensor sin, Tensor final_norm, Tensor head, Tensor head_bias, int heads, int rank, int rope_dim, "
        "int vocab, int position, bool rope_interleave, float final_eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(transmla, CPU, m) {
  m.impl("absorbed_decode_step", &absorbed_decode_step);
}
