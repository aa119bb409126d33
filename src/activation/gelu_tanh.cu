// gelu_tanh — F.gelu(x, approximate="tanh") in bf16, bit-exact against eager PyTorch, into any row layout.
//
// Eager op reproduced (FLUX.1 FeedForward and the single block's act_mlp, SD3, Wan FFN), bf16:
//     out = F.gelu(x, approximate="tanh")          one aten kernel: bf16(gelu_fp32(f(x)))
// Replays: torch 2.11.0+cu130 GeluCUDAKernelImpl (numerics/activation.h has the formula and constants).
// The output may be a column slice of a larger buffer (the single block writes the MLP half of its
// [attention, mlp] concat directly), so rows of x and out each have their own stride.
//
// Guards (can_use_gelu_tanh; every violation is reported): x and out bf16 on one CUDA device, same sizes,
// rank 1-4, last dim contiguous, leading dims that collapse into one row stride each (any row stride);
// out overlaps x only if it is x itself (in place). Any alignment (16/8/4/2-byte accesses by alignment).
//
// Verification status: CPU tests only at this commit; tests/gpu/test_gelu_tanh.py (all 65,536 bf16 inputs
// among others) has not yet run on the H200.
#include "activation/gelu_tanh.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/device.h"
#include "core/elementwise.cuh"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/activation.h"
#include "difuse/numerics/bf16.h"

namespace difuse::activation {

namespace {

const detail::KernelRegistration kRegistration{{
    "gelu_tanh", "cuda", "bit_exact", "F.gelu(x, approximate=\"tanh\")  (bf16; out may be a column slice)",
    "pending H200 verification (torch 2.11.0+cu130, sm_90)", 90, 90,
    "GELU (tanh) with libdevice tanhf, written into any row layout"}};

struct Params {
  const uint16_t* x;
  uint16_t* out;
  int64_t rows, cols, x_rs, out_rs;
};

__device__ __forceinline__ uint32_t gelu2(uint32_t w) {
  return num::pack_bf16x2(num::gelu_tanh(num::bf16_lo(w)), num::gelu_tanh(num::bf16_hi(w)));
}

template <int VEC>
__global__ void __launch_bounds__(256) gelu_tanh_kernel(const Params p) {
  const int64_t nvec = p.cols / VEC;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const uint16_t* xr = p.x + r * p.x_rs;
    uint16_t* orow = p.out + r * p.out_rs;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if constexpr (VEC == 1) {
        orow[v] = num::float_to_bf16_rne(num::gelu_tanh(num::bf16_to_float(xr[v])));
      } else {
        using T = typename detail::Bf16Access<VEC>::T;
        T w = *reinterpret_cast<const T*>(xr + v * VEC);
        uint32_t* words = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k) words[k] = gelu2(words[k]);
        *reinterpret_cast<T*>(orow + v * VEC) = w;
      }
    }
  }
}

template <int VEC>
void launch(const Params& p, cudaStream_t stream) {
  gelu_tanh_kernel<VEC><<<detail::elementwise_grid(p.rows, p.cols, VEC), detail::kElementwiseThreads, 0, stream>>>(p);
}

// The single stride of the collapsed leading dims, or -1 when they do not collapse.
int64_t row_stride(const difuse_tensor_view& v) {
  if (v.rank <= 1) return v.rank == 1 ? v.sizes[0] : 1;
  for (int d = 0; d + 2 < v.rank; ++d)
    if (v.sizes[d] > 1 && v.strides[d] != v.strides[d + 1] * v.sizes[d + 1]) return -1;
  return v.strides[v.rank - 2];
}

}  // namespace

detail::Support can_use_gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x) {
  detail::Support s;
  for (const auto* t : {&x, &out}) {
    const char* name = t == &x ? "x" : "out";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, std::string(name) + " must be bf16, got " + difuse_dtype_name(t->dtype));
    DIFUSE_REQUIRE(s, t->device >= 0, std::string(name) + " must be on a CUDA device, got host memory");
    if (t->rank < 1 || t->rank > 4) {
      DIFUSE_REQUIRE(s, false, std::string(name) + " must have rank 1 to 4, got " + detail::describe(*t));
      continue;
    }
    DIFUSE_REQUIRE(s, t->strides[t->rank - 1] == 1 || t->sizes[t->rank - 1] <= 1,
                   std::string(name) + " must have a contiguous last dim, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, row_stride(*t) >= 0,
                   std::string(name) + "'s leading dims must collapse into one row stride, got " + detail::describe(*t));
  }
  bool same = x.rank == out.rank;
  for (int d = 0; same && d < x.rank; ++d) same = x.sizes[d] == out.sizes[d];
  DIFUSE_REQUIRE(s, same, "out must have the sizes of x, got " + detail::describe(out) + " for " + detail::describe(x));
  DIFUSE_REQUIRE(s, out.device == x.device, "out must be on the device of x, got " + detail::describe(out));
  if (detail::numel(x) > 0) {
    DIFUSE_REQUIRE(s, x.data != nullptr && out.data != nullptr, "x and out must have non-null data pointers");
    DIFUSE_REQUIRE(s, out.data == x.data || !detail::overlaps(out, x), "out must be x itself (in place) or not overlap it");
  }
  return s;
}

void gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x, cudaStream_t stream) {
  const detail::Support s = can_use_gelu_tanh(out, x);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gelu_tanh"));
  if (detail::numel(x) == 0) return;
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.cols = x.sizes[x.rank - 1];
  p.rows = detail::numel(x) / p.cols;
  p.x_rs = row_stride(x);
  p.out_rs = row_stride(out);
  const detail::DeviceGuard device_guard(x.device);
  auto fits = [&](int vec) {
    return p.cols % vec == 0 && detail::aligned(x.data, 2 * vec) && detail::aligned(out.data, 2 * vec) &&
           (p.rows == 1 || (p.x_rs % vec == 0 && p.out_rs % vec == 0));
  };
  if (fits(8))
    launch<8>(p, stream);
  else if (fits(4))
    launch<4>(p, stream);
  else if (fits(2))
    launch<2>(p, stream);
  else
    launch<1>(p, stream);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::activation
