// qk_norm_rope_qwen and qk_norm_sd35 on the host: PyTorch's contracted complex multiply (numerics/rope.h) against
// exact arithmetic and its near misses, the kernels' per-head lane map of aten's mean (norm/diffusers_head_norm.h)
// against a transcription of Reduce.cuh's loops, and both predicates (the site shapes pass; every violated
// precondition is listed). Fake device addresses: predicates never touch memory.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "difuse/difuse.hpp"
#include "difuse/numerics/rope.h"
#include "norm/diffusers_head_norm.h"
#include "norm/rms_norm_diffusers.h"

using difuse::DType;
using difuse::TensorView;
using namespace difuse::num;

namespace {

void* fake(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

bool mentions(const difuse::Support& s, const std::string& needle) {
  for (const auto& r : s.reasons)
    if (r.find(needle) != std::string::npos) return true;
  return false;
}

std::string all(const difuse::Support& s) {
  std::string o;
  for (const auto& r : s.reasons) o += "\n  " + r;
  return o;
}

// The exact value of x rounded once to fp32 (ties to even), through binary128 (exact for these operands: two
// products of 24-bit significands and their sum stay within 113 bits when the exponents are close, as asserted).
float round_once(__float128 x) { return static_cast<float>(x); }

uint16_t random_bf16(std::mt19937& rng, int kind) {
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  std::normal_distribution<float> nd(0.f, 1.f);
  switch (kind % 4) {
    case 0: return static_cast<uint16_t>(bits(rng));  // any pattern: NaN, inf, subnormals, +-0
    case 1: return float_to_bf16_rne(nd(rng));
    case 2: return float_to_bf16_rne(nd(rng) * 1e-38f);
    default: return float_to_bf16_rne(nd(rng) * 1e30f);
  }
}

}  // namespace

// ---- numerics/rope.h: the complex multiply of apply_rotary_emb_qwen ------------------------------------------------
TEST(QwenComplexRope, ReIsOneRoundingOfACMinusRoundedBD) {
  // re = fma(a, c, -RN(b d)), im = fma(a, d, RN(b c)): the FFMA rounds a c + t once, t already rounded.
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ang(-3.2f, 3.2f);
  for (int i = 0; i < 200000; ++i) {
    const float a = round_bf16(nd(rng) * 3.f), b = round_bf16(nd(rng) * 3.f);
    const float t = ang(rng), c = std::cos(t), d = std::sin(t);
    float re, im;
    complex_mul_torch(a, b, c, d, re, im);
    const float bd = mul_rn(b, d), bc = mul_rn(b, c);
    const __float128 exact_re = static_cast<__float128>(a) * c - static_cast<__float128>(bd);
    const __float128 exact_im = static_cast<__float128>(a) * d + static_cast<__float128>(bc);
    ASSERT_EQ(float_bits(re), float_bits(round_once(exact_re))) << a << " " << b << " " << c << " " << d;
    ASSERT_EQ(float_bits(im), float_bits(round_once(exact_im))) << a << " " << b << " " << c << " " << d;
  }
}

TEST(QwenComplexRope, TheNearMissesRoundDifferently) {
  // What the GPU tests would catch if the formula were wrong: the uncontracted product, the other contraction of
  // each part, and the operands swapped (freqs * x) all differ from torch's form on random Qwen-like inputs, often
  // in fp32 and (rarely, ~1e-5 of elements, so the GPU tests' millions of elements see them) after the bf16 store.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ang(-3.2f, 3.2f);
  const int n = 2000000;
  int64_t f32[4] = {0, 0, 0, 0}, b16[4] = {0, 0, 0, 0}, swapped_re = 0;
  for (int i = 0; i < n; ++i) {
    const float a = round_bf16(nd(rng)), b = round_bf16(nd(rng));
    const float t = ang(rng), c = std::cos(t), d = std::sin(t);
    float re, im;
    complex_mul_torch(a, b, c, d, re, im);
    float sre, sim;
    complex_mul_torch(c, d, a, b, sre, sim);  // freqs * x
    const float alt[4][2] = {
        {sub_rn(mul_rn(a, c), mul_rn(b, d)), add_rn(mul_rn(a, d), mul_rn(b, c))},  // no contraction
        {fma_rn(-b, d, mul_rn(a, c)), im},                                          // re contracted the other way
        {re, fma_rn(b, c, mul_rn(a, d))},                                           // im contracted the other way
        {sre, sim}};                                                                // operands swapped
    for (int k = 0; k < 4; ++k) {
      f32[k] += float_bits(alt[k][0]) != float_bits(re) || float_bits(alt[k][1]) != float_bits(im);
      b16[k] += float_to_bf16_rne(alt[k][0]) != float_to_bf16_rne(re) ||
                float_to_bf16_rne(alt[k][1]) != float_to_bf16_rne(im);
    }
    swapped_re += float_bits(sre) != float_bits(re);
  }
  for (int k = 0; k < 4; ++k) {
    EXPECT_GT(f32[k], n / 100) << "variant " << k;
    EXPECT_GT(b16[k], 0) << "variant " << k;
  }
  EXPECT_EQ(swapped_re, 0);  // fma(a, c, -RN(b d)) is symmetric in (a, b) <-> (c, d)
}

TEST(QwenComplexRope, PackedPairIsRealPartLowImaginaryPartHigh) {
  std::mt19937 rng(9);
  for (int i = 0; i < 300000; ++i) {
    const uint16_t x0 = random_bf16(rng, i), x1 = random_bf16(rng, i + 1);
    const float c = bf16_to_float(random_bf16(rng, i + 2)), d = bf16_to_float(random_bf16(rng, i + 3));
    const uint32_t r = rope_complex_bf16x2(x0 | (uint32_t{x1} << 16), c, d);
    float re, im;
    complex_mul_torch(bf16_to_float(x0), bf16_to_float(x1), c, d, re, im);
    ASSERT_EQ(r & 0xFFFFu, float_to_bf16_rne(re)) << i;
    ASSERT_EQ(r >> 16, float_to_bf16_rne(im)) << i;
  }
  // Signed zeros: (+0 + -0 i) * (1 + 0i) = +0 + (+0) i in the contracted form (fma(0, 1, -(-0 * 0)) = +0).
  float re, im;
  complex_mul_torch(0.f, -0.f, 1.f, 0.f, re, im);
  EXPECT_EQ(float_bits(re), 0u);
  EXPECT_EQ(float_bits(im), 0u);
  complex_mul_torch(-0.f, 0.f, 1.f, -0.f, re, im);  // re = -0 * 1 + -(0 * -0) = -0 + +0 = +0
  EXPECT_EQ(float_bits(re), 0u);
}

// ---- norm/diffusers_head_norm.h: the per-head lane map --------------------------------------------------------------
namespace {

// Reduce.cuh's per-thread loops for one row of n <= 128 elements with block (32, 16) (as in
// test_rms_norm_modulate.cpp), then the shuffle-down tree: lane 0's sum.
float aten_row_sum(const std::vector<float>& row) {
  const int n = static_cast<int>(row.size());
  float lane_value[32];
  for (int x = 0; x < 32; ++x) {
    float vl[4] = {0.f, 0.f, 0.f, 0.f};
    auto sq = [&](int i) { return mul_rn(row[i], row[i]); };
    if (n >= 128) {  // input_vectorized_thread_reduce_impl, aligned rows
      for (int idx = x; idx * 4 + 3 < n; idx += 32)
        for (int i = 0; i < 4; ++i) vl[i] = add_rn(vl[i], sq(idx * 4 + i));
    } else {  // thread_reduce_impl, vt0 = 4
      int idx = x;
      while (idx + 3 * 32 < n) {
        for (int i = 0; i < 4; ++i) vl[i] = add_rn(vl[i], sq(idx + i * 32));
        idx += 4 * 32;
      }
      for (int i = 0; i < 4 && idx < n; ++i, idx += 32) vl[i] = add_rn(vl[i], sq(idx));
    }
    for (int i = 1; i < 4; ++i) vl[0] = add_rn(vl[0], vl[i]);
    lane_value[x] = vl[0];
  }
  for (int o = 16; o >= 1; o /= 2) {
    float in[32];
    for (int x = 0; x < 32; ++x) in[x] = lane_value[x + o < 32 ? x + o : x];
    for (int x = 0; x < 32; ++x) lane_value[x] = add_rn(lane_value[x], in[x]);
  }
  return lane_value[0];
}

// The kernels' composition: lane l holds the run [E l, E l + E) (zeros past the row); head_mean_lane_total takes
// aten's elements from the runs (the host fetch reads the lane's run where the device shuffles), then the tree.
template <int E>
float kernel_row_sum(const std::vector<uint16_t>& row) {
  using namespace difuse::norm;
  const int d = static_cast<int>(row.size());
  HeadRun<E> runs[32];
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < E / 2; ++j) {
      const int e = E * l + 2 * j;
      const uint32_t lo = e < d ? row[e] : 0u, hi = e + 1 < d ? row[e + 1] : 0u;
      runs[l].w[j] = lo | (hi << 16);
    }
  float lanes[kMeanLanes];
  for (int l = 0; l < 32; ++l)
    lanes[l] = head_mean_lane_total<E>(l, d, runs[l], [&](int src, int pos) { return run_elem(runs[src & 31], pos); });
  return mean_tree_host(lanes);
}

// The half-warp composition for 64-element rows (qk_norm_sd35_half_warp64): span lane u holds elements u, u + 16,
// u + 32, u + 48 (or, with consecutive = true, a wrong map for the negative test: 4u .. 4u + 3);
// head64_span_lane_sum, then the steps 8..1 over 16 lanes (a shuffle past the span reads the lane's own value):
// lane 0's sum.
float half_warp64_row_sum(const std::vector<float>& rf, bool consecutive = false) {
  float v[16];
  for (int u = 0; u < 16; ++u) {
    float x[4];
    for (int j = 0; j < 4; ++j) x[j] = rf[consecutive ? 4 * u + j : u + 16 * j];
    v[u] = difuse::norm::head64_span_lane_sum(x);
  }
  for (int o = 8; o >= 1; o /= 2)
    for (int u = 0; u < 16; ++u) v[u] = difuse::norm::mean_tree_step(v[u], v[u + o < 16 ? u + o : u]);
  return v[0];
}

}  // namespace

TEST(DiffusersHeadNorm, HalfWarp64MapReplaysAtensLoopsBitForBit) {
  std::mt19937 rng(64);
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<uint16_t> row(64);
    std::vector<float> rf(64);
    const int kind = trial % 6;
    for (int i = 0; i < 64; ++i) {
      row[i] = kind == 4 ? float_to_bf16_rne(1.0f + 0.001f * i)
               : kind == 5 ? float_to_bf16_rne(std::ldexp(1.0f, (i * 37) % 120 - 60))  // wide exponent spread
                           : random_bf16(rng, kind == 0 ? 1 : kind);
      if (kind == 0 && i % 7 == 3) row[i] = random_bf16(rng, 0);  // any pattern (NaN, inf, +-0)
      rf[i] = bf16_to_float(row[i]);
    }
    const float a = aten_row_sum(rf);
    const float h = half_warp64_row_sum(rf);
    // NaN rows: aten's sum and ours are both NaN (the device canonicalizes; the host keeps payloads).
    if (std::isnan(a)) {
      ASSERT_TRUE(std::isnan(h)) << trial;
      continue;
    }
    ASSERT_EQ(float_bits(a), float_bits(h)) << "trial " << trial;
  }
}

TEST(DiffusersHeadNorm, HalfWarp64OrderIsNotASequentialSum) {
  // The half-warp map must follow aten's tree: a different pairing (consecutive runs per lane) differs on some
  // rows, so the test above can fail.
  std::mt19937 rng(65);
  int differ = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<float> rf(64);
    for (int i = 0; i < 64; ++i) rf[i] = bf16_to_float(random_bf16(rng, 1));
    differ += float_bits(half_warp64_row_sum(rf, true)) != float_bits(aten_row_sum(rf));
  }
  EXPECT_GT(differ, 50);
}

TEST(DiffusersHeadNorm, ButterflyLeavesTheDownTreesLaneZeroBitsInEveryLane) {
  // qk_norm_sd35's LEAN kernel reduces a span's 16 lane sums by xor shuffles instead of the shuffle-down tree and
  // its broadcast (norm::span16_rstd<R, true>): every lane must end with the bits the tree leaves in lane 0, for
  // sums of squares of any size (the argument is commutativity, so every value pattern is drawn; a NaN lane only
  // needs a NaN result: the device's NaN is canonical, the host keeps payloads).
  using difuse::norm::mean_butterfly_host;
  using difuse::norm::mean_down_tree_lane0_host;
  std::mt19937 rng(66);
  for (int trial = 0; trial < 20000; ++trial) {
    float lanes[16];
    const int kind = trial % 6;
    for (int u = 0; u < 16; ++u) {
      const float x = kind == 5 ? std::ldexp(1.0f, (u * 37 + trial) % 250 - 125) : bf16_to_float(random_bf16(rng, kind));
      lanes[u] = x * x;
    }
    const float tree = mean_down_tree_lane0_host(lanes);
    float all[16];
    mean_butterfly_host(lanes, all);
    for (int u = 0; u < 16; ++u) {
      if (std::isnan(tree)) {
        ASSERT_TRUE(std::isnan(all[u])) << "trial " << trial << " lane " << u;
        continue;
      }
      ASSERT_EQ(float_bits(all[u]), float_bits(tree)) << "trial " << trial << " lane " << u;
    }
  }
}

TEST(DiffusersHeadNorm, AButterflyInAnotherStepOrderDiffers) {
  // The same butterfly with its offsets ascending (1..8: adjacent lanes first) pairs the partial sums differently
  // and differs from the down tree on some rows, so the test above can fail.
  using difuse::norm::mean_down_tree_lane0_host;
  using difuse::norm::mean_tree_step;
  std::mt19937 rng(67);
  int differ = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    float v[16];
    for (int u = 0; u < 16; ++u) {
      const float x = bf16_to_float(random_bf16(rng, 1));
      v[u] = x * x;
    }
    const float tree = mean_down_tree_lane0_host(v);
    for (int o = 1; o <= 8; o *= 2) {
      float before[16];
      for (int u = 0; u < 16; ++u) before[u] = v[u];
      for (int u = 0; u < 16; ++u) v[u] = mean_tree_step(before[u], before[u ^ o]);
    }
    differ += float_bits(v[0]) != float_bits(tree);
  }
  EXPECT_GT(differ, 50);
}

TEST(DiffusersHeadNorm, LaneMapReplaysAtensLoopsBitForBit) {
  std::mt19937 rng(23);
  int widths = 0;
  for (int d = 32; d <= 128; d += 2) {
    if (d > 64 && d % 4) continue;
    ++widths;
    ASSERT_EQ(difuse::norm::head_lane_elems(d), d > 64 ? 4 : 2);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<uint16_t> row(d);
      std::vector<float> rf(d);
      const int kind = trial % 5;
      for (int i = 0; i < d; ++i) {
        row[i] = kind == 4 ? float_to_bf16_rne(1.0f + 0.001f * i) : random_bf16(rng, kind == 0 ? 1 : kind);
        if (kind == 0 && i % 7 == 3) row[i] = random_bf16(rng, 0);  // sprinkle any pattern (NaN, inf, +-0)
        rf[i] = bf16_to_float(row[i]);
      }
      const float a = aten_row_sum(rf);
      const float k = d > 64 ? kernel_row_sum<4>(row) : kernel_row_sum<2>(row);
      // NaN rows: both NaN. The payload is the host's (x86 keeps the first operand's, and the host compiler may
      // swap a commutative add's operands, as the H200 machine's did); the device canonicalizes NaN.
      if (std::isnan(a)) {
        ASSERT_TRUE(std::isnan(k)) << "d " << d << " trial " << trial;
        continue;
      }
      ASSERT_EQ(float_bits(a), float_bits(k)) << "d " << d << " trial " << trial;
    }
  }
  EXPECT_EQ(widths, 17 + 16);
}

TEST(DiffusersHeadNorm, OrderMattersSoTheMapIsTested) {
  // A plain left-to-right sum differs from aten's order on some rows: the lane map test above is not vacuous.
  std::mt19937 rng(2);
  int differ = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<float> rf(128);
    std::vector<uint16_t> row(128);
    for (int i = 0; i < 128; ++i) row[i] = random_bf16(rng, 1), rf[i] = bf16_to_float(row[i]);
    float s = 0.f;
    for (float v : rf) s = add_rn(s, mul_rn(v, v));
    differ += float_bits(s) != float_bits(aten_row_sum(rf));
  }
  EXPECT_GT(differ, 100);
}

TEST(DiffusersHeadNorm, NormRunIsTheElementChain) {
  using namespace difuse::norm;
  std::mt19937 rng(31);
  for (int i = 0; i < 200000; ++i) {
    HeadRun<4> x, w;
    for (auto& v : x.w) v = random_bf16(rng, i) | (uint32_t{random_bf16(rng, i + 1)} << 16);
    for (auto& v : w.w) v = random_bf16(rng, i + 2) | (uint32_t{random_bf16(rng, i + 3)} << 16);
    const float rstd = std::ldexp(1.0f + (i % 97) / 97.f, i % 41 - 20);
    const bool has_w = i % 3 != 0;
    const HeadRun<4> y = diffusers_norm_run<4>(x, rstd, has_w, w);
    for (int pos = 0; pos < 4; ++pos) {
      const float xe = run_elem(x, pos), we = run_elem(w, pos);
      const float yb = round_bf16(mul_rn(xe, rstd));
      const float want = has_w ? round_bf16(mul_rn(yb, we)) : yb;
      ASSERT_EQ(float_to_bf16_rne(run_elem(y, pos)), float_to_bf16_rne(want)) << i << " " << pos;
    }
  }
}

TEST(DiffusersHeadNorm, MeanFactorIsPerNormInput) {
  // Qwen-Image at 1024^2, batch 1: the image norms see 4096 * 24 rows, the text norms 512 * 24; both factors are
  // exactly 1/128 there, and the host forms (float)rows / (float)(rows * D) for each.
  EXPECT_EQ(difuse::norm::diffusers_mean_factor(4096 * 24, 128), 1.0f / 128);
  EXPECT_EQ(difuse::norm::diffusers_mean_factor(2 * 333 * 38, 64), 1.0f / 64);
  // Past 2^24 elements the int64 numel is rounded to float first: not RN(1/N) in general.
  const int64_t rows = (int64_t{1} << 24) + 3;
  EXPECT_EQ(difuse::norm::diffusers_mean_factor(rows, 100),
            static_cast<float>(rows) / static_cast<float>(rows * 100));
}

// ---- predicates: qk_norm_rope_qwen ----------------------------------------------------------------------------------
namespace {

struct QwenCase {
  TensorView q, k, v, qt, kt, vt, wq, wk, wqt, wkt, f, ft, oq, ok, ov;
  difuse_qk_norm_rope_qwen_args args() const {
    difuse_qk_norm_rope_qwen_args a{};
    a.q = &q, a.k = &k, a.v = &v, a.q_weight = &wq, a.k_weight = &wk;
    a.q_txt = &qt, a.k_txt = &kt, a.v_txt = &vt, a.q_txt_weight = &wqt, a.k_txt_weight = &wkt;
    a.freqs = &f, a.freqs_txt = &ft, a.q_out = &oq, a.k_out = &ok, a.v_out = &ov, a.eps = 1e-6;
    return a;
  }
};

// Qwen-Image at 1024^2: image q, k, v the unflattened to_q/to_k/to_v outputs [B, 4096, 24, 128] (or the chunks
// of a fused projection), text [B, S_txt, 24, 128]; img_freqs a contiguous [4096, 64] complex64 table and
// txt_freqs a row slice of QwenEmbedRope's pos_freqs [4096, 64] (an offset), both viewed as fp32 pairs.
QwenCase qwen_case(int64_t B = 1, int64_t S1 = 512, int64_t S2 = 4096, bool fused = false, int64_t H = 24,
                   int64_t D = 128) {
  const int64_t W = H * D;
  QwenCase c;
  if (fused) {
    const uintptr_t img = 0x100000000ull;
    c.q = TensorView(fake(img), DType::BF16, {B, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
    c.k = TensorView(fake(img + 2 * W), DType::BF16, {B, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
    c.v = TensorView(fake(img + 4 * W), DType::BF16, {B, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
  } else {
    c.q = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, S2, H, D}, 0);
    c.k = TensorView::contiguous(fake(0x110000000ull), DType::BF16, {B, S2, H, D}, 0);
    c.v = TensorView::contiguous(fake(0x120000000ull), DType::BF16, {B, S2, H, D}, 0);
  }
  c.qt = TensorView::contiguous(fake(0x200000000ull), DType::BF16, {B, S1, H, D}, 0);
  c.kt = TensorView::contiguous(fake(0x210000000ull), DType::BF16, {B, S1, H, D}, 0);
  c.vt = TensorView::contiguous(fake(0x220000000ull), DType::BF16, {B, S1, H, D}, 0);
  c.wq = TensorView::contiguous(fake(0x300000000ull), DType::BF16, {D}, 0);
  c.wk = TensorView::contiguous(fake(0x300001000ull), DType::BF16, {D}, 0);
  c.wqt = TensorView::contiguous(fake(0x300002000ull), DType::BF16, {D}, 0);
  c.wkt = TensorView::contiguous(fake(0x300003000ull), DType::BF16, {D}, 0);
  c.f = TensorView::contiguous(fake(0x400000000ull), DType::F32, {S2, D}, 0);
  c.ft = TensorView(fake(0x410000000ull + 64 * 8 * 64), DType::F32, {S1, D}, {D, 1}, 0);  // pos_freqs[64:64+S1]
  c.oq = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, S1 + S2, H, D}, 0);
  c.ok = TensorView::contiguous(fake(0x1100000000ull), DType::BF16, {B, S1 + S2, H, D}, 0);
  c.ov = TensorView::contiguous(fake(0x1200000000ull), DType::BF16, {B, S1 + S2, H, D}, 0);
  return c;
}

}  // namespace

TEST(QkNormRopeQwen, AcceptsTheQwenImageSites) {
  for (int64_t B : {1, 2})
    for (int64_t S1 : {512, 77, 7, 1})
      for (bool fused : {false, true}) {
        const QwenCase c = qwen_case(B, S1, 4096, fused);
        const auto s = difuse::can_use_qk_norm_rope_qwen(c.args());
        EXPECT_TRUE(s.ok) << "B " << B << " S_txt " << S1 << " fused " << fused << all(s);
      }
  // no weights, no RoPE
  QwenCase c = qwen_case(1, 33, 1024);
  auto a = c.args();
  a.q_weight = a.k_weight = a.q_txt_weight = a.k_txt_weight = a.freqs = a.freqs_txt = nullptr;
  EXPECT_TRUE(difuse::can_use_qk_norm_rope_qwen(a).ok) << difuse_last_error();
  // narrower heads: 64 (runs of 2), 96 (runs of 4, non-vectorized mean), 32, 34
  for (int64_t D : {64, 96, 32, 34, 124}) {
    const QwenCase n = qwen_case(1, 20, 300, false, 4, D);
    EXPECT_TRUE(difuse::can_use_qk_norm_rope_qwen(n.args()).ok) << D << " " << difuse_last_error();
  }
}

TEST(QkNormRopeQwen, ListsEveryViolation) {
  QwenCase c = qwen_case();
  c.wq = TensorView::contiguous(fake(0x300000000ull), DType::F32, {128}, 0);            // fp32 weight
  c.f = TensorView::contiguous(fake(0x400000000ull), DType::F32, {4608, 128}, 0);       // joint-length table
  c.ft = TensorView(fake(0x410000004ull), DType::F32, {512, 128}, {129, 1}, 0);         // odd stride, misaligned
  c.ok = c.oq;                                                                          // outputs overlap
  auto a = c.args();
  a.v_txt = nullptr;
  const auto s = difuse::can_use_qk_norm_rope_qwen(a);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "v_txt is required")) << all(s);
  // the shape comparisons stop at a missing tensor: check the rest with v_txt present
  const auto s2 = difuse::can_use_qk_norm_rope_qwen(c.args());
  ASSERT_FALSE(s2.ok);
  EXPECT_TRUE(mentions(s2, "q_weight must be bf16")) << all(s2);
  EXPECT_TRUE(mentions(s2, "freqs must be complex64 [4096, 64]")) << all(s2);
  EXPECT_TRUE(mentions(s2, "freqs_txt rows must be contiguous pairs with an even")) << all(s2);
  EXPECT_TRUE(mentions(s2, "freqs_txt must be 8-byte aligned")) << all(s2);
  EXPECT_TRUE(mentions(s2, "q_out, k_out and v_out overlap")) << all(s2);
  EXPECT_GE(s2.reasons.size(), 5u);
}

TEST(QkNormRopeQwen, RefusesTheUnreplayedShapes) {
  // 3 text rows (B 1, 3 tokens, 1 head): aten's mean would take another block shape.
  QwenCase few = qwen_case(1, 3, 300, false, 1, 128);
  auto s = difuse::can_use_qk_norm_rope_qwen(few.args());
  EXPECT_TRUE(mentions(s, "the text stream's norms see 3 rows")) << all(s);
  // head_dim 256, 30 and 66 (not a multiple of 4 above 64)
  for (int64_t D : {256, 30, 66}) {
    QwenCase w = qwen_case(1, 16, 64, false, 2, D);
    EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope_qwen(w.args()), "head_dim must be in [32, 128]")) << D;
  }
  // rows not aligned to a lane's run: a 2-byte offset, and a token stride of 3 * 128 + 2
  QwenCase m = qwen_case();
  m.q.data = fake(0x100000002ull);
  m.k = TensorView(fake(0x110000000ull), DType::BF16, {1, 4096, 24, 128}, {4096 * 3074, 3074, 128, 1}, 0);
  s = difuse::can_use_qk_norm_rope_qwen(m.args());
  EXPECT_TRUE(mentions(s, "q rows must be 8-byte aligned")) << all(s);
  EXPECT_TRUE(mentions(s, "k rows must be 8-byte aligned")) << all(s);
  // one table without the other; a text stream with other heads
  QwenCase o = qwen_case();
  auto a = o.args();
  a.freqs_txt = nullptr;
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope_qwen(a), "freqs and freqs_txt must be given together"));
  o.qt = TensorView::contiguous(fake(0x200000000ull), DType::BF16, {1, 512, 12, 128}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope_qwen(o.args()), "q_txt, k_txt and v_txt must be [1, S_txt, 24"));
  // host tensors, a missing output
  QwenCase h = qwen_case();
  h.q.device = -1;
  auto b = h.args();
  b.v_out = nullptr;
  s = difuse::can_use_qk_norm_rope_qwen(b);
  EXPECT_TRUE(mentions(s, "q must be on a CUDA device")) << all(s);
  EXPECT_TRUE(mentions(s, "v_out is required")) << all(s);
  // the launcher refuses with the same list and touches nothing
  try {
    difuse::qk_norm_rope_qwen(few.args());
    FAIL() << "launched";
  } catch (const difuse::Unsupported& e) {
    EXPECT_FALSE(e.reasons().empty());
  }
  EXPECT_EQ(difuse_can_use_qk_norm_rope_qwen(nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
}

// ---- predicates: qk_norm_sd35 ---------------------------------------------------------------------------------------
namespace {

struct Sd35Case {
  TensorView q, k, v, qc, kc, vc, wq, wk, wqc, wkc, oq, ok, ov;
  difuse_qk_norm_sd35_args args() const {
    difuse_qk_norm_sd35_args a{};
    a.q = &q, a.k = &k, a.v = &v, a.q_weight = &wq, a.k_weight = &wk;
    a.q_ctx = &qc, a.k_ctx = &kc, a.v_ctx = &vc, a.q_ctx_weight = &wqc, a.k_ctx_weight = &wkc;
    a.q_out = &oq, a.k_out = &ok, a.v_out = &ov, a.eps = 1e-6;
    return a;
  }
};

// The transposed view of a [B, S, H * D] projection output viewed [B, S, H, D]: [B, H, S, D] with strides
// (S H D, D, H D, 1).
TensorView bhsd(uintptr_t addr, int64_t B, int64_t H, int64_t S, int64_t D, int64_t row = 0) {
  const int64_t W = row ? row : H * D;
  return TensorView(fake(addr), DType::BF16, {B, H, S, D}, {S * W, D, W, 1}, 0);
}

// SD3.5-large: 38 heads of 64, image 4096 tokens at 1024^2, context 333 (77 CLIP + 256 T5); CFG as batch 2.
Sd35Case sd35_case(int64_t B = 2, int64_t S1 = 4096, int64_t S2 = 333, int64_t H = 38, int64_t D = 64) {
  Sd35Case c;
  c.q = bhsd(0x100000000ull, B, H, S1, D);
  c.k = bhsd(0x110000000ull, B, H, S1, D);
  c.v = bhsd(0x120000000ull, B, H, S1, D);
  c.qc = bhsd(0x200000000ull, B, H, S2, D);
  c.kc = bhsd(0x210000000ull, B, H, S2, D);
  c.vc = bhsd(0x220000000ull, B, H, S2, D);
  c.wq = TensorView::contiguous(fake(0x300000000ull), DType::BF16, {D}, 0);
  c.wk = TensorView::contiguous(fake(0x300001000ull), DType::BF16, {D}, 0);
  c.wqc = TensorView::contiguous(fake(0x300002000ull), DType::BF16, {D}, 0);
  c.wkc = TensorView::contiguous(fake(0x300003000ull), DType::BF16, {D}, 0);
  c.oq = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, H, S1 + S2, D}, 0);
  c.ok = TensorView::contiguous(fake(0x1100000000ull), DType::BF16, {B, H, S1 + S2, D}, 0);
  c.ov = TensorView::contiguous(fake(0x1200000000ull), DType::BF16, {B, H, S1 + S2, D}, 0);
  return c;
}

}  // namespace

TEST(QkNormSd35, AcceptsTheSd35Sites) {
  for (int64_t B : {1, 2})
    for (int64_t S2 : {333, 77, 1}) {
      const Sd35Case c = sd35_case(B, 4096, S2);
      const auto s = difuse::can_use_qk_norm_sd35(c.args());
      EXPECT_TRUE(s.ok) << B << " " << S2 << all(s);
    }
  // fused projections: chunks of a [B, S, 3 * 2432] output, then viewed and transposed
  Sd35Case f = sd35_case(1);
  f.q = bhsd(0x100000000ull, 1, 38, 4096, 64, 3 * 2432);
  f.k = bhsd(0x100000000ull + 2 * 2432, 1, 38, 4096, 64, 3 * 2432);
  f.v = bhsd(0x100000000ull + 4 * 2432, 1, 38, 4096, 64, 3 * 2432);
  EXPECT_TRUE(difuse::can_use_qk_norm_sd35(f.args()).ok) << difuse_last_error();
  // SD3.5-medium (24 heads of 64), no weights
  Sd35Case m = sd35_case(2, 4096, 333, 24);
  auto a = m.args();
  a.q_weight = a.k_weight = a.q_ctx_weight = a.k_ctx_weight = nullptr;
  EXPECT_TRUE(difuse::can_use_qk_norm_sd35(a).ok) << difuse_last_error();
}

TEST(QkNormSd35, ListsEveryViolation) {
  Sd35Case c = sd35_case();
  c.wkc = TensorView::contiguous(fake(0x300003000ull), DType::BF16, {128}, 0);  // wrong width
  c.q = bhsd(0x100000002ull, 2, 38, 4096, 64);                                // 2-byte aligned rows
  c.ov = TensorView::contiguous(fake(0x1200000000ull), DType::BF16, {2, 4429, 38, 64}, 0);  // BSHD, not BHSD
  c.vc.device = 1;
  const auto s = difuse::can_use_qk_norm_sd35(c.args());
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "k_ctx_weight must be a contiguous [64]")) << all(s);
  EXPECT_TRUE(mentions(s, "q rows must be 4-byte aligned")) << all(s);
  EXPECT_TRUE(mentions(s, "v_out must be a contiguous [2, 38, 4429, 64]")) << all(s);
  EXPECT_TRUE(mentions(s, "q_ctx, k_ctx and v_ctx must be [2, 38, S_ctx, 64]")) << all(s);
  EXPECT_GE(s.reasons.size(), 4u);
}

TEST(QkNormSd35, RefusesTheUnreplayedShapes) {
  // 1 batch x 2 heads x 7 context tokens = 14 rows < 16
  Sd35Case few = sd35_case(1, 64, 7, 2, 64);
  auto s = difuse::can_use_qk_norm_sd35(few.args());
  EXPECT_TRUE(mentions(s, "the context stream's norms see 14 rows")) << all(s);
  Sd35Case wide = sd35_case(1, 64, 64, 2, 256);
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_sd35(wide.args()), "head_dim must be in [32, 128]"));
  Sd35Case none = sd35_case();
  auto a = none.args();
  a.k_ctx = nullptr;
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_sd35(a), "k_ctx is required"));
  try {
    difuse::qk_norm_sd35(few.args());
    FAIL() << "launched";
  } catch (const difuse::Unsupported& e) {
    EXPECT_TRUE(mentions({false, e.reasons()}, "14 rows"));
  }
}
