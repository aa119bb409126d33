// rope_rotate_half — ERNIE-Image's rotate-half RoPE in one pass, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor.__call__'s apply_rotary_emb, on the
// normalized q and k; x [B, S, heads, D] bf16, freqs_cis fp32 [B, S, 1, R]):
//     cos_ = torch.cos(freqs_cis).to(bf16); sin_ = torch.sin(freqs_cis).to(bf16)     (not replayed: the caller
//                                                                                    passes torch's own tables)
//     x, x_pass = x_in[..., :R], x_in[..., R:]
//     x1, x2 = x.chunk(2, dim=-1)
//     out = torch.cat((x * cos_ + torch.cat((-x2, x1), dim=-1) * sin_, x_pass), dim=-1)
// Five aten kernels on bf16 tensors (neg; BinaryFunctor<bf16, bf16, bf16, MulFunctor<float>> twice, broadcasting
// the tables over heads; CUDAFunctor_add<bf16> with alpha 1; the cats): each computes in fp32 and rounds to bf16,
// so per element pair (i, i + R/2) the result is numerics/rope.h rope_rotate_half_pair (products rounded on their
// own, no FMA; the negation applied to the bf16 operand). Replays torch 2.11.0+cu130's elementwise kernels, whose
// per-element arithmetic does not depend on the thread mapping. The cat's output is contiguous, as is `out` here.
//
// One block per token (b, s) (grid-strided), its threads over heads x column groups: a thread owns the columns
// i .. i+7 of the first half and their partners i+h .. i+h+7 (h = R/2), so it reads both halves of x and the four
// table vectors (shared by all heads: L1/L2 hits) and writes both halves; columns >= R are copied 8 at a time.
// Tensors whose sizes, strides or addresses do not allow 16-byte accesses take the scalar kernel: one thread per
// pair (i, i+h), the same arithmetic. A thread reads all it writes before writing, so out may be x itself.
//
// Guards (can_use_rope_rotate_half; every violation is reported): x bf16 [B, S, heads, D] on a CUDA device with a
// contiguous last dim and non-negative strides; cos and sin bf16 [B or 1, S, 1, R] on x's device with a contiguous
// last dim, R even and 2 <= R <= D, the same strides as each other; out contiguous bf16 [B, S, heads, D] on x's
// device, either x itself (same data and strides) or overlapping none of x, cos, sin; B * S < 2^31 tokens,
// heads * D < 2^31.
//
// Verification status: bit-exact on an H100 80GB HBM3 at c3302d8 (torch 2.11.0+cu130, sm_90; no H200 run yet):
// tests/gpu/test_rope_rotate_half.py, 254 cases (seeded shapes and strides, adversarial values, ERNIE's layouts,
// tables broadcast over the batch, refusals, compile, CUDA graph, opcheck), and the ERNIE-Image patch tests
// through site E2 (bench/results/h100/gpu-tests-c3302d8-new-kernels.json); compute-sanitizer part 1a clean;
// 2x4352x32x128 53.6 us against eager's 525.5 (91% of the floor, H100). CPU tests: rope_rotate_half_pair against
// the eager chain emulated op by op (tests/cpu/test_numerics.cpp), the predicate on ERNIE's layouts
// (tests/cpu/test_c_api.cpp). The ERNIE site uses it by default; DIFUSE_ERNIE_FUSED_ROPE=0 keeps the RoPE eager.
// After that run (4ade727) Params took its strides from rope/half_rope_layout.h (shared with
// rms_norm_rope_rotate_half): the kernel code is the same, the parameter block reordered; not yet rerun on a GPU.
// `scripts/sass-diff.sh c3302d8 . src/rope/rope_rotate_half.cu` (nvcc 13.0, sm_90): both kernels differ from the
// verified build only in lines that load a kernel parameter from the constant bank at its new offset (54 and 34
// lines in kernel<1> and kernel<8>, every one a `c[0x0][...]` operand); `scripts/sass-ops-diff.sh c3302d8`: the same
// data instructions.
#include "rope/rope_rotate_half.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/device.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "rope/half_rope_layout.h"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "rope_rotate_half", "cuda", "bit_exact",
    "ERNIE-Image apply_rotary_emb: cat(x * cos + cat(-x2, x1) * sin, x_pass) with bf16 cos/sin [B, S, 1, R] "
    "(rotate-half pairs, a bf16 rounding after each op)",
    "verified bit-exact on H100 at c3302d8 (torch 2.11.0+cu130, sm_90)", 90, 90,
    "rotate-half RoPE of one q or k tensor, one pass"}};

constexpr int kThreads = 256;

struct Params : HalfRopeLayout {  // x_sb .. t_ss, S, H: rope/half_rope_layout.h
  const uint16_t* x;
  const uint16_t* cos;
  const uint16_t* sin;
  uint16_t* out;
  int D, R;
};

__device__ __forceinline__ float lo(uint32_t w) { return num::bf16_lo(w); }
__device__ __forceinline__ float hi(uint32_t w) { return num::bf16_hi(w); }

// 8 pairs: a = x[i .. i+7], b = x[i+h .. i+h+7], with the tables at i (ca, sa) and at i+h (cb, sb).
__device__ __forceinline__ void rotate8(uint4& a, uint4& b, const uint4 ca, const uint4 sa, const uint4 cb,
                                        const uint4 sb) {
  const uint32_t* aw = reinterpret_cast<const uint32_t*>(&a);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(&b);
  const uint32_t* caw = reinterpret_cast<const uint32_t*>(&ca);
  const uint32_t* saw = reinterpret_cast<const uint32_t*>(&sa);
  const uint32_t* cbw = reinterpret_cast<const uint32_t*>(&cb);
  const uint32_t* sbw = reinterpret_cast<const uint32_t*>(&sb);
  uint4 oa, ob;
  uint32_t* oaw = reinterpret_cast<uint32_t*>(&oa);
  uint32_t* obw = reinterpret_cast<uint32_t*>(&ob);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float a0, b0, a1, b1;
    num::rope_rotate_half_pair(lo(aw[k]), lo(bw[k]), lo(caw[k]), lo(saw[k]), lo(cbw[k]), lo(sbw[k]), a0, b0);
    num::rope_rotate_half_pair(hi(aw[k]), hi(bw[k]), hi(caw[k]), hi(saw[k]), hi(cbw[k]), hi(sbw[k]), a1, b1);
    oaw[k] = num::pack_bf16x2(a0, a1);
    obw[k] = num::pack_bf16x2(b0, b1);
  }
  a = oa;
  b = ob;
}

// VEC = 8: a thread per 8 pairs with 16-byte accesses; VEC = 1: a thread per pair (any layout). Either way a thread
// reads everything it writes before writing it.
template <int VEC>
__global__ void __launch_bounds__(kThreads) rope_rotate_half_kernel(const Params p, int64_t tokens) {
  const int h = p.R / 2;
  const int pairs = h / VEC;                   // pair groups of a head row
  const int per_head = pairs + (p.D - p.R) / VEC;  // then the groups of copied columns
  const int items = p.H * per_head;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.S, s = t - b * p.S;
    const uint16_t* xt = p.x + b * p.x_sb + s * p.x_ss;
    const uint16_t* ct = p.cos + b * p.t_sb + s * p.t_ss;
    const uint16_t* st = p.sin + b * p.t_sb + s * p.t_ss;
    uint16_t* ot = p.out + t * static_cast<int64_t>(p.H) * p.D;
    for (int j = threadIdx.x; j < items; j += kThreads) {
      const int head = j / per_head, g = j - head * per_head;
      const uint16_t* xr = xt + head * p.x_sh;
      uint16_t* orow = ot + static_cast<int64_t>(head) * p.D;
      if (g < pairs) {
        const int i = VEC * g;
        if constexpr (VEC == 8) {
          uint4 a = *reinterpret_cast<const uint4*>(xr + i);
          uint4 bv = *reinterpret_cast<const uint4*>(xr + i + h);
          const uint4 ca = *reinterpret_cast<const uint4*>(ct + i), sa = *reinterpret_cast<const uint4*>(st + i);
          const uint4 cb = *reinterpret_cast<const uint4*>(ct + i + h);
          const uint4 sb = *reinterpret_cast<const uint4*>(st + i + h);
          rotate8(a, bv, ca, sa, cb, sb);
          *reinterpret_cast<uint4*>(orow + i) = a;
          *reinterpret_cast<uint4*>(orow + i + h) = bv;
        } else {
          float oa, ob;
          num::rope_rotate_half_pair(num::bf16_to_float(xr[i]), num::bf16_to_float(xr[i + h]),
                                     num::bf16_to_float(ct[i]), num::bf16_to_float(st[i]),
                                     num::bf16_to_float(ct[i + h]), num::bf16_to_float(st[i + h]), oa, ob);
          orow[i] = num::float_to_bf16_rne(oa);
          orow[i + h] = num::float_to_bf16_rne(ob);
        }
      } else {
        const int i = p.R + VEC * (g - pairs);
        if constexpr (VEC == 8)
          *reinterpret_cast<uint4*>(orow + i) = *reinterpret_cast<const uint4*>(xr + i);
        else
          orow[i] = xr[i];
      }
    }
  }
}

bool nonneg_strides(const difuse_tensor_view& v) {
  for (int d = 0; d < v.rank; ++d)
    if (v.strides[d] < 0) return false;
  return true;
}

}  // namespace

detail::Support can_use_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                         const difuse_tensor_view& cos, const difuse_tensor_view& sin) {
  detail::Support s;
  DIFUSE_REQUIRE(s, x.dtype == DIFUSE_BF16, std::string("x must be bf16, got ") + difuse_dtype_name(x.dtype));
  detail::require_cuda_device(s, x, "x");
  const bool x4 = x.rank == 4;
  DIFUSE_REQUIRE(s, x4, "x must be [B, S, heads, D], got " + detail::describe(x));
  if (x4) {
    DIFUSE_REQUIRE(s, x.strides[3] == 1 || x.sizes[3] <= 1, "x must have a contiguous last dim, got " + detail::describe(x));
    DIFUSE_REQUIRE(s, nonneg_strides(x), "x must have non-negative strides, got " + detail::describe(x));
    DIFUSE_REQUIRE(s, x.sizes[0] * x.sizes[1] < (int64_t{1} << 31) && x.sizes[2] * x.sizes[3] < (int64_t{1} << 31),
                   "x must have fewer than 2^31 tokens and heads * D < 2^31, got " + detail::describe(x));
  }
  int64_t R = -1;
  for (const auto* t : {&cos, &sin}) {
    const std::string name = t == &cos ? "cos" : "sin";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, name + " must be bf16 (torch.cos(freqs).to(x.dtype)), got " +
                                                   difuse_dtype_name(t->dtype));
    DIFUSE_REQUIRE(s, t->device == x.device, name + " must be on the device of x, got " + detail::describe(*t));
    if (t->rank != 4) {
      DIFUSE_REQUIRE(s, false, name + " must be [B or 1, S, 1, R], got " + detail::describe(*t));
      continue;
    }
    DIFUSE_REQUIRE(s, t->strides[3] == 1 || t->sizes[3] <= 1, name + " must have a contiguous last dim, got " +
                                                                  detail::describe(*t));
    DIFUSE_REQUIRE(s, nonneg_strides(*t), name + " must have non-negative strides, got " + detail::describe(*t));
    if (x4) {
      DIFUSE_REQUIRE(s, (t->sizes[0] == x.sizes[0] || t->sizes[0] == 1) && t->sizes[1] == x.sizes[1] &&
                            t->sizes[2] == 1,
                     name + " must be [B or 1, S, 1, R] for x " + detail::describe(x) + ", got " + detail::describe(*t));
      DIFUSE_REQUIRE(s, t->sizes[3] % 2 == 0 && t->sizes[3] >= 2 && t->sizes[3] <= x.sizes[3],
                     name + "'s last dim R must be even with 2 <= R <= D, got " + detail::describe(*t));
    }
    if (R < 0) R = t->sizes[3];
  }
  if (cos.rank == 4 && sin.rank == 4) {
    DIFUSE_REQUIRE(s, cos.sizes[0] == sin.sizes[0] && cos.sizes[1] == sin.sizes[1] && cos.sizes[3] == sin.sizes[3],
                   "cos and sin must have the same sizes, got " + detail::describe(cos) + " and " + detail::describe(sin));
    // one set of table strides in the kernels (torch.cos / torch.sin of one freqs tensor give the same layout)
    DIFUSE_REQUIRE(s, (cos.sizes[0] <= 1 || cos.strides[0] == sin.strides[0]) &&
                          (cos.sizes[1] <= 1 || cos.strides[1] == sin.strides[1]),
                   "cos and sin must have the same strides, got " + detail::describe(cos) + " and " + detail::describe(sin));
  }
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, std::string("out must be bf16, got ") + difuse_dtype_name(out.dtype));
  DIFUSE_REQUIRE(s, out.device == x.device, "out must be on the device of x, got " + detail::describe(out));
  bool same = out.rank == x.rank;
  for (int d = 0; same && d < x.rank; ++d) same = out.sizes[d] == x.sizes[d];
  DIFUSE_REQUIRE(s, same, "out must have the sizes of x, got " + detail::describe(out) + " for " + detail::describe(x));
  DIFUSE_REQUIRE(s, detail::is_contiguous(out), "out must be contiguous, got " + detail::describe(out));
  if (detail::numel(x) > 0 && same) {
    bool in_place = out.data == x.data;
    for (int d = 0; in_place && d < x.rank; ++d) in_place = out.strides[d] == x.strides[d] || x.sizes[d] <= 1;
    DIFUSE_REQUIRE(s, x.data != nullptr && out.data != nullptr && cos.data != nullptr && sin.data != nullptr,
                   "x, cos, sin and out must have non-null data pointers");
    DIFUSE_REQUIRE(s, in_place || !detail::overlaps(out, x), "out must be x itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, !detail::overlaps(out, cos) && !detail::overlaps(out, sin), "out must not overlap cos or sin");
  }
  return s;
}

void rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& cos,
                      const difuse_tensor_view& sin, cudaStream_t stream) {
  const detail::Support s = can_use_rope_rotate_half(out, x, cos, sin);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rope_rotate_half"));
  if (detail::numel(x) == 0) return;
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.cos = static_cast<const uint16_t*>(cos.data);
  p.sin = static_cast<const uint16_t*>(sin.data);
  p.out = static_cast<uint16_t*>(out.data);
  static_cast<HalfRopeLayout&>(p) = half_rope_layout(x, cos);
  p.D = static_cast<int>(x.sizes[3]);
  p.R = static_cast<int>(cos.sizes[3]);
  const int64_t tokens = x.sizes[0] * x.sizes[1];
  const auto m8 = [](int64_t v) { return v % 8 == 0; };
  const bool vec8 = p.R % 16 == 0 && m8(p.D - p.R) && detail::aligned(x.data, 16) && detail::aligned(out.data, 16) &&
                    detail::aligned(cos.data, 16) && detail::aligned(sin.data, 16) && (x.sizes[0] <= 1 || m8(p.x_sb)) &&
                    (x.sizes[1] <= 1 || m8(p.x_ss)) && (p.H <= 1 || m8(p.x_sh)) && m8(p.t_sb) &&
                    (x.sizes[1] <= 1 || m8(p.t_ss));
  const detail::DeviceGuard device_guard(x.device);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tokens, int64_t{1} << 30));
  if (vec8)
    rope_rotate_half_kernel<8><<<grid, kThreads, 0, stream>>>(p, tokens);
  else
    rope_rotate_half_kernel<1><<<grid, kThreads, 0, stream>>>(p, tokens);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
