// transmla::tiled_linear: y [M, N] = x [M, K] W[N, K]^T (+ b) for the few rows of a decode step, from W
// packed k-major in column tiles: packed [N / 48 (rounded up), K, 48], zero rows past N
// (`runtime.packed`, kernel "tiled").
//
// The stream kernel (stream_linear.cpp) takes W as PyTorch stores it and forms dot products: for every 8
// weights it loads 8 input vectors, so its loads and FMAs compete and the weight stream waits on them. Here
// each k reads 48 weights (three AVX-512 vectors, one contiguous stream per tile that the hardware
// prefetcher follows) and one broadcast of x[m, k] per row: 3 + 8 loads per 24 FMAs, the 24 accumulators in
// registers for the whole of K. One pass of batch 8 through the SmolLM2 87.5% export's linears, 2 threads of
// an AMD EPYC, alternated in one process: 15.6 against 18.1 ms for the stream kernel (a read-only sum of the
// same weights 14.7 ms); software prefetches 256-1536 bytes ahead were no faster. Threads split the tiles
// (ATen's intra-op pool). AVX-512 only: `runtime.packed` offers "tiled" where the CPU has it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "decode_gemm.h"
#include "tiled_tile.h"

namespace {

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(has_avx512(), "tiled_linear needs a CPU with AVX-512 (use the stream kernel elsewhere)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "tiled_linear runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "tiled_linear takes float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kWidth && packed.is_contiguous(),
              "tiled_linear: packed [ceil(N / 48), K, 48], contiguous (runtime.packed)");
  const int64_t K = packed.size(1), N = out_features, tiles = packed.size(0);
  TORCH_CHECK(x.size(-1) == K, "tiled_linear: x [..., K] for packed [*, K, 48]");
  TORCH_CHECK(N > 0 && (N + kWidth - 1) / kWidth == tiles, "tiled_linear: out_features does not match the packed tiles");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "tiled_linear: bias [N]");
  const transmla_gemm::Operands op = transmla_gemm::operands(x, K, N, bias);
  const float* xp = op.x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = has_bias ? op.bias.data_ptr<float>() : nullptr;
  float* yp = op.y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { tile_range(xp, op.rows, K, pp, bp, yp, N, t0, t1); });
  return op.y.view(op.out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(transmla, m) {
  m.def("tiled_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(transmla, CPU, m) {
  m.impl("tiled_linear", &tiled_linear);
}
