// What the decode GEMM kernels (stream_linear.cpp, tiled_linear.cpp) share: their operands and output, and the
// loop over the input rows in blocks of up to 8, each block handed to a kernel instantiated for its row count
// so that its M accumulators stay in registers.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace transmla_gemm {

// y [rows, N] = x [rows, K] W^T (+ bias): x as contiguous rows, the bias contiguous (undefined if none), y allocated
struct Operands {
  at::Tensor x, bias, y;
  std::vector<int64_t> out_shape;  // x's leading dims, then N
  int64_t rows;
};

inline Operands operands(const at::Tensor& x, int64_t K, int64_t N, const c10::optional<at::Tensor>& bias) {
  Operands op;
  op.x = x.reshape({-1, K}).contiguous();
  op.bias = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  op.rows = op.x.size(0);
  op.out_shape = x.sizes().vec();
  op.out_shape.back() = N;
  op.y = at::empty({op.rows, N}, x.options());
  return op;
}

// f(std::integral_constant<int, M>{}, m0) for m0 = 0, 8, 16, ... < rows, with M = min(8, rows - m0)
template <class F>
inline void row_blocks(int64_t rows, F&& f) {
  for (int64_t m0 = 0; m0 < rows; m0 += 8) {
    switch (std::min<int64_t>(8, rows - m0)) {
      case 8: f(std::integral_constant<int, 8>{}, m0); break;
      case 7: f(std::integral_constant<int, 7>{}, m0); break;
      case 6: f(std::integral_constant<int, 6>{}, m0); break;
      case 5: f(std::integral_constant<int, 5>{}, m0); break;
      case 4: f(std::integral_constant<int, 4>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      default: f(std::integral_constant<int, 1>{}, m0); break;
    }
  }
}

}  // namespace transmla_gemm
