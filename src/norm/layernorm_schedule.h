// The arithmetic schedule of torch 2.11's vectorized LayerNorm (vectorized_layer_norm_kernel<bf16, float,
// false>), split into the pieces that device kernels and host emulations both call.
//
// aten runs one 128-thread block per row. Thread t (0..127) owns the 4-element vectors t, t+128, t+256, ...
// of the row (V = H/4 vectors), pushes their elements in order into its own Welford state, then the block
// combines: a shuffle-down tree with offsets 16, 8, 4, 2, 1 inside each 32-thread warp, then warp roots
// (0,2), (1,3), then (0,1). A row's bits depend on exactly that tree, never on how we launch.
//
// We run G threads per row (G = 32, 64 or 128), each holding A = 128/G of aten's threads ("slots"):
//   strided (8-byte loads): slot j of thread i is aten thread i + j*G;
//   paired (16-byte loads): slots (s, h) of thread i are aten threads 2*(i + s*G) + h, h = 0, 1, whose
//                            vectors are adjacent in memory, so one 16-byte load covers both;
//   warp-local (G = 32, AtenWarpLocalMap): paired vectors, thread i's four aten threads all in aten warp i / 8.
// Every aten shuffle then maps to one shuffle of ours (or an in-thread combine) with the same operands.
// The host emulation in tests/cpu runs these same functions for every (G, layout) and checks them bit for
// bit against G = 128 strided, which is aten's own thread layout.
#pragma once

#include "difuse/numerics/bf16.h"
#include "difuse/numerics/welford.h"

namespace difuse::norm {

constexpr int kAtenThreads = 128;  // num_threads() = 4 * C10_WARP_SIZE
constexpr int kAtenWarp = 32;
constexpr int kVecElems = 4;       // vec_size in aten's vectorized LayerNorm, for every dtype

template <int G, bool PAIRED>
struct AtenThreadMap {
  static_assert(G == 32 || G == 64 || G == 128, "G threads per row must be 32, 64 or 128");
  static_assert(!PAIRED || G <= 64, "paired slots need at least two aten threads per thread");
  static constexpr int kThreads = G;
  static constexpr int kSlots = kAtenThreads / G;
  static constexpr bool kPaired = PAIRED;

  DIFUSE_HD static constexpr int aten_thread(int i, int j) {
    return PAIRED ? 2 * (i + (j / 2) * G) + (j % 2) : i + j * G;
  }
  // For aten's shuffle offset `o`, the partner of slot j is in thread i + lane_delta(o), slot partner_slot(o, j).
  // lane_delta == 0 means an in-thread combine.
  DIFUSE_HD static constexpr int lane_delta(int o) { return PAIRED ? o / 2 : o; }
  DIFUSE_HD static constexpr int partner_slot(int o, int j) { return (PAIRED && o == 1) ? j + 1 : j; }
  // Slots that combine at offset o (the others hold values aten never reads). Every slot of these maps takes part
  // in every shuffle step; the paired maps' in-thread step (o = 1) combines into even slots only.
  DIFUSE_HD static constexpr bool receives(int o, int j) { return !(PAIRED && o == 1) || (j % 2 == 0); }
};

// One-warp rows with the tree kept local (G = 32, 16-byte loads): thread i holds aten warp w = i / 8's lanes
// 2m, 2m + 1, 2m + 16, 2m + 17 (m = i % 8) as slots 0..3, so slots (0, 1) and (2, 3) are adjacent vectors (one
// 16-byte load each, as in the paired map) and the partners of aten's first step (offset 16) sit in the same thread.
// The tree: offset 16 in-thread (slots 0 <- 2, 1 <- 3), offsets 8, 4, 2 one shuffle by 4, 2, 1 lanes of slots 0
// and 1 only (within the warp's 8 threads), offset 1 in-thread (slot 0 <- 1); aten warp w's root ends in thread
// 8 w, slot 0. The paired map's tree shuffles all four slots at four offsets (state shuffles and combines a
// thread: 16 and 18 there, 6 and 9 here) because its slots 2 and 3 belong to other aten warps.
struct AtenWarpLocalMap {
  static constexpr int kThreads = 32;
  static constexpr int kSlots = 4;
  static constexpr bool kPaired = true;  // slots (0, 1) and (2, 3) are adjacent vectors

  DIFUSE_HD static constexpr int aten_thread(int i, int j) {
    return kAtenWarp * (i / 8) + 2 * (i % 8) + (j % 2) + 16 * (j / 2);
  }
  DIFUSE_HD static constexpr int lane_delta(int o) { return o == 16 || o == 1 ? 0 : o / 2; }
  DIFUSE_HD static constexpr int partner_slot(int o, int j) { return o == 16 ? j + 2 : o == 1 ? j + 1 : j; }
  DIFUSE_HD static constexpr bool receives(int o, int j) { return o == 1 ? j == 0 : j < 2; }
};

// Push aten vector `k` (the thread's k-th, 0-based) of 4 elements: counts 4k+1 .. 4k+4.
DIFUSE_HD num::VecWelford push_vec4(num::VecWelford s, int k, float x0, float x1, float x2, float x3) {
  s = num::vec_welford_push(s, x0, num::rcp_of_count(4 * k + 1));
  s = num::vec_welford_push(s, x1, num::rcp_of_count(4 * k + 2));
  s = num::vec_welford_push(s, x2, num::rcp_of_count(4 * k + 3));
  s = num::vec_welford_push(s, x3, num::rcp_of_count(4 * k + 4));
  return s;
}

struct RowStats {
  float mean;
  float rstd;
};

// aten's intra-warp tree with equal-count combines. Thread t pushes ceil((V - t) / 128) vectors: `sweeps` =
// ceil(V / 128) for t < r = V % 128 (all threads where r == 0), one fewer for the others. Where r is a multiple of 32
// (V % 32 == 0) that boundary falls between warps, so inside each aten warp every thread holds the same count and every
// combine of its tree has equal sides: aten warps w < long_warps hold 4 x sweeps at the leaves, the others
// 4 x (sweeps - 1). V >= 128: no thread holds nothing (equal_combine_weights(0) is NaN where the general combine of two
// empty states is 0). The cross-warp combines (finalize_roots) stay general: their sides differ where r != 0.
struct WarpEqualCounts {
  int sweeps;      // vectors of the threads of warps below long_warps
  int long_warps;  // 4 where V % 128 == 0 (every combine of the tree equal)
};
DIFUSE_HD constexpr bool warp_equal_counts(int v) { return v >= kAtenThreads && v % kAtenWarp == 0; }
DIFUSE_HD constexpr WarpEqualCounts warp_equal_counts_of(int v) {
  return WarpEqualCounts{(v + kAtenThreads - 1) / kAtenThreads,
                         v % kAtenThreads == 0 ? kAtenThreads / kAtenWarp : (v % kAtenThreads) / kAtenWarp};
}
// The leaf count (4 x its vectors) of aten warp w's threads.
DIFUSE_HD constexpr int warp_leaf_count(WarpEqualCounts c, int w) {
  return kVecElems * (w < c.long_warps ? c.sweeps : c.sweeps - 1);
}

// The cross-warp combines (0, 2), (1, 3), then (02, 13) where the warps' counts are known (warp_equal_counts): which
// of them have equal sides, and their weights. Every width that is a multiple of 512 has all three equal.
struct RootCombines {
  int eq02, eq13, eq;  // 1: that combine's sides hold equal counts
  num::EqualCombineWeights w02, w13, w;
};
DIFUSE_HD RootCombines root_combines(WarpEqualCounts c) {
  const float n0 = static_cast<float>(warp_leaf_count(c, 0) * kAtenWarp), n1 = static_cast<float>(warp_leaf_count(c, 1) * kAtenWarp),
              n2 = static_cast<float>(warp_leaf_count(c, 2) * kAtenWarp), n3 = static_cast<float>(warp_leaf_count(c, 3) * kAtenWarp);
  RootCombines r{};
  r.eq02 = n0 == n2;
  r.eq13 = n1 == n3;
  r.eq = n0 + n2 == n1 + n3;
  r.w02 = num::equal_combine_weights(n0);
  r.w13 = num::equal_combine_weights(n1);
  r.w = num::equal_combine_weights(n0 + n2);
  return r;
}
// One of finalize_roots' cross-warp combines: aten's general one, or where its sides are equal (rc below)
// num::vec_welford_combine_equal (no reciprocal on the row's serial path): the same operations on the same values,
// so the same bits (tests/cpu: the schedules' emulation).
DIFUSE_HD num::VecWelford combine_roots(int equal, num::VecWelford a, num::VecWelford b, num::EqualCombineWeights w) {
  if (!equal) return num::vec_welford_combine(a, b);
  b.count = w.count;
  return num::vec_welford_combine_equal(a, b, w);
}
// Warp roots w0..w3 (aten threads 0, 32, 64, 96 after their warp trees) -> mean, rstd: combines (0, 2), (1, 3), then
// (02, 13), each equal-sided one of rc without a reciprocal; var = div(sigma2, (float)N) (an IEEE division by N, not
// by the count); rstd = rsqrtf(RN(var + eps)).
DIFUSE_HD RowStats finalize_roots(const num::VecWelford* roots, int n, float eps, const RootCombines& rc) {
  const num::VecWelford r02 = combine_roots(rc.eq02, roots[0], roots[2], rc.w02);
  const num::VecWelford r13 = combine_roots(rc.eq13, roots[1], roots[3], rc.w13);
  const num::VecWelford r = combine_roots(rc.eq, r02, r13, rc.w);
  const float var = num::div_rn(r.sigma2, static_cast<float>(n));
  return RowStats{r.mean, num::rsqrt_cuda(num::add_rn(var, eps))};
}
// aten's finalize: every cross-warp combine general.
DIFUSE_HD RowStats finalize_roots(const num::VecWelford* roots, int n, float eps) {
  return finalize_roots(roots, n, eps, RootCombines{});
}

// One output element of  F.layer_norm(x) * (1 + scale) + shift  in bf16, with a rounding after every
// eager op:  n = bf16(RN(rstd * RN(x - mean)));  a = bf16(RN(scale + 1));  u = bf16(RN(n * a));
//            out = bf16(RN(u + shift)).  Inputs are the fp32 widenings of the bf16 operands.
DIFUSE_HD float layernorm_modulate_value(float x, RowStats st, float scale, float shift) {
  const float n = num::round_bf16(num::mul_rn(st.rstd, num::sub_rn(x, st.mean)));
  const float a = num::round_bf16(num::add_rn(scale, 1.0f));
  const float u = num::round_bf16(num::mul_rn(n, a));
  return num::add_rn(u, shift);  // the caller rounds to bf16 at the store
}

// Wan's fp32 modulation (FP32LayerNorm + fp32 scale/shift rows): one bf16 rounding, at the end:
//   t = RN(rstd * RN(x - mean));  out = bf16(RN(RN(t * RN(scale + 1)) + shift))   (no fma between them)
DIFUSE_HD float layernorm_modulate_f32_value(float x, RowStats st, float scale, float shift) {
  const float t = num::mul_rn(st.rstd, num::sub_rn(x, st.mean));
  return num::add_rn(num::mul_rn(t, num::add_rn(scale, 1.0f)), shift);
}

// layernorm_modulate_f32_value with a = RN(scale + 1) already formed (a block that stages its fp32 scale rows forms
// it once per column): the same operations on the same values.
DIFUSE_HD float layernorm_modulate_f32_value_a(float x, RowStats st, float a, float shift) {
  const float t = num::mul_rn(st.rstd, num::sub_rn(x, st.mean));
  return num::add_rn(num::mul_rn(t, a), shift);
}

// FP32LayerNorm with fp32 weight and bias (Wan's norm2): fma(w, t, b), as aten's vectorized kernel
// contracts gamma * t + beta; one bf16 rounding at the end (.type_as).
DIFUSE_HD float layernorm_affine_f32_value(float x, RowStats st, float w, float b) {
  return num::fma_rn(w, num::mul_rn(st.rstd, num::sub_rn(x, st.mean)), b);
}

// Two adjacent output elements at once, the form the kernels run: x2, scale2 and shift2 hold two bf16 each.
// Same bits as layernorm_modulate_value on each element (the bf16x2 add/mul equal the eager fp32 op
// followed by a bf16 rounding: numerics/bf16.h), with one conversion per two elements.
DIFUSE_HD uint32_t layernorm_modulate_pair(uint32_t x2, RowStats st, uint32_t scale2, uint32_t shift2) {
  const float t0 = num::mul_rn(st.rstd, num::sub_rn(num::bf16_lo(x2), st.mean));
  const float t1 = num::mul_rn(st.rstd, num::sub_rn(num::bf16_hi(x2), st.mean));
  const uint32_t n2 = num::pack_bf16x2(t0, t1);
  const uint32_t a2 = num::bf16x2_add_rn(scale2, num::kBf16x2One);
  return num::bf16x2_add_rn(num::bf16x2_mul_rn(n2, a2), shift2);
}

// layernorm_modulate_pair with a2 = bf16(RN(1 + scale)) already formed (num::bf16x2_add_rn(scale2, kBf16x2One)),
// as a block that stages its scale rows forms it once per column: the same operations on the same values.
DIFUSE_HD uint32_t layernorm_modulate_pair_a(uint32_t x2, RowStats st, uint32_t a2, uint32_t shift2) {
  const float t0 = num::mul_rn(st.rstd, num::sub_rn(num::bf16_lo(x2), st.mean));
  const float t1 = num::mul_rn(st.rstd, num::sub_rn(num::bf16_hi(x2), st.mean));
  return num::bf16x2_add_rn(num::bf16x2_mul_rn(num::pack_bf16x2(t0, t1), a2), shift2);
}

// ---- the same kernel with rms_norm = true (F.rms_norm / torch.nn.RMSNorm, aten's fused RMS path) ----------
// Per thread s = fma(v, v, s) over the same elements in the same order; tree steps s = RN(s + s_in) with the
// same offsets and warp pairs; ms = div(s, (float)N); rstd = rsqrtf(RN(ms + eps)).
DIFUSE_HD float rms_push_vec4(float s, float x0, float x1, float x2, float x3) {
  s = num::fma_rn(x0, x0, s);
  s = num::fma_rn(x1, x1, s);
  s = num::fma_rn(x2, x2, s);
  return num::fma_rn(x3, x3, s);
}

DIFUSE_HD float rms_combine(float own, float in) { return num::add_rn(own, in); }

// Warp roots w0..w3 -> rstd. inv_n_pow2: 1/n when n is a power of two, else 0 (num::div_by_width_rn: the same
// bits as aten's division, one multiply instead of the division sequence).
DIFUSE_HD float rms_finalize_roots(const float* roots, int n, float eps, float inv_n_pow2 = 0.0f) {
  const float s = rms_combine(rms_combine(roots[0], roots[2]), rms_combine(roots[1], roots[3]));
  return num::rsqrt_cuda(num::add_rn(num::div_by_width_rn(s, static_cast<float>(n), inv_n_pow2), eps));
}

// Two output elements: bf16(RN(w * RN(rstd * x))), or bf16(RN(rstd * x)) without a weight.
DIFUSE_HD uint32_t rms_norm_pair(uint32_t x2, float rstd, bool has_weight, uint32_t w2) {
  float y0 = num::mul_rn(rstd, num::bf16_lo(x2));
  float y1 = num::mul_rn(rstd, num::bf16_hi(x2));
  if (has_weight) {
    y0 = num::mul_rn(num::bf16_lo(w2), y0);
    y1 = num::mul_rn(num::bf16_hi(w2), y1);
  }
  return num::pack_bf16x2(y0, y1);
}

}  // namespace difuse::norm
