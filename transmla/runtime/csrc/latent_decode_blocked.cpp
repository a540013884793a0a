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

#include "latent_decode_blocked_kernels.h"
#include "latent_merge.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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
