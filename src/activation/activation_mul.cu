// activation_mul — a gated FFN's act(a) * b in one pass, bit-exact against eager PyTorch, for any elementwise bf16
// activation given as the table of its 65,536 results.
//
// Eager chains reproduced (bf16):
//     ERNIE-Image (diffusers 0.42.1 ErnieImageFeedForward):  self.up_proj(x) * F.gelu(self.gate_proj(x))
//     FLUX.2 (Flux2SwiGLU):                                  self.gate_fn(x[..., :half]) * x[..., half:]   (SiLU)
// Two aten kernels: the activation's (its own arithmetic, one bf16 rounding) and BinaryFunctor<bf16, bf16, bf16,
// MulFunctor<float>> (one fp32 product, one bf16 rounding: numerics/activation.h gated_product). The activation is
// not replayed: `table` holds act(p) for every bf16 pattern p, computed by the eager activation itself (python:
// difuse.ops.activation_table builds it with torch's F.gelu / F.silu on all 65,536 patterns on the device), so
// the lookup is exact by construction; the product is replayed. out = bf16(RN(float(table[bits(a)]) * float(b))).
// Replays torch 2.11.0+cu130's MulFunctor<float> on bf16 (an FMUL of two widened bf16 values, then cvt.rn.bf16).
//
// Kernels: tensors of >= 2^15 eight-element vectors with 16-byte-aligned rows copy the table into shared memory
// (128 KB, one 1024-thread block per SM, persistent) and stream a and b through it; smaller or misaligned ones read
// the table through the L1 (__ldg), 8 or 1 elements per access. Rows of a and b may each have their own stride (the
// halves of one [.., 2F] projection); out is contiguous, as eager's product is, or rows at one row stride of their
// own (a column slice of a wider buffer: the MLP half of FLUX.2's single-block concat, written in place).
//
// Guards (can_use_activation_mul; every violation is reported): a and b bf16 on one CUDA device, the same sizes,
// rank 1-4, last dim contiguous, leading dims collapsing into one row stride each, fewer than 2^31 elements; table
// bf16 [65536] contiguous on that device; out bf16 of a's sizes on that device, contiguous or with leading dims
// collapsing into one row stride >= its width and a contiguous last dim, either a or b itself (in place, same data
// and strides) or overlapping none of a, b, table.
//
// Verification status: bit-exact on an H100 80GB HBM3 at c3302d8 (torch 2.11.0+cu130, sm_90; no H200 run yet):
// tests/gpu/test_activation_mul.py, 251 cases (every bf16 pattern of a through both kernels for gelu, silu and
// gelu_tanh, ERNIE's and FLUX.2's shapes and layouts), and the ERNIE-Image and FLUX.2 patch tests with sites E5, F7,
// F7c, FS5 (bench/results/h100/gpu-tests-c3302d8-new-kernels.json); compute-sanitizer part 1a clean; 4352x2x12288
// 229.9 us against eager's 366.7 (92.7% of the floor, H100). CPU tests: the product's rounding
// (tests/cpu/test_numerics.cpp), the predicate on ERNIE's and FLUX.2's layouts (tests/cpu/test_c_api.cpp).
// difuse.patch uses it by default; DIFUSE_FUSED_ACTIVATION_MUL=0 leaves its sites out. The output as a column slice
// (o_rs; FLUX.2's FS5 writes into its concat): tests/gpu/test_activation_mul.py::test_into_a_column_slice through all
// three kernels and the FLUX.2 / ERNIE-Image patch tests, bit-exact on an H100 at a540a80
// (bench/results/h100/gpu-tests-a540a80-flux2-concat.json); no smoke case writes a slice yet (not sanitized).
#include "activation/activation_mul.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "core/device.h"
#include "core/elementwise.cuh"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/activation.h"
#include "difuse/numerics/bf16.h"

namespace difuse::activation {

namespace {

const detail::KernelRegistration kRegistration{{
    "activation_mul", "cuda", "bit_exact",
    "act(a) * b in bf16 (act from the table of its 65,536 bf16 results: ERNIE-Image up * F.gelu(gate), FLUX.2 "
    "silu(x1) * x2)",
    "verified bit-exact on H100 at c3302d8 (torch 2.11.0+cu130, sm_90)", 90, 90,
    "a gated FFN's activation and product in one pass"}};

constexpr int kTableEntries = 1 << 16;
constexpr int kTableThreads = 1024;

struct Params {
  const uint16_t* a;
  const uint16_t* b;
  const uint16_t* table;
  uint16_t* out;
  int64_t rows, cols, a_rs, b_rs, o_rs;  // row strides (out: cols when contiguous; a column slice's buffer width)
};

__device__ __forceinline__ uint16_t product1(uint16_t act, uint16_t b) {
  return num::float_to_bf16_rne(num::gated_product(num::bf16_to_float(act), num::bf16_to_float(b)));
}

// Two packed elements: the activations (looked up) and b.
__device__ __forceinline__ uint32_t product2(uint32_t act2, uint32_t b2) {
  return num::pack_bf16x2(num::gated_product(num::bf16_lo(act2), num::bf16_lo(b2)),
                          num::gated_product(num::bf16_hi(act2), num::bf16_hi(b2)));
}

template <class Lookup>
__device__ __forceinline__ uint4 product8(const uint4 wa, const uint4 wb, Lookup lookup) {
  const auto act2 = [&](uint32_t w) {
    return static_cast<uint32_t>(lookup(w & 0xffffu)) | (static_cast<uint32_t>(lookup(w >> 16)) << 16);
  };
  return make_uint4(product2(act2(wa.x), wb.x), product2(act2(wa.y), wb.y), product2(act2(wa.z), wb.z),
                    product2(act2(wa.w), wb.w));
}

// Vector v (8 elements) of the rows sits at row v / nvec, column vector v % nvec (one multiply-high), or at 8 v in
// both inputs when they are dense.
__global__ void __launch_bounds__(kTableThreads, 1) activation_mul_table_kernel(const Params p, detail::FastDivU32 nvec,
                                                                                unsigned total, bool dense) {
  extern __shared__ uint4 lut_words[];
  const uint16_t* lut = reinterpret_cast<const uint16_t*>(lut_words);
  for (int i = static_cast<int>(threadIdx.x); i < kTableEntries / 8; i += kTableThreads)
    lut_words[i] = reinterpret_cast<const uint4*>(p.table)[i];
  __syncthreads();
  const auto lookup = [&](uint32_t x) { return lut[x]; };
  for (unsigned v = blockIdx.x * kTableThreads + threadIdx.x; v < total; v += gridDim.x * kTableThreads) {
    int64_t ao, bo, oo;
    if (dense) {
      ao = bo = oo = static_cast<int64_t>(v) * 8;
    } else {
      uint32_t col;
      const int64_t r = nvec.divmod(v, col);
      ao = r * p.a_rs + col * 8;
      bo = r * p.b_rs + col * 8;
      oo = r * p.o_rs + col * 8;
    }
    const uint4 wa = *reinterpret_cast<const uint4*>(p.a + ao);
    const uint4 wb = *reinterpret_cast<const uint4*>(p.b + bo);
    *reinterpret_cast<uint4*>(p.out + oo) = product8(wa, wb, lookup);
  }
}

// The table read through the L1: rows in blockIdx.y, VEC-element accesses in blockIdx.x, both grid-strided.
template <int VEC>
__global__ void __launch_bounds__(detail::kElementwiseThreads) activation_mul_kernel(const Params p) {
  const int64_t nvec = p.cols / VEC;
  const auto lookup = [&](uint32_t x) { return __ldg(p.table + x); };
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const uint16_t* ar = p.a + r * p.a_rs;
    const uint16_t* br = p.b + r * p.b_rs;
    uint16_t* orow = p.out + r * p.o_rs;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if constexpr (VEC == 8) {
        const uint4 wa = *reinterpret_cast<const uint4*>(ar + v * 8);
        const uint4 wb = *reinterpret_cast<const uint4*>(br + v * 8);
        *reinterpret_cast<uint4*>(orow + v * 8) = product8(wa, wb, lookup);
      } else {
        orow[v] = product1(lookup(ar[v]), br[v]);
      }
    }
  }
}

void allow_table_smem(int device) {
  static std::mutex mu;
  static bool done[detail::kMaxDevices] = {};
  const std::lock_guard<std::mutex> lock(mu);
  if (done[device & 63]) return;
  DIFUSE_CUDA_CHECK(cudaFuncSetAttribute(activation_mul_table_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kTableEntries * static_cast<int>(sizeof(uint16_t))));
  done[device & 63] = true;
}

}  // namespace

detail::Support can_use_activation_mul(const difuse_tensor_view& out, const difuse_tensor_view& a,
                                       const difuse_tensor_view& b, const difuse_tensor_view& table) {
  detail::Support s;
  bool ranks_ok = true;
  for (const auto* t : {&a, &b}) {
    const std::string name = t == &a ? "a" : "b";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, name + " must be bf16, got " + difuse_dtype_name(t->dtype));
    detail::require_cuda_device(s, *t, name);
    if (t->rank < 1 || t->rank > 4) {
      DIFUSE_REQUIRE(s, false, name + " must have rank 1 to 4, got " + detail::describe(*t));
      ranks_ok = false;
      continue;
    }
    DIFUSE_REQUIRE(s, t->strides[t->rank - 1] == 1 || t->sizes[t->rank - 1] <= 1,
                   name + " must have a contiguous last dim, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, detail::collapsed_row_stride(*t) >= 0,
                   name + "'s leading dims must collapse into one row stride, got " + detail::describe(*t));
  }
  bool same = a.rank == b.rank;
  for (int d = 0; same && d < a.rank; ++d) same = a.sizes[d] == b.sizes[d];
  DIFUSE_REQUIRE(s, same, "b must have the sizes of a, got " + detail::describe(b) + " for " + detail::describe(a));
  DIFUSE_REQUIRE(s, b.device == a.device, "b must be on the device of a, got " + detail::describe(b));
  if (ranks_ok)
    DIFUSE_REQUIRE(s, detail::numel(a) < (int64_t{1} << 31),
                   "a must have fewer than 2^31 elements, got " + detail::describe(a));
  DIFUSE_REQUIRE(s, table.dtype == DIFUSE_BF16 && table.rank == 1 && table.sizes[0] == kTableEntries &&
                        (table.strides[0] == 1),
                 "table must be a contiguous bf16 [65536] (act of every bf16 pattern), got " + detail::describe(table));
  DIFUSE_REQUIRE(s, table.device == a.device, "table must be on the device of a, got " + detail::describe(table));
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, std::string("out must be bf16, got ") + difuse_dtype_name(out.dtype));
  DIFUSE_REQUIRE(s, out.device == a.device, "out must be on the device of a, got " + detail::describe(out));
  bool out_same = out.rank == a.rank;
  for (int d = 0; out_same && d < a.rank; ++d) out_same = out.sizes[d] == a.sizes[d];
  DIFUSE_REQUIRE(s, out_same, "out must have the sizes of a, got " + detail::describe(out) + " for " + detail::describe(a));
  // out: contiguous, or rows of a's width at one row stride (a column slice of a wider buffer: FLUX.2's single
  // block writes the MLP half of its [attention, MLP] concat in place)
  const int64_t out_rs = out_same && out.rank >= 1 ? detail::collapsed_row_stride(out) : -1;
  const int64_t cols = a.rank >= 1 ? a.sizes[a.rank - 1] : 0;
  const int64_t out_rows = cols > 0 && out_same ? detail::numel(out) / cols : 0;
  DIFUSE_REQUIRE(s, out.rank >= 1 && (out.strides[out.rank - 1] == 1 || out.sizes[out.rank - 1] <= 1) &&
                        out_rs >= 0 && (out_rows <= 1 || out_rs >= cols),
                 "out must be contiguous or rows of one row stride at least their width with a contiguous last dim "
                 "(a column slice), got " + detail::describe(out));
  if (detail::numel(a) > 0 && out_same && same) {
    DIFUSE_REQUIRE(s, a.data != nullptr && b.data != nullptr && out.data != nullptr && table.data != nullptr,
                   "a, b, table and out must have non-null data pointers");
    const auto is = [&](const difuse_tensor_view& in) {
      if (in.data != out.data) return false;
      for (int d = 0; d < in.rank; ++d)
        if (in.sizes[d] > 1 && in.strides[d] != out.strides[d]) return false;
      return true;
    };
    DIFUSE_REQUIRE(s, is(a) || !detail::overlaps(out, a), "out must be a itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, is(b) || !detail::overlaps(out, b), "out must be b itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, !detail::overlaps(out, table), "out must not overlap the table");
  }
  return s;
}

void activation_mul(const difuse_tensor_view& out, const difuse_tensor_view& a, const difuse_tensor_view& b,
                    const difuse_tensor_view& table, cudaStream_t stream) {
  const detail::Support s = can_use_activation_mul(out, a, b, table);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("activation_mul"));
  if (detail::numel(a) == 0) return;
  Params p{};
  p.a = static_cast<const uint16_t*>(a.data);
  p.b = static_cast<const uint16_t*>(b.data);
  p.table = static_cast<const uint16_t*>(table.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.cols = a.sizes[a.rank - 1];
  p.rows = detail::numel(a) / p.cols;
  p.a_rs = detail::collapsed_row_stride(a);
  p.b_rs = detail::collapsed_row_stride(b);
  p.o_rs = p.rows == 1 ? p.cols : detail::collapsed_row_stride(out);
  const detail::DeviceGuard device_guard(a.device);
  const bool fits8 = p.cols % 8 == 0 && detail::aligned(a.data, 16) && detail::aligned(b.data, 16) &&
                     detail::aligned(out.data, 16) && detail::aligned(table.data, 16) &&
                     (p.rows == 1 || (p.a_rs % 8 == 0 && p.b_rs % 8 == 0 && p.o_rs % 8 == 0));
  const int64_t total = p.rows * (p.cols / 8);
  if (fits8 && total >= (int64_t{1} << 15)) {
    allow_table_smem(a.device);
    const bool dense = p.rows == 1 || (p.a_rs == p.cols && p.b_rs == p.cols && p.o_rs == p.cols);
    activation_mul_table_kernel<<<static_cast<unsigned>(detail::sm_count(a.device)), kTableThreads,
                                  kTableEntries * sizeof(uint16_t), stream>>>(
        p, detail::FastDivU32(static_cast<uint32_t>(p.cols / 8)), static_cast<unsigned>(total), dense);
  } else if (fits8) {
    activation_mul_kernel<8><<<detail::elementwise_grid(p.rows, p.cols, 8), detail::kElementwiseThreads, 0, stream>>>(p);
  } else {
    activation_mul_kernel<1><<<detail::elementwise_grid(p.rows, p.cols, 1), detail::kElementwiseThreads, 0, stream>>>(p);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::activation
