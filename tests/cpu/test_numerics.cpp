// Host twins of the rounding primitives: bf16 RNE (ties, NaN, inf, subnormals, signed zero), the
// uncontracted fp32 ops, the compile-time reciprocal and both Welford flavours.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <cstring>
#include <random>
#include <vector>

#include "difuse/numerics/bf16.h"
#include "difuse/numerics/welford.h"

using namespace difuse::num;

namespace {
uint16_t b16(uint32_t fbits) { return float_to_bf16_rne(float_from_bits(fbits)); }
}  // namespace

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(b16(0x3F800000u), 0x3F80);  // 1.0
  EXPECT_EQ(b16(0x3F808000u), 0x3F80);  // exact tie, even below
  EXPECT_EQ(b16(0x3F818000u), 0x3F82);  // exact tie, even above
  EXPECT_EQ(b16(0x3F808001u), 0x3F81);  // just above the tie
  EXPECT_EQ(b16(0x3F807FFFu), 0x3F80);  // just below the tie
  EXPECT_EQ(b16(0xBF818000u), 0xBF82);  // negative tie
}

TEST(Bf16, InfinityAndOverflow) {
  EXPECT_EQ(b16(0x7F800000u), 0x7F80);
  EXPECT_EQ(b16(0xFF800000u), 0xFF80);
  EXPECT_EQ(b16(0x7F7FFFFFu), 0x7F80);  // FLT_MAX rounds up to +inf
  EXPECT_EQ(b16(0x7F7F7FFFu), 0x7F7F);  // largest value that stays finite
  EXPECT_EQ(b16(0xFF7FFFFFu), 0xFF80);
}

TEST(Bf16, NaNBecomesCanonical) {
  for (uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FBFFFFFu})
    EXPECT_EQ(b16(bits), 0x7FFF) << std::hex << bits;
}

TEST(Bf16, SubnormalsAndSignedZero) {
  EXPECT_EQ(b16(0x00000000u), 0x0000);
  EXPECT_EQ(b16(0x80000000u), 0x8000);  // -0 keeps its sign
  EXPECT_EQ(b16(0x00010000u), 0x0001);  // smallest bf16 subnormal is kept (no flush)
  EXPECT_EQ(b16(0x00008000u), 0x0000);  // tie to even (down)
  EXPECT_EQ(b16(0x00018000u), 0x0002);  // tie to even (up)
  EXPECT_EQ(b16(0x00000001u), 0x0000);
  EXPECT_EQ(b16(0x80008001u), 0x8001);
  EXPECT_EQ(b16(0x007FFFFFu), 0x0080);  // largest fp32 subnormal rounds to FLT_MIN's bf16
}

TEST(Bf16, WideningRoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_EQ(float_to_bf16_rne(f), 0x7FFF);
    } else {
      ASSERT_EQ(float_to_bf16_rne(f), b) << b;
    }
  }
}

TEST(Bf16, PackKeepsElementOrder) {
  const uint32_t w = pack_bf16x2(1.0f, -2.0f);
  EXPECT_EQ(w & 0xFFFFu, 0x3F80u);
  EXPECT_EQ(w >> 16, 0xC000u);
  EXPECT_EQ(bf16_lo(w), 1.0f);
  EXPECT_EQ(bf16_hi(w), -2.0f);
}

TEST(Fp32, OperationsRoundOnceEach) {
  // (1 + 2^-23) * (1 - 2^-23) - 1: the product rounds to 1, so mul then sub gives 0 while an fma keeps -2^-46.
  const float a = 1.0f + std::ldexp(1.0f, -23), b = 1.0f - std::ldexp(1.0f, -23);
  EXPECT_EQ(sub_rn(mul_rn(a, b), 1.0f), 0.0f);
  EXPECT_EQ(fma_rn(a, b, -1.0f), -std::ldexp(1.0f, -46));
  EXPECT_EQ(div_rn(1.0f, 3.0f), 1.0f / 3.0f);
  EXPECT_EQ(rcp_rn(3.0f), div_rn(1.0f, 3.0f));
}

TEST(Fp32, DivisionByAPowerOfTwoWidthIsTheMultiply) {
  // div_by_width_rn must give div_rn's bits for every fp32 input: sampled bit patterns over all exponents
  // (subnormal results and underflow to zero included), the specials, and every power-of-two width.
  EXPECT_EQ(inv_pow2_or_zero(128), 1.0f / 128.0f);
  EXPECT_EQ(inv_pow2_or_zero(1), 1.0f);
  for (long long n : {0LL, -4LL, 3LL, 96LL, 3072LL, 5120LL}) EXPECT_EQ(inv_pow2_or_zero(n), 0.0f) << n;
  const auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; };
  std::vector<float> xs = {0.0f, -0.0f, INFINITY, -INFINITY, std::ldexp(1.0f, -149), std::ldexp(1.0f, -126),
                           std::numeric_limits<float>::max(), 3.0f, 1e-38f};
  uint32_t state = 12345u;
  for (int i = 0; i < 400000; ++i) {
    state = state * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &state, 4);
    if (!std::isnan(f)) xs.push_back(f);
  }
  for (int e = 0; e <= 20; ++e) {
    const long long n = 1LL << e;
    const float inv = inv_pow2_or_zero(n);
    ASSERT_NE(inv, 0.0f);
    for (float x : xs)
      ASSERT_EQ(bits(div_by_width_rn(x, static_cast<float>(n), inv)), bits(div_rn(x, static_cast<float>(n))))
          << x << " / " << n;
  }
  for (float x : xs)  // widths that are not powers of two divide
    ASSERT_EQ(bits(div_by_width_rn(x, 3072.0f, inv_pow2_or_zero(3072))), bits(div_rn(x, 3072.0f))) << x;
  EXPECT_TRUE(std::isnan(div_by_width_rn(NAN, 128.0f, 1.0f / 128.0f)));
}

TEST(Fp32, CompileTimeReciprocalMatchesRuntime) {
  static_assert(rcp_of_count(1) == 1.0f, "rcp(1)");
  constexpr float r3 = rcp_of_count(3);
  EXPECT_EQ(r3, rcp_rn(3.0f));
  for (int k = 1; k <= 1 << 17; ++k) ASSERT_EQ(rcp_of_count(k), rcp_rn(static_cast<float>(k))) << k;
}

TEST(Welford, VectorizedPushMatchesFormula) {
  VecWelford s;
  for (float v : {1.f, 2.f, 3.f, 4.f}) s = vec_welford_push(s, v);
  EXPECT_EQ(s.count, 4.f);
  EXPECT_EQ(s.mean, 2.5f);
  EXPECT_EQ(s.sigma2, 5.0f);  // sum of squared deviations
  // The reciprocal variant with a precomputed count is the same operation.
  VecWelford a, b;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(3.f, 2.f);
  for (int k = 1; k <= 200; ++k) {
    const float v = nd(rng);
    a = vec_welford_push(a, v);
    b = vec_welford_push(b, v, rcp_of_count(k));
    ASSERT_EQ(float_bits(a.mean), float_bits(b.mean));
    ASSERT_EQ(float_bits(a.sigma2), float_bits(b.sigma2));
  }
}

TEST(Welford, UncountedPushesWithTheCountSetAfterwardAreTheSameBits) {
  // layernorm_modulate_rows pushes a row's prefix without the count's add and sets count = 4 x vectors after.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(-1.f, 30.f);
  for (int n : {1, 4, 24, 96, 6144}) {
    VecWelford a, b;
    for (int k = 1; k <= n; ++k) {
      const float v = nd(rng);
      a = vec_welford_push(a, v, rcp_of_count(k));
      b = vec_welford_push_uncounted(b, v, rcp_of_count(k));
    }
    b.count = static_cast<float>(n);
    ASSERT_EQ(float_bits(a.count), float_bits(b.count)) << n;
    ASSERT_EQ(float_bits(a.mean), float_bits(b.mean)) << n;
    ASSERT_EQ(float_bits(a.sigma2), float_bits(b.sigma2)) << n;
    const VecWelford other = vec_welford_push(VecWelford{}, 5.f);
    const VecWelford ca = vec_welford_combine(a, other), cb = vec_welford_combine(b, other);
    ASSERT_EQ(float_bits(ca.mean), float_bits(cb.mean)) << n;
    ASSERT_EQ(float_bits(ca.sigma2), float_bits(cb.sigma2)) << n;
  }
}

TEST(Welford, EqualCountCombineIsTheSameBits) {
  // GRLN's streamed rows combine equal-count states with weights computed once per tree level (widths that are
  // multiples of 512): the same bits as the general combine, for every leaf count a row up to 24576 gives (4 x its
  // sweeps, 1..48) at every level of aten's tree (x 1..32), with spread, huge and tiny states and NaN.
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ex(-60, 60);
  int checked = 0;
  for (int sweeps = 1; sweeps <= 48; ++sweeps) {
    for (int level = 0; level <= 5; ++level) {
      const float c = static_cast<float>(4 * sweeps << level);
      const EqualCombineWeights w = equal_combine_weights(c);
      for (int t = 0; t < 200; ++t) {
        const float s = std::ldexp(1.f, ex(rng));
        VecWelford a{nd(rng) * s, std::fabs(nd(rng)) * s * s, c}, b{nd(rng) * s, std::fabs(nd(rng)) * s * s, c};
        if (t == 0) b.mean = std::numeric_limits<float>::quiet_NaN();
        if (t == 1) a.mean = b.mean;
        const VecWelford r = vec_welford_combine(a, b), e = vec_welford_combine_equal(a, b, w);
        ASSERT_EQ(float_bits(r.count), float_bits(e.count)) << c;
        ASSERT_EQ(float_bits(r.mean), float_bits(e.mean)) << c << " " << t;
        ASSERT_EQ(float_bits(r.sigma2), float_bits(e.sigma2)) << c << " " << t;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 48 * 6 * 200);
}

TEST(Welford, CombineWithEmptySideIsNotAShortcut) {
  // k * rcp(k) is not always exactly 1 in fp32, so combining with an empty state can change the mean:
  // aten does not special-case it and neither may we.
  int k_off = 0;
  for (int k = 1; k < 4096 && !k_off; ++k)
    if (mul_rn(static_cast<float>(k), rcp_rn(static_cast<float>(k))) != 1.0f) k_off = k;
  ASSERT_GT(k_off, 0);
  VecWelford own{0.7f, 3.0f, static_cast<float>(k_off)}, empty{};
  const VecWelford r = vec_welford_combine(own, empty);
  const float n_own = mul_rn(own.count, rcp_rn(own.count));
  EXPECT_EQ(float_bits(r.mean), float_bits(fma_rn(0.f, 0.f, mul_rn(n_own, own.mean))));
  EXPECT_NE(float_bits(r.mean), float_bits(own.mean));
  EXPECT_EQ(r.count, own.count);
  // Both sides empty: aten writes zeros.
  const VecWelford z = vec_welford_combine(empty, empty);
  EXPECT_EQ(z.mean, 0.f);
  EXPECT_EQ(z.sigma2, 0.f);
  EXPECT_EQ(z.count, 0.f);
}

TEST(Welford, CombineOfHalvesApproximatesWholeRow) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(-1.f, 4.f);
  VecWelford left, right, whole;
  std::vector<float> xs(256);
  for (auto& v : xs) v = nd(rng);
  for (int i = 0; i < 128; ++i) left = vec_welford_push(left, xs[i]);
  for (int i = 128; i < 256; ++i) right = vec_welford_push(right, xs[i]);
  for (float v : xs) whole = vec_welford_push(whole, v);
  const VecWelford c = vec_welford_combine(left, right);
  EXPECT_EQ(c.count, 256.f);
  EXPECT_NEAR(c.mean, whole.mean, 1e-5);
  EXPECT_NEAR(c.sigma2 / 256.f, whole.sigma2 / 256.f, 1e-3);
}

TEST(Welford, OpsFlavourPushAndCombine) {
  OpsWelford a, b, w;
  std::vector<double> xs;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ud(-3.f, 5.f);
  for (int i = 0; i < 1000; ++i) {
    const float v = ud(rng);
    xs.push_back(v);
    (i % 2 ? a : b) = ops_welford_push(i % 2 ? a : b, v);
    w = ops_welford_push(w, v);
  }
  double mean = 0, m2 = 0;
  for (double v : xs) mean += v;
  mean /= xs.size();
  for (double v : xs) m2 += (v - mean) * (v - mean);
  const OpsWelford c = ops_welford_combine(a, b);
  EXPECT_EQ(c.n, 1000);
  EXPECT_NEAR(c.mean, mean, 1e-5);
  EXPECT_NEAR(c.m2 / 1000, m2 / 1000, 1e-3);
  EXPECT_NEAR(w.m2 / 1000, m2 / 1000, 1e-3);
  // Empty sides return the other operand unchanged (WelfordOps::combine's early returns).
  const OpsWelford e;
  EXPECT_EQ(float_bits(ops_welford_combine(e, a).mean), float_bits(a.mean));
  EXPECT_EQ(float_bits(ops_welford_combine(a, e).m2), float_bits(a.m2));
}

namespace {
double as_double(uint16_t b) { return static_cast<double>(bf16_to_float(b)); }
uint16_t random_bf16(std::mt19937& rng) {
  for (;;) {
    const uint16_t b = static_cast<uint16_t>(rng());
    if ((b & 0x7F80) != 0x7F80) return b;  // finite
  }
}
}  // namespace

// The claim numerics/bf16.h makes for bf16x2_add_rn: bf16(RN32(a + b)) is the correctly rounded bf16 sum,
// because the fp32 sum is exact unless the smaller operand is below a quarter bf16 ulp of the larger.
TEST(Bf16x2, AddOfTwoBf16RoundsOnceInEffect) {
  std::mt19937 rng(2026);
  int64_t inexact = 0;
  for (int i = 0; i < 4000000; ++i) {
    uint16_t a = random_bf16(rng), b = random_bf16(rng);
    if (i % 2) b = static_cast<uint16_t>((a & 0x8000) ^ ((a & 0x7F80) - ((rng() % 24) << 7)) ^ (rng() & 0x807F));
    if ((b & 0x7F80) == 0x7F80) continue;
    const double exact = as_double(a) + as_double(b);  // exact: |exponent difference| < 2^7 << 53 bits
    const float f32 = add_rn(bf16_to_float(a), bf16_to_float(b));
    if (static_cast<double>(f32) == exact) continue;  // no fp32 rounding: one bf16 rounding, trivially
    if (std::isinf(f32)) {  // overflow: the exact sum is beyond bf16's range too, both give that infinity
      ASSERT_GE(std::fabs(exact), std::ldexp(1.0, 128) * (1.0 - std::ldexp(1.0, -25)));
      continue;
    }
    ++inexact;
    const bool a_larger = std::fabs(as_double(a)) >= std::fabs(as_double(b));
    const uint16_t large = a_larger ? a : b;
    const double small = std::fabs(as_double(a_larger ? b : a));
    int e;
    std::frexp(as_double(large), &e);  // |large| in [2^(e-1), 2^e): bf16 ulp 2^(e-8)
    ASSERT_LT(small, std::ldexp(1.0, e - 10)) << std::hex << a << " " << b;  // below a quarter ulp
    ASSERT_EQ(float_to_bf16_rne(f32), large) << std::hex << a << " " << b;
  }
  EXPECT_GT(inexact, 0);  // the structured half reaches the rounding case
}

// bf16x2_mul_rn's claim, on the products layernorm_modulate forms: n (any bf16) times bf16(1 + scale)
// (any bf16 scale) is exact in fp32, so the hardware's single rounding equals the eager fp32 mul + bf16.
TEST(Bf16x2, ModulationProductsAreExactInFp32) {
  std::mt19937 rng(7);
  for (int i = 0; i < 512; ++i) {
    const uint16_t s = random_bf16(rng);
    const float a = round_bf16(add_rn(bf16_to_float(s), 1.0f));
    for (uint32_t n = 0; n < 65536; ++n) {
      if ((n & 0x7F80) == 0x7F80) continue;
      const double exact = as_double(static_cast<uint16_t>(n)) * static_cast<double>(a);
      if (std::fabs(exact) > 3.0e38) continue;  // overflows to inf either way
      ASSERT_EQ(static_cast<double>(mul_rn(bf16_to_float(static_cast<uint16_t>(n)), a)), exact)
          << std::hex << n << " " << s;
    }
  }
}

TEST(Bf16x2, HostTwinsAreTheEagerFormula) {
  const uint32_t a = pack_bf16x2(1.5f, -2.0f), b = pack_bf16x2(0.25f, 3.0f);
  EXPECT_EQ(bf16x2_add_rn(a, b), pack_bf16x2(1.75f, 1.0f));
  EXPECT_EQ(bf16x2_mul_rn(a, b), pack_bf16x2(0.375f, -6.0f));
  EXPECT_EQ(bf16x2_add_rn(pack_bf16x2(-0.0f, -0.0f), pack_bf16x2(-0.0f, 0.0f)), pack_bf16x2(-0.0f, 0.0f));
}

#include "modulate/gated_residual_pair.h"

// Wan's fp32-gate pair is the scalar chain on each half: bf16(RN(f(h) + RN(f(a) * g))), element 0 in the low half.
TEST(Bf16x2, GatedResidualFp32PairIsTheScalarChainPerHalf) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> gd(-3.0f, 3.0f);
  for (int i = 0; i < 200000; ++i) {
    const uint16_t h0 = random_bf16(rng), h1 = random_bf16(rng), a0 = random_bf16(rng), a1 = random_bf16(rng);
    const float g0 = i % 7 ? gd(rng) : std::ldexp(gd(rng), -120), g1 = gd(rng);
    const uint32_t got = difuse::modulate::gated_residual_fp32_pair(h0 | (uint32_t{h1} << 16),
                                                                    a0 | (uint32_t{a1} << 16), g0, g1);
    const uint16_t lo = float_to_bf16_rne(add_rn(bf16_to_float(h0), mul_rn(bf16_to_float(a0), g0)));
    const uint16_t hi = float_to_bf16_rne(add_rn(bf16_to_float(h1), mul_rn(bf16_to_float(a1), g1)));
    ASSERT_EQ(got, lo | (uint32_t{hi} << 16)) << i;
  }
}

#include "difuse/numerics/activation.h"

TEST(Activation, GeluTanhHostTwinIsCloseToTheDefinition) {
  // The host twin's tanh is std::tanh (libdevice's tanhf only exists on the device), so this checks the
  // formula and constants, not bits: the GPU tests compare every bf16 input with torch.
  for (float x : {-8.f, -3.f, -1.f, -0.5f, 0.f, 0.25f, 1.f, 2.f, 6.f}) {
    const double ref = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(gelu_tanh(x), ref, 1e-6 + 1e-6 * std::fabs(ref)) << x;
  }
  EXPECT_EQ(float_bits(gelu_tanh(-0.f)), float_bits(-0.f * 0.5f * 1.f));
  EXPECT_EQ(kGeluBeta, static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5));
  EXPECT_EQ(kGeluKappa, 0.044715f);
}

// ---- RoPE (numerics/rope.h) ---------------------------------------------------------------------------------
#include "difuse/numerics/rope.h"

TEST(Rope, InterleavedPairRoundsEachProductThenTheSum) {
  // Values chosen so that x0*c0 and x1*s0 are inexact in fp32: a fused multiply-add would differ.
  const float x0 = difuse::num::bf16_to_float(0x3f81), x1 = difuse::num::bf16_to_float(0xbfa3);  // 1.0078125, -1.2734375
  const float c0 = 0.7071067690849304f, s0 = 0.7071067094802856f, c1 = 0.3333333432674408f, s1 = 0.9428090453147888f;
  float o0, o1;
  difuse::num::rope_interleaved_pair(x0, x1, c0, s0, c1, s1, o0, o1);
  volatile float p00 = x0 * c0, p01 = -x1 * s0, p10 = x1 * c1, p11 = x0 * s1;  // one rounding each
  volatile float e0 = p00 + p01, e1 = p10 + p11;
  EXPECT_EQ(difuse::num::float_bits(o0), difuse::num::float_bits(e0));
  EXPECT_EQ(difuse::num::float_bits(o1), difuse::num::float_bits(e1));
  // and they are not what one rounding of the exact expression gives for at least one of these inputs
  const double exact0 = static_cast<double>(x0) * c0 - static_cast<double>(x1) * s0;
  const double exact1 = static_cast<double>(x1) * c1 + static_cast<double>(x0) * s1;
  EXPECT_TRUE(difuse::num::float_bits(static_cast<float>(exact0)) != difuse::num::float_bits(o0) ||
              difuse::num::float_bits(static_cast<float>(exact1)) != difuse::num::float_bits(o1));
}

TEST(Rope, SignOfZeroFollowsTheNegatedOperand) {
  // x = (+0, +0), s0 = 1: element 0 is RN(+0 * c0) + RN(-0 * 1) = +0 + -0 = +0; with c0 = -1 it is -0 + -0 = -0.
  float o0, o1;
  difuse::num::rope_interleaved_pair(0.f, 0.f, -1.f, 1.f, 1.f, 1.f, o0, o1);
  EXPECT_EQ(difuse::num::float_bits(o0), 0x80000000u);
  EXPECT_EQ(difuse::num::float_bits(o1), 0u);
  difuse::num::rope_interleaved_pair(0.f, 0.f, 1.f, 1.f, 1.f, 1.f, o0, o1);
  EXPECT_EQ(difuse::num::float_bits(o0), 0u);
}

TEST(Rope, Bf16x2PacksElementZeroLow) {
  const uint32_t x2 = 0x40003f80u;  // x0 = 1, x1 = 2
  const uint32_t r = difuse::num::rope_interleaved_bf16x2(x2, 1.f, 0.f, 0.f, 1.f);  // o0 = 1*1 + -2*0 = 1, o1 = 2*0 + 1*1 = 1
  EXPECT_EQ(r & 0xffffu, 0x3f80u);
  EXPECT_EQ(r >> 16, 0x3f80u);
  EXPECT_EQ(difuse::num::rope_interleaved_bf16x2(x2, 0.f, 1.f, 1.f, 0.f), (0x4000u << 16) | 0xc000u);  // (-2, 2)
}

// Wan's apply_rotary_emb: x1 * cos - x2 * sin, x1 * sin + x2 * cos, each product and the sum rounded on its own.
TEST(Rope, WanPairIsTheProcessorsOpsInOrder) {
  const float x0 = difuse::num::bf16_to_float(0x3f81), x1 = difuse::num::bf16_to_float(0xbfa3);
  const float c = 0.7071067690849304f, s = 0.9428090453147888f;
  float o0, o1;
  difuse::num::rope_wan_pair(x0, x1, c, s, o0, o1);
  volatile float a = x0 * c, b = x1 * s, d = x0 * s, e = x1 * c;  // one rounding each
  volatile float r0 = a - b, r1 = d + e;
  EXPECT_EQ(difuse::num::float_bits(o0), difuse::num::float_bits(r0));
  EXPECT_EQ(difuse::num::float_bits(o1), difuse::num::float_bits(r1));
  // signed zeros: -0 - +0 = -0, +0 - -0 = +0, -0 + -0 = -0, -0 - -0 = +0 (round to nearest)
  difuse::num::rope_wan_pair(-0.f, 0.f, 1.f, 1.f, o0, o1);
  EXPECT_EQ(difuse::num::float_bits(o0), 0x80000000u);
  EXPECT_EQ(difuse::num::float_bits(o1), 0u);
  difuse::num::rope_wan_pair(-0.f, -0.f, 1.f, 1.f, o0, o1);
  EXPECT_EQ(difuse::num::float_bits(o0), 0u);
  EXPECT_EQ(difuse::num::float_bits(o1), 0x80000000u);
}

// "FLUX and Wan RoPE are bitwise identical given the same tables": Wan's (c, s) = (cos[2i], sin[2i + 1]) in FLUX's
// form (c0, s0, c1, s1) = (c, s, c, s) gives the same fp32 bits for every finite or infinite operand (zeros of both
// signs included) and the same bf16 bits for every operand (NaN included: both round to the canonical NaN).
TEST(Rope, WanPairEqualsTheFluxFormWithItsTableEntries) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  const auto next = [&state] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  const float specials[] = {0.f, -0.f, 1.f, -1.f, 1e-40f, -1e-40f, 3e38f, -3e38f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  const auto pick_x = [&](uint64_t r) {  // a bf16 value: random bits, or a special one
    return (r & 7) == 0 ? difuse::num::round_bf16(specials[(r >> 3) % 11])
                        : difuse::num::bf16_to_float(static_cast<uint16_t>(r >> 16));
  };
  const auto pick_t = [&](uint64_t r) {  // an fp32 table entry: mostly in [-1, 1], sometimes special
    return (r & 15) == 0 ? specials[(r >> 4) % 11]
                         : static_cast<float>(static_cast<int64_t>(r >> 20) % 2000001 - 1000000) * 1e-6f;
  };
  for (int it = 0; it < 200000; ++it) {
    const float x0 = pick_x(next()), x1 = pick_x(next()), c = pick_t(next()), s = pick_t(next());
    float w0, w1, f0, f1;
    difuse::num::rope_wan_pair(x0, x1, c, s, w0, w1);
    difuse::num::rope_interleaved_pair(x0, x1, c, s, c, s, f0, f1);
    if (!std::isnan(w0) || !std::isnan(f0)) {
      ASSERT_EQ(difuse::num::float_bits(w0), difuse::num::float_bits(f0)) << it;
    }
    if (!std::isnan(w1) || !std::isnan(f1)) {
      ASSERT_EQ(difuse::num::float_bits(w1), difuse::num::float_bits(f1)) << it;
    }
    const uint32_t x2 = difuse::num::pack_bf16x2(x0, x1);
    ASSERT_EQ(difuse::num::rope_wan_bf16x2(x2, c, s), difuse::num::rope_interleaved_bf16x2(x2, c, s, c, s)) << it;
  }
}

// ERNIE-Image's rotate-half RoPE: rope_rotate_half_pair against the eager chain emulated tensor by tensor on a whole
// row (each op's output stored as bf16): x * cos, -x2, cat(-x2, x1), rotated * sin, the sum. The emulation keeps
// the eager indexing (chunk, cat), so a wrong partner, sign or table entry in the pair form shows as a mismatch.
TEST(Rope, RotateHalfPairIsTheErnieChainOpByOp) {
  std::mt19937 rng(20261205);
  const float specials[] = {0.f, -0.f, 1.f, -1.f, 1e-40f, -1e-40f, 3e38f, -3e38f, 1e-30f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  const auto bf = [](float f) { return float_to_bf16_rne(f); };
  const auto fl = [](uint16_t b) { return bf16_to_float(b); };
  for (int R : {2, 6, 16, 128}) {
    const int h = R / 2;
    for (int it = 0; it < 2000; ++it) {
      std::vector<uint16_t> x(R), c(R), s(R);
      for (int i = 0; i < R; ++i) {
        const uint32_t r = rng();
        x[i] = (r & 7) == 0 ? bf(specials[(r >> 3) % 12]) : static_cast<uint16_t>(r >> 16);
        const float angle = static_cast<float>(rng() % 100000) * 0.01f;
        c[i] = (r & 63) == 1 ? bf(specials[(r >> 8) % 12]) : bf(std::cos(angle));
        s[i] = (r & 63) == 2 ? bf(specials[(r >> 9) % 12]) : bf(std::sin(angle));
      }
      std::vector<uint16_t> t1(R), rotated(R), t2(R), want(R);
      for (int i = 0; i < R; ++i) t1[i] = bf(mul_rn(fl(x[i]), fl(c[i])));
      for (int j = 0; j < h; ++j) {
        rotated[j] = bf(-fl(x[h + j]));  // torch.cat((-x2, x1))
        rotated[h + j] = x[j];
      }
      for (int i = 0; i < R; ++i) t2[i] = bf(mul_rn(fl(rotated[i]), fl(s[i])));
      for (int i = 0; i < R; ++i) want[i] = bf(add_rn(fl(t1[i]), fl(t2[i])));
      for (int i = 0; i < h; ++i) {
        float oa, ob;
        rope_rotate_half_pair(fl(x[i]), fl(x[i + h]), fl(c[i]), fl(s[i]), fl(c[i + h]), fl(s[i + h]), oa, ob);
        ASSERT_EQ(bf(oa), want[i]) << "R " << R << " i " << i << " it " << it;
        ASSERT_EQ(bf(ob), want[i + h]) << "R " << R << " i " << i + h << " it " << it;
      }
    }
  }
  // A zero product takes its sign from the negated operand: x[i+h] = +0 gives -0 * s = -0, and +0 + -0 = +0.
  float oa, ob;
  rope_rotate_half_pair(0.f, 0.f, 1.f, 1.f, 1.f, 1.f, oa, ob);
  EXPECT_EQ(float_bits(oa), 0u);
  rope_rotate_half_pair(-0.f, 0.f, 1.f, 1.f, 1.f, 1.f, oa, ob);
  EXPECT_EQ(float_bits(oa), 0x80000000u);  // (-0) * 1 + (-(+0)) * 1 = -0 + -0 = -0
  EXPECT_EQ(float_bits(ob), 0u);           // (+0) * 1 + (-0) * 1 = +0 + -0 = +0
}

// activation_mul's product: one fp32 multiply of two bf16 values (exact unless it falls below fp32's normal range),
// rounded once more to bf16 by the kernel, as aten's bf16 MulFunctor<float>.
TEST(Activation, GatedProductIsOneFp32Multiply) {
  std::mt19937 rng(7);
  for (int it = 0; it < 100000; ++it) {
    const float a = bf16_to_float(static_cast<uint16_t>(rng())), b = bf16_to_float(static_cast<uint16_t>(rng()));
    volatile float want = a * b;
    const float got = gated_product(a, b);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(float_bits(got), float_bits(want)) << a << " * " << b;
    }
  }
}
