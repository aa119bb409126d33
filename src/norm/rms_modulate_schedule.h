// The arithmetic of diffusers' RMSNorm class followed by an adaLN modulate, split into the pieces the
// rms_norm_modulate kernels and their host emulation (tests/cpu/test_rms_norm_modulate.cpp) share.
//
// diffusers.models.normalization.RMSNorm.forward, bf16 x:
//     variance = x.to(float32).pow(2).mean(-1, keepdim=True)   copy (exact), RN(v * v), aten's generic mean
//     y = x * torch.rsqrt(variance + eps)                      RN(var + eps), rsqrtf, RN(x * rstd) in fp32
//     y = y.to(bf16) * weight   (bf16 weight)  |  y.to(bf16)  (no weight)
// The mean is reduce_kernel<512, 1, ReduceOp<float, MeanOps<...>, uint32, float, 4, 4>> (Reduce.cuh, torch
// 2.11; shared/reference/torch-2.11-numerics.md §3). For rows >= 16 and 32 <= N <= 8160 its block is (32, 16)
// and each warp owns one row (ReduceConfig splits a row across warps once ceil(N / 32) >= 256). Lane x:
//   N >= 128 (vectorized; the fp32 rows are 16-byte aligned because N % 4 == 0): vectors v = x, x + 32, ...
//            of 4 floats, element 4v + k into accumulator k;
//   N <  128: elements x + 32 i into accumulator i (one group: the main loop or the tail, same assignment);
// then ((a0 + a1) + a2) + a3, a shuffle-down tree with offsets 16, 8, 4, 2, 1, and lane 0 stores
// RN(sum * factor), factor = (float)rows / (float)(rows * N) as aten forms it on the host.
#pragma once

#include "difuse/numerics/bf16.h"
#include "difuse/numerics/modulate.h"

namespace difuse::norm {

constexpr int kMeanLanes = 32;  // aten's block width for these rows: one warp per output row

// One lane's four accumulators of the mean (value_list[0..3] of Reduce.cuh), starting at +0.
struct MeanLane {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
};

// pow(2) in fp32: RN(v * v) (exact for bf16 inputs unless it falls below fp32's normal range).
DIFUSE_HD float mean_square(float v) { return num::mul_rn(v, v); }

// Vectorized loop: one float4 vector of the squared row, element k into accumulator k.
DIFUSE_HD void mean_push_vec4(MeanLane& l, float x0, float x1, float x2, float x3) {
  l.a[0] = num::add_rn(l.a[0], mean_square(x0));
  l.a[1] = num::add_rn(l.a[1], mean_square(x1));
  l.a[2] = num::add_rn(l.a[2], mean_square(x2));
  l.a[3] = num::add_rn(l.a[3], mean_square(x3));
}

// Rows of fewer than 128 elements: element lane + 32 i into accumulator i.
DIFUSE_HD void mean_push_scalar(MeanLane& l, int i, float x) { l.a[i] = num::add_rn(l.a[i], mean_square(x)); }

// The combine of the accumulators: ((a0 + a1) + a2) + a3.
DIFUSE_HD float mean_lane_total(const MeanLane& l) {
  return num::add_rn(num::add_rn(num::add_rn(l.a[0], l.a[1]), l.a[2]), l.a[3]);
}

// The same bits with the additions of +0 left out, for the half-warp kernels that are issue-bound (an
// instruction per element there). A fresh accumulator holds +0, and RN(+0 + s) == s for every s = RN(v * v): a
// square is never -0 (its sign is +), +0 + inf is inf, and +0 + NaN is that NaN (on the GPU every NaN here is
// already the canonical one; on the host the payload passes through both). tests/cpu/test_numerics.cpp checks
// every bf16 value.
DIFUSE_HD void mean_first_push_vec4(MeanLane& l, float x0, float x1, float x2, float x3) {
  l.a[0] = mean_square(x0);
  l.a[1] = mean_square(x1);
  l.a[2] = mean_square(x2);
  l.a[3] = mean_square(x3);
}
DIFUSE_HD void mean_first_push_scalar(MeanLane& l, int i, float x) { l.a[i] = mean_square(x); }

// mean_lane_total of a lane whose accumulators 2 and 3 were never pushed (rows of 64 on half warps): ((a0 + a1) +
// +0) + +0 == a0 + a1, as a sum of squares is never -0 (the same argument as above).
DIFUSE_HD float mean_lane_total_first_two(const MeanLane& l) { return num::add_rn(l.a[0], l.a[1]); }

// One step of the shuffle-down tree: own + the value of lane + offset.
DIFUSE_HD float mean_tree_step(float own, float in) { return num::add_rn(own, in); }

// The host twins of a W-lane shuffle-down tree's lane 0 (offsets W/2..1; lanes past W read their own value) and of
// the butterfly (xor offsets W/2..1) that replaces the tree and its broadcast. By induction, after the step of
// offset o the butterfly's lane i holds the bits of the down tree's lane i mod o: before it, lanes i and i ^ o hold
// those of down lanes i mod 2o and (i ^ o) mod 2o, which are j = i mod o and j + o, the two partial sums down lane j
// adds, in one order or the other; IEEE addition is commutative (a NaN result is the GPU's canonical NaN either
// way). So every lane ends with the down tree's lane-0 bits. tests/cpu checks it.
template <int W>
float mean_down_tree_lane0_host(const float (&lanes)[W]) {
  float v[W];
  for (int i = 0; i < W; ++i) v[i] = lanes[i];
  for (int o = W / 2; o >= 1; o /= 2)
    for (int i = 0; i < W; ++i) v[i] = mean_tree_step(v[i], v[i + o < W ? i + o : i]);
  return v[0];
}

// The host twin of the warp's tree (offsets 16..1): lane 0's sum. Lanes are updated in ascending order, so lane + o
// still holds its value from before the step, as a shuffle reads it.
inline float mean_tree_host(const float (&lanes)[kMeanLanes]) { return mean_down_tree_lane0_host(lanes); }

template <int W>
void mean_butterfly_host(const float (&lanes)[W], float (&out)[W]) {
  for (int i = 0; i < W; ++i) out[i] = lanes[i];
  for (int o = W / 2; o >= 1; o /= 2) {
    float before[W];
    for (int i = 0; i < W; ++i) before[i] = out[i];
    for (int i = 0; i < W; ++i) out[i] = mean_tree_step(before[i], before[i ^ o]);
  }
}

// mean = RN(sum * factor); rstd = rsqrtf(RN(mean + eps)) (device: MUFU.RSQ; the host twin approximates).
DIFUSE_HD float diffusers_rstd(float sum, float factor, float eps) {
  return num::rsqrt_cuda(num::add_rn(num::mul_rn(sum, factor), eps));
}

// diffusers_rstd for eps >= FLT_MIN (the caller checks; a sum of squares is >= +0 or NaN and factor > 0, so
// RN(mean + eps) >= eps): the same bits without rsqrtf's subnormal scaling (num::rsqrt_cuda_normal_input).
DIFUSE_HD float diffusers_rstd_normal_eps(float sum, float factor, float eps) {
  return num::rsqrt_cuda_normal_input(num::add_rn(num::mul_rn(sum, factor), eps));
}

// The norm's output element, as diffusers' RMSNorm returns it: bf16(RN(x * rstd)), then bf16(RN(y * w)) with a
// bf16 weight (an fp32 product rounded: y * w may fall below fp32's subnormal grid, so no bf16x2 mul).
DIFUSE_HD float diffusers_rms_value(float x, float rstd, bool has_w, float w) {
  const float y = num::round_bf16(num::mul_rn(x, rstd));
  return has_w ? num::round_bf16(num::mul_rn(y, w)) : y;
}

// diffusers_rms_value on both bf16 of x2 with both of w2, packed (low half first): the same two roundings, done two
// elements at a time (pack_bf16x2 rounds both halves in one instruction on the device, where the per-element form
// converts each half alone and widens it back: ~5 instructions fewer per pair). Every value diffusers_rms_value
// returns is a bf16 widened, so packing it again is exact. tests/cpu/test_rms_norm_modulate.cpp compares the bits.
DIFUSE_HD uint32_t diffusers_rms_pair(uint32_t x2, float rstd, bool has_w, uint32_t w2) {
  const uint32_t y2 = num::pack_bf16x2(num::mul_rn(num::bf16_lo(x2), rstd), num::mul_rn(num::bf16_hi(x2), rstd));
  if (!has_w) return y2;
  return num::pack_bf16x2(num::mul_rn(num::bf16_lo(y2), num::bf16_lo(w2)),
                          num::mul_rn(num::bf16_hi(y2), num::bf16_hi(w2)));
}

// diffusers_rms_value's bits with a weight always applied: an absent weight is w = 1, since RN(y * 1) = y for
// every bf16 y (NaN stays NaN, canonical on the device as bf16(RN(.)) makes it anyway), so kernels need no branch.
DIFUSE_HD uint16_t diffusers_rms_bits(float x, float rstd, float w) {
  return num::float_to_bf16_rne(num::mul_rn(num::round_bf16(num::mul_rn(x, rstd)), w));
}

// One output element of rms_norm_modulate (a bf16 value, widened): the norm, then the modulate step in the
// bf16 chain (LTX-2: n * (1 + scale) + shift in bf16) or the fp32 chain (ERNIE-Image:
// (n.float() * (1 + scale.float()) + shift.float()).to(bf16)).
DIFUSE_HD float rms_modulate_value(float x, float rstd, bool has_w, float w, float scale, float shift, bool fp32_mod) {
  const float n = diffusers_rms_value(x, rstd, has_w, w);
  return fp32_mod ? num::round_bf16(num::modulate_f32(n, scale, shift)) : num::modulate_bf16_value(n, scale, shift);
}

// Two adjacent output elements (element 0 in the low half), the form the kernels run; the same bits as
// rms_modulate_value on each element.
DIFUSE_HD uint32_t rms_modulate_pair(uint32_t x2, float rstd, bool has_w, uint32_t w2, uint32_t scale2,
                                     uint32_t shift2, bool fp32_mod) {
  uint32_t n2 = num::pack_bf16x2(num::mul_rn(num::bf16_lo(x2), rstd), num::mul_rn(num::bf16_hi(x2), rstd));
  if (has_w)
    n2 = num::pack_bf16x2(num::mul_rn(num::bf16_lo(n2), num::bf16_lo(w2)), num::mul_rn(num::bf16_hi(n2), num::bf16_hi(w2)));
  if (fp32_mod)
    return num::pack_bf16x2(num::modulate_f32(num::bf16_lo(n2), num::bf16_lo(scale2), num::bf16_lo(shift2)),
                            num::modulate_f32(num::bf16_hi(n2), num::bf16_hi(scale2), num::bf16_hi(shift2)));
  return num::modulate_bf16x2(n2, scale2, shift2);
}

}  // namespace difuse::norm
