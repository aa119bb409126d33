// rms_norm_rope_rotate_half — ERNIE-Image's per-head QK RMSNorm and its rotate-half RoPE on one q or k tensor in
// one pass, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor.__call__, q and k [B, S, heads, D]
// bf16 from to_q / to_k unflattened, freqs_cis fp32 [B, S, 1, R]):
//     n = attn.norm_q(q)                      torch.nn.RMSNorm(D, eps) with a bf16 weight: F.rms_norm, one aten
//                                             kernel, one bf16 rounding (what norm/rms_norm.cu replays)
//     cos_, sin_ = torch.cos(freqs).to(bf16), torch.sin(freqs).to(bf16)     (not replayed: the caller passes torch's
//                                                                            own tables, as for rope_rotate_half)
//     out = cat(n[..., :R] * cos_ + cat(-n2, n1) * sin_, n[..., R:])        (what rope/rope_rotate_half.cu replays)
// The norm is rms_norm_small_rows' arithmetic for rows of 128 (torch 2.11.0+cu130's vectorized_layer_norm_kernel
// with rms = true, its warp 0 on half of one of our warps: norm/head_rms_span.cuh, rms_norm_pair), the RoPE
// rope_rotate_half_pair (numerics/rope.h) on the normalized bf16 values: the two verified kernels' operations in
// the same order, with the intermediate n kept in registers as the bf16 words rms_norm would have stored.
// Only D = R = 128 (ERNIE-Image's heads): lane u of a 16-lane span holds aten's vectors u and u + 16, the columns
// 4u .. 4u+3 and 64+4u .. 64+4u+3, which are exactly the rotate-half pairs (i, i + 64): no exchange between lanes.
//
// Schedule: rms_norm_small_rows<16, 4, 1>'s: 256 threads, a warp takes 4 slots of two head rows (one per half
// warp) at once; row r = ((b S + s) heads + head) reads its token's four table words (L1 hits across heads); a row's
// place comes from two multiply-high divisions (core/fast_div.h), not 64-bit ones (8 of them per thread would
// cost about as much issue time as the kernel's memory time). 60 registers, no spill (scripts/kernel-resources.sh).
//
// Guards (can_use_rms_norm_rope_rotate_half; every violation is reported): x bf16 [B, S, heads, 128] on a CUDA
// device, non-negative strides, last dim contiguous, every row 8-byte aligned (a contiguous x: its pointer),
// B S heads < 2^31; weight absent or bf16 [128] contiguous and 8-byte aligned; cos and sin bf16 [B or 1, S, 1, 128]
// with a contiguous last dim, one set of strides, rows 8-byte aligned; out contiguous bf16 of x's shape on x's
// device, overlapping none of x, weight, cos, sin.
//
// Verification status: bit-exact on an H100 at ac075fd (torch 2.11.0+cu130, written on 2026-12-05 without a GPU):
// tests/gpu/test_rms_norm_rope_rotate_half.py, 234 cases (site shapes, strided views, seeded random shapes,
// adversarial values, compile/graphs) and test_patch_ernie.py's one-pass model cases, all passed
// (bench/results/h100/gpu-tests-ac075fd-one-pass-ernie.json); `python -m difuse check` exact at its three shapes there
// (its output read from the call, not kept as a file).
// H200 at f59b89a: the same file's cases passed in the whole suite's shard 1
// (gpu-tests-f59b89a-shards-0-2-of-cut-suite.json), `check` exact (check-f59b89a.txt), its two smoke cases clean under
// memcheck and racecheck (sanitizer-f59b89a-part1b.log), and a 4-step ERNIE-Image run with it as site E2's default md5
// identical at every step (e2e-ernie-image-f59b89a-4steps.json). ERNIE's site E2 uses it by default since ac075fd
// (DIFUSE_ERNIE_QK_NORM_ROPE=0 keeps rms_norm, then rope_rotate_half). H100 at ac075fd: 61.4 us at 2x4352x32x128 (80%
// of the floor, 1.17 x the streaming probe), where rms_norm then rope_rotate_half move twice the bytes
// (bench/results/h100/ops-ac075fd-one-pass.json). H200 at f59b89a: 52.1 us (1.35 x the streaming probe's 38.5), where
// rms_norm 2x4352x32x128 takes 40.0 and rope_rotate_half 43.4 (ops.json).
#include "rope/rms_norm_rope_rotate_half.h"

#include <cuda_runtime.h>

#include <string>

#include "core/device.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "norm/head_rms_span.cuh"
#include "norm/layernorm_schedule.h"
#include "rope/half_rope_layout.h"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "rms_norm_rope_rotate_half", "cuda", "bit_exact",
    "ERNIE-Image q / k: F.rms_norm(x, (128,), w, eps), then cat(n * cos + cat(-n2, n1) * sin) with bf16 cos/sin "
    "[B, S, 1, 128]",
    "verified bit-exact on H200 at f59b89a and H100 at ac075fd (torch 2.11.0+cu130, sm_90)", 90, 90,
    "per-head RMSNorm and rotate-half RoPE of one q or k tensor, one pass"}};

constexpr int kD = 128;
constexpr int kSpan = 16, kK = 2, kSlots = 4;  // rms_norm_small_rows<16, 4, 1>

struct Params : HalfRopeLayout {  // x_sb .. t_ss, S, H: rope/half_rope_layout.h
  const uint16_t* x;
  const uint16_t* w;  // nullptr: no weight
  const uint16_t* cos;
  const uint16_t* sin;
  uint16_t* out;
  int64_t rows;
  detail::FastDivU32 by_heads, by_tokens;  // row r -> (token r / H, head r % H); token t -> (t / S, t % S)
  float eps, inv_n_pow2;
  bool has_w;
};

// Row r's element offsets in x and in the tables (rows < 2^31: multiply-high divisions, not 64-bit ones).
struct RowPlace {
  int64_t x, t;
};
__device__ __forceinline__ RowPlace place(const Params& p, int64_t r) {
  uint32_t head, tok;
  const uint32_t t = p.by_heads.divmod(static_cast<uint32_t>(r), head);
  const uint32_t b = p.by_tokens.divmod(t, tok);
  return {b * p.x_sb + tok * p.x_ss + head * p.x_sh, b * p.t_sb + tok * p.t_ss};
}

__device__ __forceinline__ uint32_t rope_word(uint32_t a2, uint32_t b2, uint32_t ca, uint32_t sa, uint32_t cb,
                                              uint32_t sb, uint32_t& out_b) {
  float a0, b0, a1, b1;
  num::rope_rotate_half_pair(num::bf16_lo(a2), num::bf16_lo(b2), num::bf16_lo(ca), num::bf16_lo(sa),
                             num::bf16_lo(cb), num::bf16_lo(sb), a0, b0);
  num::rope_rotate_half_pair(num::bf16_hi(a2), num::bf16_hi(b2), num::bf16_hi(ca), num::bf16_hi(sa),
                             num::bf16_hi(cb), num::bf16_hi(sb), a1, b1);
  out_b = num::pack_bf16x2(b0, b1);
  return num::pack_bf16x2(a0, a1);
}

__global__ void __launch_bounds__(256) rms_norm_rope_rotate_half_kernel(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % kSpan, seg = lane / kSpan;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int64_t r0 = warp * kSlots * kK;
  if (r0 >= p.rows) return;  // whole warp
  uint2 xw[kSlots][kK];
  float s[kSlots];
#pragma unroll
  for (int q = 0; q < kSlots; ++q) {
    const int64_t r = r0 + q * kK + seg;
    const uint2* row = reinterpret_cast<const uint2*>(p.x + place(p, r < p.rows ? r : 0).x);
#pragma unroll
    for (int j = 0; j < kK; ++j) xw[q][j] = r < p.rows ? row[u + kSpan * j] : make_uint2(0, 0);
  }
#pragma unroll
  for (int q = 0; q < kSlots; ++q) s[q] = norm::rms_lane_sum<kK>(xw[q]);
  norm::rms_span_tree<kSpan, kSlots>(s);
  uint2 ww[kK];
#pragma unroll
  for (int j = 0; j < kK; ++j) ww[j] = p.has_w ? reinterpret_cast<const uint2*>(p.w)[u + kSpan * j] : make_uint2(0, 0);
#pragma unroll
  for (int q = 0; q < kSlots; ++q) {
    const int64_t r = r0 + q * kK + seg;
    const float rstd = norm::rms_head_rstd(norm::rms_span_total<kSpan>(s[q]), kD, p.eps, p.inv_n_pow2);
    if (r >= p.rows) continue;
    // n: the bf16 words rms_norm stores (columns 4u.. and 64 + 4u..), then the RoPE on those pairs
    uint2 n[kK];
#pragma unroll
    for (int j = 0; j < kK; ++j)
      n[j] = make_uint2(norm::rms_norm_pair(xw[q][j].x, rstd, p.has_w, ww[j].x),
                        norm::rms_norm_pair(xw[q][j].y, rstd, p.has_w, ww[j].y));
    const int64_t to = place(p, r).t;
    const uint2* ct = reinterpret_cast<const uint2*>(p.cos + to);
    const uint2* st = reinterpret_cast<const uint2*>(p.sin + to);
    const uint2 ca = ct[u], cb = ct[u + kSpan], sa = st[u], sb = st[u + kSpan];
    uint2 oa, ob;
    oa.x = rope_word(n[0].x, n[1].x, ca.x, sa.x, cb.x, sb.x, ob.x);
    oa.y = rope_word(n[0].y, n[1].y, ca.y, sa.y, cb.y, sb.y, ob.y);
    uint2* orow = reinterpret_cast<uint2*>(p.out + r * kD);
    orow[u] = oa;
    orow[u + kSpan] = ob;
  }
}

bool nonneg_strides(const difuse_tensor_view& v) {
  for (int d = 0; d < v.rank; ++d)
    if (v.strides[d] < 0) return false;
  return true;
}

bool present(const difuse_tensor_view& v) { return v.data != nullptr || v.rank != 0; }

}  // namespace

detail::Support can_use_rms_norm_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                                  const difuse_tensor_view& weight, const difuse_tensor_view& cos,
                                                  const difuse_tensor_view& sin, double eps) {
  (void)eps;
  detail::Support s;
  DIFUSE_REQUIRE(s, x.dtype == DIFUSE_BF16, std::string("x must be bf16, got ") + difuse_dtype_name(x.dtype));
  detail::require_cuda_device(s, x, "x");
  const bool x4 = x.rank == 4 && x.sizes[3] == kD;
  DIFUSE_REQUIRE(s, x4, "x must be [B, S, heads, 128] (ERNIE-Image's heads: the rotate-half pairs of a 128-wide row "
                        "sit in one lane of the norm's layout), got " + detail::describe(x));
  const bool empty = detail::numel(x) == 0;
  if (x4) {
    DIFUSE_REQUIRE(s, x.strides[3] == 1, "x must have a contiguous last dim, got " + detail::describe(x));
    DIFUSE_REQUIRE(s, nonneg_strides(x), "x must have non-negative strides, got " + detail::describe(x));
    DIFUSE_REQUIRE(s, x.sizes[0] * x.sizes[1] * x.sizes[2] < (int64_t{1} << 31),
                   "x must have fewer than 2^31 head rows, got " + detail::describe(x));
    if (!empty)
      DIFUSE_REQUIRE(s, x.data != nullptr && detail::rows_aligned(x, 8),
                     "x must have 8-byte aligned rows (a misaligned contiguous x takes aten's two-kernel RMSNorm), "
                     "got " + detail::describe(x));
  }
  if (present(weight)) {
    DIFUSE_REQUIRE(s, weight.dtype == DIFUSE_BF16,
                   std::string("weight must be bf16 like x, got ") + difuse_dtype_name(weight.dtype));
    DIFUSE_REQUIRE(s, weight.rank == 1 && weight.sizes[0] == kD && weight.strides[0] == 1,
                   "weight must be a contiguous [128], got " + detail::describe(weight));
    DIFUSE_REQUIRE(s, weight.device == x.device, "weight must be on the device of x, got " + detail::describe(weight));
    if (!empty)
      DIFUSE_REQUIRE(s, weight.data != nullptr && detail::aligned(weight.data, 8),
                     "weight must be 8-byte aligned (aten vectorizes only then)");
  }
  for (const auto* t : {&cos, &sin}) {
    const std::string name = t == &cos ? "cos" : "sin";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, name + " must be bf16 (torch.cos(freqs).to(x.dtype)), got " +
                                                   difuse_dtype_name(t->dtype));
    DIFUSE_REQUIRE(s, t->device == x.device, name + " must be on the device of x, got " + detail::describe(*t));
    const bool shape_ok = t->rank == 4 && x.rank == 4 && (t->sizes[0] == x.sizes[0] || t->sizes[0] == 1) &&
                          t->sizes[1] == x.sizes[1] && t->sizes[2] == 1 && t->sizes[3] == kD;
    DIFUSE_REQUIRE(s, shape_ok, name + " must be [B or 1, S, 1, 128] (R = D) for x " + detail::describe(x) +
                                    ", got " + detail::describe(*t));
    if (t->rank == 4) {
      DIFUSE_REQUIRE(s, t->strides[3] == 1, name + " must have a contiguous last dim, got " + detail::describe(*t));
      DIFUSE_REQUIRE(s, nonneg_strides(*t), name + " must have non-negative strides, got " + detail::describe(*t));
      if (!empty)
        DIFUSE_REQUIRE(s, t->data != nullptr && detail::rows_aligned(*t, 8),
                       name + " must have 8-byte aligned rows, got " + detail::describe(*t));
    }
  }
  if (cos.rank == 4 && sin.rank == 4)
    DIFUSE_REQUIRE(s, cos.sizes[0] == sin.sizes[0] && (cos.sizes[0] <= 1 || cos.strides[0] == sin.strides[0]) &&
                          (cos.sizes[1] <= 1 || cos.strides[1] == sin.strides[1]),
                   "cos and sin must have the same sizes and strides, got " + detail::describe(cos) + " and " +
                       detail::describe(sin));
  detail::require_bf16_output(s, out, x, "x", {&x, &weight, &cos, &sin});
  return s;
}

void rms_norm_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                               const difuse_tensor_view& weight, const difuse_tensor_view& cos,
                               const difuse_tensor_view& sin, double eps, cudaStream_t stream) {
  const detail::Support s = can_use_rms_norm_rope_rotate_half(out, x, weight, cos, sin, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_rope_rotate_half"));
  if (detail::numel(x) == 0) return;
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.has_w = present(weight);
  p.w = p.has_w ? static_cast<const uint16_t*>(weight.data) : nullptr;
  p.cos = static_cast<const uint16_t*>(cos.data);
  p.sin = static_cast<const uint16_t*>(sin.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.rows = x.sizes[0] * x.sizes[1] * x.sizes[2];
  static_cast<HalfRopeLayout&>(p) = half_rope_layout(x, cos);
  p.by_heads = detail::FastDivU32(static_cast<uint32_t>(p.H));
  p.by_tokens = detail::FastDivU32(static_cast<uint32_t>(p.S));
  p.eps = static_cast<float>(eps);
  p.inv_n_pow2 = num::inv_pow2_or_zero(kD);
  const detail::DeviceGuard device_guard(x.device);
  const int64_t warps = (p.rows + kSlots * kK - 1) / (kSlots * kK);
  rms_norm_rope_rotate_half_kernel<<<static_cast<unsigned>((warps + 7) / 8), 256, 0, stream>>>(p);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
