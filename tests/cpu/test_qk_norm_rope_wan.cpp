// qk_norm_rope_wan's predicate through the C ABI (every violated precondition is listed, nothing is launched) and
// the host emulation of one Wan token row built from the kernel's own schedule pieces. Predicates never touch
// memory, so fake device addresses are enough here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "difuse/difuse.hpp"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "norm/layernorm_schedule.h"

using difuse::DType;
using difuse::TensorView;

namespace {

void* fake(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

bool mentions(const difuse::Support& s, const std::string& needle) {
  for (const auto& r : s.reasons)
    if (r.find(needle) != std::string::npos) return true;
  return false;
}

struct WanCase {
  TensorView q, k, wq, wk, cos, sin, oq, ok;
  int64_t heads = 40;
  difuse_qk_norm_rope_wan_args args() const {
    difuse_qk_norm_rope_wan_args a{};
    a.q = &q, a.k = &k, a.q_weight = &wq, a.k_weight = &wk, a.freqs_cos = &cos, a.freqs_sin = &sin;
    a.q_out = &oq, a.k_out = &ok, a.heads = heads, a.eps = 1e-6;
    return a;
  }
};

// Wan 14B self-attention at 480p, 81 frames: q and k as chunks of a fused to_qkv output [B, 32760, 3 * 5120]
// (fused = true) or separate projections, freqs [1, S, 1, 128] from WanRotaryPosEmbed.
WanCase wan_case(int64_t B = 1, int64_t S = 32760, int64_t H = 40, bool fused = false) {
  const int64_t D = 128, N = H * D;
  WanCase c;
  c.heads = H;
  const uintptr_t qkv = 0x100000000ull;
  if (fused) {
    c.q = TensorView(fake(qkv), DType::BF16, {B, S, N}, {S * 3 * N, 3 * N, 1}, 0);
    c.k = TensorView(fake(qkv + 2 * N), DType::BF16, {B, S, N}, {S * 3 * N, 3 * N, 1}, 0);
  } else {
    c.q = TensorView::contiguous(fake(qkv), DType::BF16, {B, S, N}, 0);
    c.k = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, N}, 0);
  }
  c.wq = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {N}, 0);
  c.wk = TensorView::contiguous(fake(0x3000100000ull), DType::BF16, {N}, 0);
  c.cos = TensorView::contiguous(fake(0x4000000000ull), DType::F32, {1, S, 1, D}, 0);
  c.sin = TensorView::contiguous(fake(0x4100000000ull), DType::F32, {1, S, 1, D}, 0);
  c.oq = TensorView::contiguous(fake(0x10000000000ull), DType::BF16, {B, S, H, D}, 0);
  c.ok = TensorView::contiguous(fake(0x11000000000ull), DType::BF16, {B, S, H, D}, 0);
  return c;
}

}  // namespace

TEST(QkNormRopeWan, AcceptsTheWanSites) {
  for (const int64_t H : {40, 12, 24})  // 14B (5120), 1.3B (1536), TI2V-5B (3072)
    for (const bool fused : {false, true})
      for (const int64_t B : {1, 2}) {
        const WanCase c = wan_case(B, 32760, H, fused);
        EXPECT_TRUE(difuse::can_use_qk_norm_rope_wan(c.args()).ok) << difuse_last_error();
      }
  WanCase c = wan_case();
  auto a = c.args();
  a.q_weight = a.k_weight = nullptr;  // no affine
  EXPECT_TRUE(difuse::can_use_qk_norm_rope_wan(a).ok) << difuse_last_error();
  c = wan_case(2);
  c.cos = TensorView::contiguous(fake(0x4000000000ull), DType::F32, {2, 32760, 1, 128}, 0);  // per-batch tables
  EXPECT_TRUE(difuse::can_use_qk_norm_rope_wan(c.args()).ok) << difuse_last_error();
  c = wan_case(1, 0);  // no tokens: nothing to launch, still a valid call
  EXPECT_TRUE(difuse::can_use_qk_norm_rope_wan(c.args()).ok) << difuse_last_error();
}

TEST(QkNormRopeWan, ListsEveryViolation) {
  WanCase c = wan_case();
  c.wq = TensorView::contiguous(fake(0x3000000000ull), DType::F32, {5120}, 0);                // fp32 weight
  c.cos = TensorView::contiguous(fake(0x4000000000ull), DType::F32, {1, 32000, 1, 128}, 0);   // wrong S
  c.sin = TensorView::contiguous(fake(0x4100000000ull), DType::BF16, {1, 32760, 1, 128}, 0);  // bf16 table
  c.ok = c.oq;                                                                                // outputs overlap
  const auto s = difuse::can_use_qk_norm_rope_wan(c.args());
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "q_weight must be bf16"));
  EXPECT_TRUE(mentions(s, "freqs_cos must be [1, 32760, 1, 128]"));
  EXPECT_TRUE(mentions(s, "freqs_sin must be fp32"));
  EXPECT_TRUE(mentions(s, "q_out and k_out overlap"));
  EXPECT_EQ(s.reasons.size(), 4u) << difuse_last_error();
}

TEST(QkNormRopeWan, RefusesWidthsHeadDimsAndMisalignedRows) {
  WanCase c = wan_case(1, 64, 128);  // width 16384: more than the registers hold
  c.q = TensorView::contiguous(fake(0x100000002ull), DType::BF16, {1, 64, 16384}, 0);  // 2-byte aligned
  auto s = difuse::can_use_qk_norm_rope_wan(c.args());
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "at most 8192"));
  EXPECT_TRUE(mentions(s, "a contiguous q must be 8-byte aligned"));

  c = wan_case(1, 64, 16);
  c.heads = 16;
  c.q = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 64, 1536}, 0);  // head_dim 96
  c.k = TensorView(fake(0x2000000000ull), DType::BF16, {1, 64, 1536}, {64 * 4610, 4610, 1}, 0);  // rows 4 bytes apart
  c.wq = c.wk = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {1536}, 0);
  c.oq = TensorView::contiguous(fake(0x10000000000ull), DType::BF16, {1, 64, 16, 96}, 0);
  c.ok = TensorView::contiguous(fake(0x11000000000ull), DType::BF16, {1, 64, 16, 96}, 0);
  c.cos = TensorView::contiguous(fake(0x4000000000ull), DType::F32, {1, 64, 1, 96}, 0);
  c.sin = TensorView(fake(0x4100000004ull), DType::F32, {1, 64, 1, 96}, {64 * 96, 96, 96, 1}, 0);  // 4-byte offset
  s = difuse::can_use_qk_norm_rope_wan(c.args());
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "head_dim = width / heads must be a power of two in [4, 512]"));
  EXPECT_TRUE(mentions(s, "across its sweeps of 512 elements), got 96"));
  EXPECT_TRUE(mentions(s, "k rows must be 8-byte aligned"));
  EXPECT_TRUE(mentions(s, "freqs_sin rows must be 16-byte aligned"));
  EXPECT_EQ(s.reasons.size(), 3u) << difuse_last_error();

  c = wan_case();
  c.heads = 7;  // does not divide 5120
  s = difuse::can_use_qk_norm_rope_wan(c.args());
  EXPECT_TRUE(mentions(s, "heads must be positive and divide q's width 5120, got 7"));
}

TEST(QkNormRopeWan, RefusesMissingOperandsAndHeadSplitInputs) {
  WanCase c = wan_case();
  auto a = c.args();
  a.q = nullptr;
  a.freqs_sin = nullptr;
  auto s = difuse::can_use_qk_norm_rope_wan(a);
  EXPECT_TRUE(mentions(s, "q and k are required"));
  EXPECT_TRUE(mentions(s, "freqs_cos and freqs_sin are required"));
  a = c.args();
  a.k_out = nullptr;
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope_wan(a), "k_out is required"));
  // missing tables no longer hide what else is wrong (the other checks ran only once both tables were given)
  WanCase t = wan_case();
  t.wq.dtype = DIFUSE_F32;
  t.ok = t.oq;
  a = t.args();
  a.freqs_cos = nullptr;
  s = difuse::can_use_qk_norm_rope_wan(a);
  EXPECT_TRUE(mentions(s, "freqs_cos and freqs_sin are required"));
  EXPECT_TRUE(mentions(s, "q_weight must be bf16"));
  EXPECT_TRUE(mentions(s, "q_out and k_out overlap"));
  EXPECT_EQ(s.reasons.size(), 3u) << s.reasons.size();
  c.q = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 32760, 40, 128}, 0);  // already split
  s = difuse::can_use_qk_norm_rope_wan(c.args());
  EXPECT_TRUE(mentions(s, "q must be [B, S, heads * head_dim]"));
  c = wan_case();
  c.q.device = -1;
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope_wan(c.args()), "q must be on a CUDA device"));
}

TEST(QkNormRopeWan, LauncherRefusesWithoutLaunching) {
  WanCase c = wan_case();
  c.heads = 0;
  const auto a = c.args();
  EXPECT_EQ(difuse_qk_norm_rope_wan(&a, nullptr), DIFUSE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(difuse_last_error()).find("difuse::qk_norm_rope_wan: unsupported input"), std::string::npos);
  EXPECT_EQ(difuse_can_use_qk_norm_rope_wan(nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
}

// ---- one token row on the host, from the kernel's schedule pieces ------------------------------------------------
// The kernel's reduction is aten's: vector t + 128 k belongs to aten thread t, pushed in k order; warps reduce with
// shuffle-down offsets 16..1; roots (0,2), (1,3), (0,1). Here it runs on G = 128 strided (aten's own layout), and the
// epilogue pairs each bf16 pair with cos[2i] and sin[2i + 1] of its head-relative column. The reference is the
// processor's chain written out element by element.
namespace {

std::vector<uint16_t> wan_row_emulated(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                                       const std::vector<float>& cos, const std::vector<float>& sin, int D,
                                       float eps) {
  namespace num = difuse::num;
  namespace norm = difuse::norm;
  const int N = static_cast<int>(x.size()), V = N / 4;
  float acc[norm::kAtenThreads] = {};
  for (int t = 0; t < norm::kAtenThreads; ++t)
    for (int vi = t; vi < V; vi += norm::kAtenThreads)
      acc[t] = norm::rms_push_vec4(acc[t], num::bf16_to_float(x[4 * vi]), num::bf16_to_float(x[4 * vi + 1]),
                                   num::bf16_to_float(x[4 * vi + 2]), num::bf16_to_float(x[4 * vi + 3]));
  for (int o = 16; o >= 1; o /= 2) {
    float next[norm::kAtenThreads];
    for (int t = 0; t < norm::kAtenThreads; ++t) {
      const int lane = t % 32, src = lane + o < 32 ? t + o : t;  // shfl_down: out of the warp keeps its own
      next[t] = norm::rms_combine(acc[t], acc[src]);
    }
    for (int t = 0; t < norm::kAtenThreads; ++t) acc[t] = next[t];
  }
  const float roots[4] = {acc[0], acc[32], acc[64], acc[96]};
  const float rstd = norm::rms_finalize_roots(roots, N, eps);
  std::vector<uint16_t> out(N);
  for (int vi = 0; vi < V; ++vi) {
    const uint32_t x01 = x[4 * vi] | (static_cast<uint32_t>(x[4 * vi + 1]) << 16);
    const uint32_t x23 = x[4 * vi + 2] | (static_cast<uint32_t>(x[4 * vi + 3]) << 16);
    const uint32_t w01 = w[4 * vi] | (static_cast<uint32_t>(w[4 * vi + 1]) << 16);
    const uint32_t w23 = w[4 * vi + 2] | (static_cast<uint32_t>(w[4 * vi + 3]) << 16);
    const int col = (4 * vi) % D;
    const uint32_t y01 = num::rope_wan_bf16x2(norm::rms_norm_pair(x01, rstd, true, w01), cos[col], sin[col + 1]);
    const uint32_t y23 = num::rope_wan_bf16x2(norm::rms_norm_pair(x23, rstd, true, w23), cos[col + 2], sin[col + 3]);
    out[4 * vi] = static_cast<uint16_t>(y01 & 0xffffu);
    out[4 * vi + 1] = static_cast<uint16_t>(y01 >> 16);
    out[4 * vi + 2] = static_cast<uint16_t>(y23 & 0xffffu);
    out[4 * vi + 3] = static_cast<uint16_t>(y23 >> 16);
  }
  return out;
}

}  // namespace

TEST(QkNormRopeWan, HostRowMatchesTheProcessorsChainGivenTheSameRstd) {
  namespace num = difuse::num;
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const int H : {12, 40}) {
    const int D = 128, N = H * D;
    std::vector<uint16_t> x(N), w(N);
    for (auto& v : x) v = num::float_to_bf16_rne(nd(gen) * 3.f);
    for (auto& v : w) v = num::float_to_bf16_rne(nd(gen));
    std::vector<float> cos(D), sin(D);
    for (int i = 0; i < D / 2; ++i) {  // repeat-interleaved, as WanRotaryPosEmbed builds them
      const double a = 17.0 / std::pow(10000.0, 2.0 * i / D);
      cos[2 * i] = cos[2 * i + 1] = static_cast<float>(std::cos(a));
      sin[2 * i] = sin[2 * i + 1] = static_cast<float>(std::sin(a));
    }
    const auto got = wan_row_emulated(x, w, cos, sin, D, 1e-6f);
    // the same rstd (aten's tree, not re-derived here), then the processor's ops one by one
    float s = 0.f;
    {
      float acc[128] = {};
      for (int t = 0; t < 128; ++t)
        for (int vi = t; vi < N / 4; vi += 128)
          for (int e = 0; e < 4; ++e) {
            const float v = num::bf16_to_float(x[4 * vi + e]);
            acc[t] = num::fma_rn(v, v, acc[t]);
          }
      for (int o = 16; o >= 1; o /= 2) {
        float next[128];
        for (int t = 0; t < 128; ++t) next[t] = num::add_rn(acc[t], (t % 32) + o < 32 ? acc[t + o] : acc[t]);
        for (int t = 0; t < 128; ++t) acc[t] = next[t];
      }
      s = num::add_rn(num::add_rn(acc[0], acc[64]), num::add_rn(acc[32], acc[96]));
    }
    const float rstd = num::rsqrt_cuda(num::add_rn(num::div_rn(s, static_cast<float>(N)), 1e-6f));
    for (int e = 0; e < N; e += 2) {
      // y = norm_q(x): bf16(RN(w * RN(rstd * x))), then unflatten; x1 = y[2i], x2 = y[2i + 1] of head e / D
      const float y0 = num::round_bf16(num::mul_rn(num::bf16_to_float(w[e]), num::mul_rn(rstd, num::bf16_to_float(x[e]))));
      const float y1 =
          num::round_bf16(num::mul_rn(num::bf16_to_float(w[e + 1]), num::mul_rn(rstd, num::bf16_to_float(x[e + 1]))));
      const int col = e % D;
      const float c = cos[col], sn = sin[col + 1];  // freqs_cos[..., 0::2], freqs_sin[..., 1::2]
      volatile float a0 = y0 * c, b0 = y1 * sn, a1 = y0 * sn, b1 = y1 * c;
      volatile float o0 = a0 - b0, o1 = a1 + b1;
      ASSERT_EQ(got[e], num::float_to_bf16_rne(o0)) << "H " << H << " element " << e;
      ASSERT_EQ(got[e + 1], num::float_to_bf16_rne(o1)) << "H " << H << " element " << e + 1;
    }
  }
}
