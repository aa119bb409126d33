// gated_residual — the adaLN-Zero gated residual in one pass, bit-exact against eager PyTorch.
//
// Eager chain reproduced (FLUX.1 D6/D6c/S4 and the residual half of D4; Qwen-Image, SD3 alike), bf16:
//     out = h + gate[:, None] * a        (gate [B, H], a strided row of an adaLN chunk)
//     out = h + gate * a                 (gate [B, L, H], per-token modulation)
//     out = (h.float() + a * gate).type_as(h)   gated_residual_fp32: Wan's fp32 gate, one bf16 rounding
// two eager kernels, each rounding to bf16:  t = bf16(RN(gate * a));  out = bf16(RN(h + t)).
//
// Replays: torch 2.11.0+cu130 — binary_internal::MulFunctor<float> and CUDAFunctor_add<bf16> with alpha 1
// (shared/reference/torch-2.11-numerics.md §4): fp32 opmath, one bf16 RNE store each, no contraction
// between the two kernels. The product is formed in fp32 and rounded (a bf16 x bf16 product can fall below
// fp32's subnormal grid, so mul.rn.bf16x2 is not used); the sum uses add.rn.bf16x2, which equals the fp32
// add + bf16 rounding for any two bf16 (numerics/bf16.h).
//
// Guards (can_use_gated_residual; every violation is reported): h, a, out [B, L, H] bf16 contiguous on one
// CUDA device; gate [B, H] or [B, L, H] bf16 with a contiguous last dim and non-negative strides; out is h
// (in place) or overlaps nothing. Any alignment (accesses of 16, 8, 4 or 2 bytes by alignment).
// gated_residual_fp32 (can_use_gated_residual_fp32): the same, with an fp32 gate [B, H], [B, 1, H] or [B, L, H]
// 4-byte aligned (since the thirty-third session; the C ABI could pass one 2 bytes off) and out not overlapping it.
//
// Accesses: gated_residual 16, 8, 4 or 2 bytes by alignment; gated_residual_fp32 16-byte bf16 words with two
// float4 gate loads where H % 8 == 0 and every row is 16-byte aligned (Wan's sites), else 4-byte words and float2
// gates, else scalars (gated_residual_fp32_vector_width). The arithmetic per element is the same at every width.
//
// Verification status: bit-exact on the H200 at 66f5a3b and again at 5f8295d (torch 2.11.0+cu130, sm_90):
// tests/gpu/test_gated_residual.py
// (242 cases; gated_residual_fp32 in test_wan_fp32.py, every access width forced), 0 failed, 0 skipped
// (bench/results/h200/tests.json), incl. the per-row batch index as a multiply-high (detail::IndexDiv).
// gated_residual_fp32's 16-byte path (first run at 5fde96b): 405 us with 4-byte accesses -> 232.7 us at
// 1x32760x5120, at the 236 us floor (predicted ~280: it streams at copy bandwidth).
// The flat-index kernel ran there at 66f5a3b behind DIFUSE_EW_FLAT=1 (test_flat_index_variant passed, now
// test_grid2d_variant; bench 0 mismatches, knob-sweeps/); it became the default after that run, and this file's
// tests passed with it at bc88af7 (tests-defaults-bc88af7.json; 1x4096x3072 21.0 us).
#include "modulate/gated_residual.h"
#include "modulate/gated_residual_pair.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/device.h"
#include "core/elementwise.cuh"
#include "core/env_knob.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"

namespace difuse::modulate {

namespace {

const detail::KernelRegistration kF32Registration{{
    "gated_residual_fp32", "cuda", "bit_exact",
    "(h.float() + a * gate).type_as(h)  (Wan: bf16 h, a; fp32 gate [B,H], [B,1,H] or [B,L,H])",
    "verified bit-exact on H200 at 132f46f (torch 2.11.0+cu130, sm_90)", 90, 90,
    "Wan's gated residual with an fp32 gate, one bf16 rounding at the end"}};

const detail::KernelRegistration kRegistration{{
    "gated_residual", "cuda", "bit_exact",
    "h + gate[:, None] * a  (bf16; h, a [B,L,H]; gate [B,H] or [B,L,H])",
    "verified bit-exact on H200 at 132f46f (torch 2.11.0+cu130, sm_90)", 90, 90,
    "adaLN-Zero gated residual in one pass, both eager roundings"}};

struct Params {
  const uint16_t* h;
  const uint16_t* a;
  const uint16_t* g;
  uint16_t* out;
  int64_t rows, seq, cols;
  int64_t g_sb, g_sl;  // gate strides (batch, token); g_sl = 0 for a [B, H] gate
  detail::IndexDiv seq_div;  // row -> batch without a 64-bit division
};

// VEC elements at column c of the row at `base` (its gate row `grow`): out = bf16(h + bf16(gate * a)).
template <int VEC>
__device__ __forceinline__ void gated_residual_vec(const Params& p, const uint16_t* grow, int64_t base, int64_t c) {
  if constexpr (VEC == 1) {
    const float t = num::round_bf16(num::mul_rn(num::bf16_to_float(grow[c]), num::bf16_to_float(p.a[base + c])));
    p.out[base + c] = num::float_to_bf16_rne(num::add_rn(num::bf16_to_float(p.h[base + c]), t));
  } else {
    using T = typename detail::Bf16Access<VEC>::T;
    constexpr int W = VEC / 2;
    T hv = *reinterpret_cast<const T*>(p.h + base + c);
    const T av = *reinterpret_cast<const T*>(p.a + base + c);
    const T gv = *reinterpret_cast<const T*>(grow + c);
    uint32_t* hw = reinterpret_cast<uint32_t*>(&hv);
    const uint32_t* aw = reinterpret_cast<const uint32_t*>(&av);
    const uint32_t* gw = reinterpret_cast<const uint32_t*>(&gv);
#pragma unroll
    for (int w = 0; w < W; ++w) hw[w] = gated_residual_pair(hw[w], aw[w], gw[w]);
    *reinterpret_cast<T*>(p.out + base + c) = hv;
  }
}

template <int VEC>
__global__ void __launch_bounds__(256) gated_residual_kernel(const Params p) {
  const int64_t nvec = p.cols / VEC;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const int64_t b = p.seq_div.div(r), l = r - b * p.seq;
    const uint16_t* grow = p.g + b * p.g_sb + l * p.g_sl;
    const int64_t base = r * p.cols;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x)
      gated_residual_vec<VEC>(p, grow, base, v * VEC);
  }
}

// The default (DIFUSE_EW_GRID2D=1 selects the 2-D grid above): one flat index over every row's vectors
// (rows * cols / VEC < 2^31), so no thread idles where a row's vector count is not a multiple of the block
// (3072 / 8 = 384 vectors: the 2-D grid runs two 256-thread blocks per row, a third of its threads idle); the row
// by a multiply-high. The same per-element arithmetic (gated_residual_vec).
template <int VEC>
__global__ void __launch_bounds__(256) gated_residual_flat_kernel(const Params p, detail::FastDivU32 nvec_div,
                                                                 uint32_t total) {
  for (uint32_t v = blockIdx.x * blockDim.x + threadIdx.x; v < total; v += gridDim.x * blockDim.x) {
    uint32_t cv;
    const int64_t r = nvec_div.divmod(v, cv);
    const int64_t b = p.seq_div.div(r), l = r - b * p.seq;
    gated_residual_vec<VEC>(p, p.g + b * p.g_sb + l * p.g_sl, r * p.cols, static_cast<int64_t>(cv) * VEC);
  }
}

// Wan's fp32 gate: out = bf16(RN(f(h) + RN(f(a) * g))), one bf16 rounding (bf16 x fp32 promotes to fp32).
template <int VEC>  // 8: 16-byte words of eight bf16 and two float4 gates; 2: one word and a float2; 1: scalars
__global__ void __launch_bounds__(256) gated_residual_fp32_kernel(const Params p, const float* g32) {
  const int64_t nvec = p.cols / VEC;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const int64_t b = p.seq_div.div(r), l = r - b * p.seq;
    const float* grow = g32 + b * p.g_sb + l * p.g_sl;
    const int64_t base = r * p.cols;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t c = v * VEC;
      if constexpr (VEC == 1) {
        const float t = num::mul_rn(num::bf16_to_float(p.a[base + c]), grow[c]);
        p.out[base + c] = num::float_to_bf16_rne(num::add_rn(num::bf16_to_float(p.h[base + c]), t));
      } else if constexpr (VEC == 2) {
        const uint32_t hw = *reinterpret_cast<const uint32_t*>(p.h + base + c);
        const uint32_t aw = *reinterpret_cast<const uint32_t*>(p.a + base + c);
        const float2 g = *reinterpret_cast<const float2*>(grow + c);
        *reinterpret_cast<uint32_t*>(p.out + base + c) = gated_residual_fp32_pair(hw, aw, g.x, g.y);
      } else {
        static_assert(VEC == 8, "gated_residual_fp32_kernel: VEC is 8, 2 or 1");
        const uint4 hv = *reinterpret_cast<const uint4*>(p.h + base + c);
        const uint4 av = *reinterpret_cast<const uint4*>(p.a + base + c);
        const float4 g0 = *reinterpret_cast<const float4*>(grow + c);
        const float4 g1 = *reinterpret_cast<const float4*>(grow + c + 4);
        // word k holds elements 2k (low half) and 2k + 1 (high half)
        *reinterpret_cast<uint4*>(p.out + base + c) = make_uint4(
            gated_residual_fp32_pair(hv.x, av.x, g0.x, g0.y), gated_residual_fp32_pair(hv.y, av.y, g0.z, g0.w),
            gated_residual_fp32_pair(hv.z, av.z, g1.x, g1.y), gated_residual_fp32_pair(hv.w, av.w, g1.z, g1.w));
      }
    }
  }
}

template <int VEC>
void launch(const Params& p, cudaStream_t stream) {
  // Default: the flat index (H200 at 66f5a3b, knob-sweeps/: 1x4096x3072 chunk6 20.9 us vs 21.3 on the 2-D grid,
  // 1x512x3072 6.0 vs 6.6; no shape slower). DIFUSE_EW_GRID2D=1 keeps the 2-D grid.
  static const int grid2d = detail::positive_env_knob("DIFUSE_EW_GRID2D");
  const int64_t nvec = p.cols / VEC, total = p.rows * nvec;
  if (grid2d != 1 && total < (int64_t{1} << 31)) {
    const int64_t blocks = std::min<int64_t>((total + detail::kElementwiseThreads - 1) / detail::kElementwiseThreads,
                                             int64_t{1} << 20);
    gated_residual_flat_kernel<VEC><<<static_cast<unsigned>(blocks), detail::kElementwiseThreads, 0, stream>>>(
        p, detail::FastDivU32(static_cast<uint32_t>(nvec)), static_cast<uint32_t>(total));
    return;
  }
  gated_residual_kernel<VEC><<<detail::elementwise_grid(p.rows, p.cols, VEC), detail::kElementwiseThreads, 0, stream>>>(p);
}

bool vec_ok(const void* ptr, int64_t elems_stride, int vec) {
  return detail::aligned(ptr, static_cast<uintptr_t>(2 * vec)) && elems_stride % vec == 0;
}

}  // namespace

int gated_residual_vector_width(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                                const difuse_tensor_view& gate) {
  const int64_t H = h.sizes[2];
  const bool per_token = gate.rank == 3;
  for (int vec : {8, 4, 2}) {
    if (H % vec) continue;
    const bool ok = vec_ok(h.data, H, vec) && vec_ok(a.data, H, vec) && vec_ok(out.data, H, vec) &&
                    vec_ok(gate.data, gate.strides[0], vec) && (!per_token || gate.strides[1] % vec == 0);
    if (ok) return vec;
  }
  return 1;
}

int gated_residual_fp32_vector_width(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                     const difuse_tensor_view& a, const difuse_tensor_view& gate) {
  // The gate rows the kernel reads: [B, H] (or [B, 1, H]) rows g_sb apart, per token also g_sl apart.
  const bool per_token = gate.rank == 3 && gate.sizes[1] > 1;
  const int64_t g_sb = gate.strides[0], g_sl = per_token ? gate.strides[1] : 0;
  const int64_t H = h.sizes[2];
  for (int vec : {8, 2}) {
    if (H % vec) continue;
    // bf16 tensors: vec * 2 bytes per access; the fp32 gate: vec * 4 bytes, read as float4 pairs for 8
    const uintptr_t gate_align = vec == 8 ? 16 : 8;
    const bool ok = vec_ok(h.data, H, vec) && vec_ok(a.data, H, vec) && vec_ok(out.data, H, vec) &&
                    detail::aligned(gate.data, gate_align) && g_sb % (vec == 8 ? 4 : 2) == 0 &&
                    g_sl % (vec == 8 ? 4 : 2) == 0;
    if (ok) return vec;
  }
  return 1;
}

detail::Support can_use_gated_residual(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                       const difuse_tensor_view& a, const difuse_tensor_view& gate) {
  detail::Support s;
  const difuse_tensor_view* views[] = {&h, &a, &gate, &out};
  const char* names[] = {"h", "a", "gate", "out"};
  for (int k = 0; k < 4; ++k) {
    DIFUSE_REQUIRE(s, views[k]->dtype == DIFUSE_BF16,
                   std::string(names[k]) + " must be bf16, got " + difuse_dtype_name(views[k]->dtype));
    detail::require_cuda_device(s, *views[k], names[k]);
    DIFUSE_REQUIRE(s, views[k]->device == h.device,
                   std::string(names[k]) + " must be on the device of h, got " + detail::describe(*views[k]));
  }
  if (h.rank != 3) {
    DIFUSE_REQUIRE(s, false, "h must have rank 3 [B, L, H], got " + detail::describe(h));
    return s;
  }
  const int64_t B = h.sizes[0], L = h.sizes[1], H = h.sizes[2];
  const bool empty = B == 0 || L == 0 || H == 0;
  DIFUSE_REQUIRE(s, detail::is_contiguous(h), "h must be contiguous, got " + detail::describe(h));
  for (const auto* t : {&a, &out}) {
    const char* name = t == &a ? "a" : "out";
    DIFUSE_REQUIRE(s, t->rank == 3 && t->sizes[0] == B && t->sizes[1] == L && t->sizes[2] == H,
                   std::string(name) + " must have the shape of h, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, detail::is_contiguous(*t), std::string(name) + " must be contiguous, got " + detail::describe(*t));
  }
  const bool g2 = gate.rank == 2 && gate.sizes[0] == B && gate.sizes[1] == H;
  const bool g3 = gate.rank == 3 && gate.sizes[0] == B && gate.sizes[1] == L && gate.sizes[2] == H;
  DIFUSE_REQUIRE(s, g2 || g3, "gate must be [B, H] or [B, L, H] = [" + std::to_string(B) + ", (" + std::to_string(L) +
                                  ",) " + std::to_string(H) + "], got " + detail::describe(gate));
  if (g2 || g3) {
    DIFUSE_REQUIRE(s, gate.strides[gate.rank - 1] == 1 || H <= 1,
                   "gate must have a contiguous last dim, got " + detail::describe(gate));
    bool nonneg = true;
    for (int d = 0; d < gate.rank; ++d) nonneg = nonneg && gate.strides[d] >= 0;
    DIFUSE_REQUIRE(s, nonneg, "gate must have non-negative strides, got " + detail::describe(gate));
  }
  if (!empty) {
    DIFUSE_REQUIRE(s, h.data && a.data && gate.data && out.data, "h, a, gate and out must have non-null data pointers");
    DIFUSE_REQUIRE(s, out.data == h.data || !detail::overlaps(out, h),
                   "out must be h itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, !detail::overlaps(out, a) && !detail::overlaps(out, gate), "out must not overlap a or gate");
  }
  return s;
}

void gated_residual(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                    const difuse_tensor_view& gate, cudaStream_t stream) {
  const detail::Support s = can_use_gated_residual(out, h, a, gate);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual"));
  const int64_t B = h.sizes[0], L = h.sizes[1], H = h.sizes[2];
  if (B == 0 || L == 0 || H == 0) return;
  Params p{};
  p.h = static_cast<const uint16_t*>(h.data);
  p.a = static_cast<const uint16_t*>(a.data);
  p.g = static_cast<const uint16_t*>(gate.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.rows = B * L;
  p.seq = L;
  p.seq_div = detail::IndexDiv(L, p.rows);
  p.cols = H;
  p.g_sb = gate.strides[0];
  p.g_sl = gate.rank == 3 ? gate.strides[1] : 0;

  const detail::DeviceGuard device_guard(h.device);
  switch (gated_residual_vector_width(out, h, a, gate)) {
    case 8: launch<8>(p, stream); break;
    case 4: launch<4>(p, stream); break;
    case 2: launch<2>(p, stream); break;
    default: launch<1>(p, stream); break;
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

detail::Support can_use_gated_residual_fp32(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                            const difuse_tensor_view& a, const difuse_tensor_view& gate) {
  difuse_tensor_view g = gate;  // shape rules of the bf16 op ([B, 1, H] read as [B, H]); dtype checked here
  if (g.rank == 3 && g.sizes[1] == 1) {
    g.rank = 2;
    g.sizes[1] = gate.sizes[2];
    g.strides[1] = gate.strides[2];
  }
  g.dtype = DIFUSE_BF16;
  detail::Support s = can_use_gated_residual(out, h, a, g);
  DIFUSE_REQUIRE(s, gate.dtype == DIFUSE_F32, std::string("gate must be fp32, got ") + difuse_dtype_name(gate.dtype));
  // The bf16 rules above hold the gate to 2-byte elements; fp32 loads need the pointer 4-byte aligned (strides count
  // fp32 elements).
  DIFUSE_REQUIRE(s, detail::aligned(gate.data, 4), "gate must be 4-byte aligned (fp32 elements)");
  if (detail::numel(h) > 0) DIFUSE_REQUIRE(s, !detail::overlaps(out, gate), "out must not overlap gate");
  return s;
}

void gated_residual_fp32(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                         const difuse_tensor_view& gate, cudaStream_t stream) {
  const detail::Support s = can_use_gated_residual_fp32(out, h, a, gate);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_fp32"));
  const int64_t B = h.sizes[0], L = h.sizes[1], H = h.sizes[2];
  if (B == 0 || L == 0 || H == 0) return;
  Params p{};
  p.h = static_cast<const uint16_t*>(h.data);
  p.a = static_cast<const uint16_t*>(a.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.rows = B * L;
  p.seq = L;
  p.seq_div = detail::IndexDiv(L, p.rows);
  p.cols = H;
  const bool per_token = gate.rank == 3 && gate.sizes[1] > 1;
  p.g_sb = gate.strides[0];
  p.g_sl = per_token ? gate.strides[1] : 0;
  const float* g32 = static_cast<const float*>(gate.data);
  const detail::DeviceGuard device_guard(h.device);
  switch (gated_residual_fp32_vector_width(out, h, a, gate)) {
    case 8:
      gated_residual_fp32_kernel<8><<<detail::elementwise_grid(p.rows, p.cols, 8), detail::kElementwiseThreads, 0,
                                      stream>>>(p, g32);
      break;
    case 2:
      gated_residual_fp32_kernel<2><<<detail::elementwise_grid(p.rows, p.cols, 2), detail::kElementwiseThreads, 0,
                                      stream>>>(p, g32);
      break;
    default:
      gated_residual_fp32_kernel<1><<<detail::elementwise_grid(p.rows, p.cols, 1), detail::kElementwiseThreads, 0,
                                      stream>>>(p, g32);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::modulate
