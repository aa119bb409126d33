// Shared pieces of the elementwise (row x column) kernels: the vector type for VEC bf16 per access and
// the 2-D launch shape (columns in blockIdx.x, rows in blockIdx.y, both grid-strided).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace difuse::detail {

template <int VEC>
struct Bf16Access;  // VEC bf16 in one access, as 32-bit words
template <>
struct Bf16Access<8> {
  using T = uint4;
};
template <>
struct Bf16Access<4> {
  using T = uint2;
};
template <>
struct Bf16Access<2> {
  using T = uint32_t;
};

constexpr int kElementwiseThreads = 256;

// Grid for `rows` rows of `cols / vec` accesses each, `threads` per block.
inline dim3 elementwise_grid(int64_t rows, int64_t cols, int vec, int threads = kElementwiseThreads) {
  const int64_t nvec = cols / vec;
  return dim3(static_cast<unsigned>(std::min<int64_t>((nvec + threads - 1) / threads, 65535)),
              static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
}

}  // namespace difuse::detail
