// difuse/numerics/welford.h — Welford updates in the exact operand order of torch 2.11's CUDA kernels.
//
// Two flavours exist in aten and they round differently (shared/reference/torch-2.11-numerics.md §1):
//
// 1. The vectorized LayerNorm / fused RMSNorm kernel (`vectorized_layer_norm_kernel`, cuWelfordOnlineSum
//    and cuWelfordCombine): state (mean, sigma2, count) all fp32; a push multiplies by the correctly
//    rounded reciprocal of the new count; both updates are FFMA. `VecWelford` below.
// 2. `WelfordOps` (RowwiseMoments, GroupNorm): int64 count, true division, separate add for the mean.
//    `OpsWelford` below.
#pragma once

#include "difuse/numerics/fp32.h"

namespace difuse::num {

// ---- flavour 1: vectorized LayerNorm ----------------------------------------------------------------
struct VecWelford {
  float mean = 0.f;
  float sigma2 = 0.f;
  float count = 0.f;
};

// Push v into s. `rcp_new_count` must be rcp_rn(s.count + 1) (aten: `1.f / count` after the increment);
// kernels that know the count at compile time pass rcp_of_count(k).
//   d = RN(v - mean); count' = RN(count + 1); mean' = fma(d, rcp(count'), mean);
//   sigma2' = fma(d, RN(v - mean'), sigma2)
DIFUSE_HD VecWelford vec_welford_push(VecWelford s, float v, float rcp_new_count) {
  const float d = sub_rn(v, s.mean);
  VecWelford r;
  r.count = add_rn(s.count, 1.0f);
  r.mean = fma_rn(d, rcp_new_count, s.mean);
  r.sigma2 = fma_rn(d, sub_rn(v, r.mean), s.sigma2);
  return r;
}

// The same push without the count's add: for kernels whose pushes are a known prefix of a row, which set the count
// once afterwards (4 x the vectors pushed: the counts are small integers, so every RN(count + 1) is exact and the
// result is the same bits as vec_welford_push's). mean and sigma2 are computed exactly as there.
DIFUSE_HD VecWelford vec_welford_push_uncounted(VecWelford s, float v, float rcp_new_count) {
  const float d = sub_rn(v, s.mean);
  VecWelford r;
  r.count = s.count;
  r.mean = fma_rn(d, rcp_new_count, s.mean);
  r.sigma2 = fma_rn(d, sub_rn(v, r.mean), s.sigma2);
  return r;
}

DIFUSE_HD VecWelford vec_welford_push(VecWelford s, float v) {
  return vec_welford_push(s, v, rcp_rn(add_rn(s.count, 1.0f)));
}

// cuWelfordCombine(B = own, A = incoming), literally (no shortcut when one side is empty: B.count *
// rcp(B.count) need not be exactly 1):
//   delta = RN(B.mean - A.mean); cnt = RN(A.count + B.count)
//   cnt > 0: coef = rcp(cnt); nA = RN(A.count*coef); nB = RN(B.count*coef)
//            mean = fma(nA, A.mean, RN(nB*B.mean)); sigma2 = fma(nB, RN(RN(delta*delta)*A.count), RN(A.sigma2+B.sigma2))
//   else     mean = 0, sigma2 = 0
// The 2.11 SASS tests `cnt > 0` as `B.count > -A.count`; equivalent for these integer-valued counts.
DIFUSE_HD VecWelford vec_welford_combine(VecWelford own, VecWelford in) {
  const float delta = sub_rn(own.mean, in.mean);
  const float cnt = add_rn(in.count, own.count);
  VecWelford r;
  r.count = cnt;
  if (own.count > -in.count) {
    const float coef = rcp_rn(cnt);
    const float n_in = mul_rn(in.count, coef);
    const float n_own = mul_rn(own.count, coef);
    r.mean = fma_rn(n_in, in.mean, mul_rn(n_own, own.mean));
    r.sigma2 = fma_rn(n_own, mul_rn(mul_rn(delta, delta), in.count), add_rn(in.sigma2, own.sigma2));
  } else {
    r.mean = 0.f;
    r.sigma2 = 0.f;
  }
  return r;
}

// cuWelfordCombine of two states that both hold `count` elements (> 0), as aten's intra-warp tree combines them
// when every thread pushed the same number of elements (a row width that is a multiple of 512: every level's two
// sides are equal). `w` comes from equal_combine_weights(count), computed once per level (by the host or at compile
// time): the same operations on the same values as vec_welford_combine, so the same bits, without the reciprocal
// and the count's arithmetic in each thread. tests/cpu/test_numerics.cpp compares the two.
struct EqualCombineWeights {
  float count;  // each side's count
  float n;      // RN(count * rcp(RN(count + count))): vec_welford_combine's n_in and n_own
};
DIFUSE_HD EqualCombineWeights equal_combine_weights(float count) {
  return EqualCombineWeights{count, mul_rn(count, rcp_rn(add_rn(count, count)))};
}
DIFUSE_HD VecWelford vec_welford_combine_equal(VecWelford own, VecWelford in, EqualCombineWeights w) {
  const float delta = sub_rn(own.mean, in.mean);
  VecWelford r;
  r.count = add_rn(w.count, w.count);
  r.mean = fma_rn(w.n, in.mean, mul_rn(w.n, own.mean));
  r.sigma2 = fma_rn(w.n, mul_rn(mul_rn(delta, delta), w.count), add_rn(in.sigma2, own.sigma2));
  return r;
}

// ---- flavour 2: WelfordOps<float, float, int64_t, pair> (correction 0) --------------------------------
struct OpsWelford {
  float mean = 0.f;
  float m2 = 0.f;
  int64_t n = 0;
  float nf = 0.f;
};

//   n += 1; nf = (float)n; d = RN(v - mean); mean = RN(mean + div(d, nf)); m2 = fma(d, RN(v - mean), m2)
DIFUSE_HD OpsWelford ops_welford_push(OpsWelford s, float v) {
  OpsWelford r;
  r.n = s.n + 1;
  r.nf = static_cast<float>(r.n);
  const float d = sub_rn(v, s.mean);
  r.mean = add_rn(s.mean, div_rn(d, r.nf));
  r.m2 = fma_rn(d, sub_rn(v, r.mean), s.m2);
  return r;
}

// combine(a = own, b = incoming): empty sides return the other unchanged;
//   d = RN(b.mean - a.mean); nf = RN(a.nf + b.nf); r = div(b.nf, nf)
//   mean = fma(d, r, a.mean); m2 = fma(RN(RN(d*d) * a.nf), r, RN(a.m2 + b.m2))
DIFUSE_HD OpsWelford ops_welford_combine(OpsWelford a, OpsWelford b) {
  if (a.nf == 0.f) return b;
  if (b.nf == 0.f) return a;
  const float d = sub_rn(b.mean, a.mean);
  const float nf = add_rn(a.nf, b.nf);
  const float r = div_rn(b.nf, nf);
  OpsWelford o;
  o.mean = fma_rn(d, r, a.mean);
  o.m2 = fma_rn(mul_rn(mul_rn(d, d), a.nf), r, add_rn(a.m2, b.m2));
  o.n = a.n + b.n;
  o.nf = nf;
  return o;
}

}  // namespace difuse::num
