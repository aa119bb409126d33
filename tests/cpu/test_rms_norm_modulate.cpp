// rms_norm_modulate and gated_residual_rms_norm_modulate on the host: the modulate rounding helpers
// (numerics/modulate.h) against exact arithmetic, the kernels' composition of aten's mean (rms_modulate_schedule.h)
// against a transcription of Reduce.cuh's own loops, the packed epilogue against the element chain, and the
// predicates (every violated precondition listed). Fake device addresses: predicates never touch memory.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "difuse/difuse.hpp"
#include "difuse/numerics/modulate.h"
#include "norm/rms_modulate_schedule.h"
#include "norm/rms_norm_modulate.h"

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

// The exact value v (a double holding it exactly) rounded once to bf16, ties to even; +-inf past the range.
float exact_to_bf16(double v) {
  if (v == 0.0 || std::isnan(v) || std::isinf(v)) return static_cast<float>(v);
  const double a = std::fabs(v);
  const int e = std::max(std::ilogb(a), -126);            // bf16's subnormals share 2^-126's quantum
  const double quantum = std::ldexp(1.0, e - 7);          // 8 significant bits
  double q = std::nearbyint(a / quantum) * quantum;       // the default rounding mode: ties to even
  if (q >= std::ldexp(1.0, 128) * (1.0 - std::ldexp(1.0, -9))) q = INFINITY;  // past 0x7F7F's rounding boundary
  return static_cast<float>(std::copysign(q, v));
}

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

// ---- numerics/modulate.h ---------------------------------------------------------------------------------------
TEST(ModulateNumerics, Bf16ProductWithOnePlusScaleIsRoundedOnce) {
  // The packed chain multiplies n by a = bf16(1 + scale) with mul.rn.bf16x2 (one rounding of the exact product);
  // eager rounds the fp32 product again. Equal because a is 0 or a multiple of 2^-8, so the exact product sits
  // on fp32's grid: checked for every scale against n of every magnitude class.
  std::mt19937 rng(17);
  int64_t checked = 0;
  for (uint32_t sb = 0; sb < 65536; ++sb) {
    const float a = round_bf16(add_rn(bf16_to_float(static_cast<uint16_t>(sb)), 1.0f));
    if (std::isnan(a) || std::isinf(a)) continue;
    for (int k = 0; k < 24; ++k) {
      const float n = bf16_to_float(random_bf16(rng, k));
      if (std::isnan(n) || std::isinf(n)) continue;
      const double exact = static_cast<double>(n) * static_cast<double>(a);  // 16 significant bits: exact
      ASSERT_EQ(float_bits(round_bf16(mul_rn(n, a))), float_bits(exact_to_bf16(exact)))
          << "n " << n << " a " << a;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000000);
}

TEST(ModulateNumerics, PackedChainEqualsTheElementChain) {
  std::mt19937 rng(3);
  for (int i = 0; i < 400000; ++i) {
    const uint16_t n0 = random_bf16(rng, i), n1 = random_bf16(rng, i + 1);
    const uint16_t s0 = random_bf16(rng, i + 2), s1 = random_bf16(rng, i / 3);
    const uint16_t h0 = random_bf16(rng, i / 5), h1 = random_bf16(rng, i / 7);
    const uint32_t r = modulate_bf16x2(n0 | (uint32_t{n1} << 16), s0 | (uint32_t{s1} << 16), h0 | (uint32_t{h1} << 16));
    ASSERT_EQ(r & 0xFFFFu, float_to_bf16_rne(modulate_bf16_value(bf16_to_float(n0), bf16_to_float(s0), bf16_to_float(h0))));
    ASSERT_EQ(r >> 16, float_to_bf16_rne(modulate_bf16_value(bf16_to_float(n1), bf16_to_float(s1), bf16_to_float(h1))));
  }
}

TEST(ModulateNumerics, Fp32ChainIsNotContracted) {
  // ERNIE-Image's (n.float() * (1 + scale.float()) + shift.float()): three kernels, so n * t is rounded before the
  // add. With n = 1 + 2^-7 and t = 1 + 2^-20 + 2^-23 the exact product needs 31 bits.
  const float n = 1.0f + std::ldexp(1.0f, -7);
  const float scale = std::ldexp(1.0f, -20) + std::ldexp(1.0f, -23);  // a bf16 value (8 significant bits)
  ASSERT_EQ(round_bf16(scale), scale);
  const float unfused = modulate_f32(n, scale, -n);
  const float fused = fma_rn(n, add_rn(scale, 1.0f), -n);
  EXPECT_EQ(unfused, std::ldexp(1.0f, -20) + std::ldexp(1.0f, -23));
  EXPECT_NE(float_bits(unfused), float_bits(fused));
  EXPECT_NE(float_to_bf16_rne(unfused), float_to_bf16_rne(fused));  // visible after the bf16 rounding too
  // And it is not the bf16 chain (which rounds 1 + scale to bf16 first: 1.0).
  EXPECT_EQ(modulate_bf16_value(n, scale, -n), 0.0f);
}

// ---- rms_modulate_schedule.h: aten's mean, as the kernels compose it ------------------------------------------
namespace {

// Reduce.cuh's per-thread loops for one output row with block (32, 16), transcribed from its structure
// (input_vectorized_thread_reduce_impl for N >= 128, thread_reduce_impl with vt0 = 4 otherwise), then the
// accumulator combine and block_x_reduce's shuffle-down tree (explicit copies per step).
float aten_mean_sum(const std::vector<float>& row) {
  const int end = static_cast<int>(row.size());
  float lane_value[32];
  for (int x = 0; x < 32; ++x) {
    float vl[4] = {0.f, 0.f, 0.f, 0.f};
    auto sq = [&](int i) { return mul_rn(row[i], row[i]); };
    if (end >= 128) {
      int idx = x;
      while (idx * 4 + 3 < end) {
        for (int i = 0; i < 4; ++i) vl[i] = add_rn(vl[i], sq(idx * 4 + i));
        idx += 32;
      }
      for (int i = end - end % 4 + x; i < end; i += 32) vl[0] = add_rn(vl[0], sq(i));  // tail (N % 4 == 0: none)
    } else {
      int idx = x;
      while (idx + 3 * 32 < end) {
        for (int i = 0; i < 4; ++i) vl[i] = add_rn(vl[i], sq(idx + i * 32));
        idx += 4 * 32;
      }
      for (int i = 0; i < 4 && idx < end; ++i, idx += 32) vl[i] = add_rn(vl[i], sq(idx));
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

// The kernels' composition: lane x keeps vectors x + 32 k (N >= 128) or elements x + 32 i (N < 128).
float kernel_mean_sum(const std::vector<float>& row) {
  using namespace difuse::norm;
  const int n = static_cast<int>(row.size());
  float lanes[kMeanLanes];
  for (int x = 0; x < kMeanLanes; ++x) {
    MeanLane acc;
    if (n >= 128) {
      for (int v = x; v < n / 4; v += 32) mean_push_vec4(acc, row[4 * v], row[4 * v + 1], row[4 * v + 2], row[4 * v + 3]);
    } else {
      for (int i = 0; i < 4; ++i)
        if (x + 32 * i < n) mean_push_scalar(acc, i, row[x + 32 * i]);
    }
    lanes[x] = mean_lane_total(acc);
  }
  return mean_tree_host(lanes);
}

}  // namespace

TEST(RmsModulateSchedule, KernelMeanReplaysAtensLoopsBitForBit) {
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<int> widths = {32, 33, 63, 64, 95, 96, 97, 127, 128, 132, 256, 1020, 2048, 3072, 4096, 5120, 8156, 8160};
  for (int i = 0; i < 60; ++i) widths.push_back(4 * std::uniform_int_distribution<int>(32, 2040)(rng));
  for (int i = 0; i < 20; ++i) widths.push_back(std::uniform_int_distribution<int>(32, 127)(rng));
  for (int n : widths) {
    for (float scale : {1.0f, 1e-3f, 40.0f, 1e-20f}) {
      std::vector<float> row(n);
      for (auto& v : row) v = round_bf16(nd(rng) * scale);
      const float a = aten_mean_sum(row), k = kernel_mean_sum(row);
      ASSERT_EQ(float_bits(a), float_bits(k)) << "N " << n << " scale " << scale;
      double exact = 0;
      for (float v : row) exact += static_cast<double>(v) * v;
      EXPECT_NEAR(k, exact, 1e-5 * exact + 1e-42) << n;
    }
  }
}

TEST(RmsModulateSchedule, PackedEpilogueEqualsTheElementChain) {
  using difuse::norm::rms_modulate_pair;
  using difuse::norm::rms_modulate_value;
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> ur(-20.f, 20.f);
  for (int i = 0; i < 300000; ++i) {
    const float rstd = std::ldexp(1.0f + std::abs(ur(rng)) / 20.f, static_cast<int>(ur(rng) * 3));
    const bool has_w = i % 3 != 0, fp32 = i % 2 == 0;
    uint16_t e[5][2];
    for (auto& p : e)
      for (auto& b : p) b = random_bf16(rng, i + (&b - &p[0]));
    auto w2 = [&](int k) { return e[k][0] | (uint32_t{e[k][1]} << 16); };
    const uint32_t r = rms_modulate_pair(w2(0), rstd, has_w, w2(1), w2(2), w2(3), fp32);
    for (int h = 0; h < 2; ++h) {
      const float v = rms_modulate_value(bf16_to_float(e[0][h]), rstd, has_w, bf16_to_float(e[1][h]),
                                         bf16_to_float(e[2][h]), bf16_to_float(e[3][h]), fp32);
      ASSERT_EQ(h ? r >> 16 : r & 0xFFFFu, float_to_bf16_rne(v)) << i << " half " << h;
    }
  }
}

TEST(RmsModulateSchedule, RmsBitsIsTheValueAndAnAbsentWeightIsOne) {
  // diffusers_rms_bits(x, rstd, w) == bf16 bits of diffusers_rms_value(x, rstd, true, w), and with w = 1 those of
  // diffusers_rms_value(x, rstd, false, .), for every bf16 x (NaN: both NaN; the host keeps payloads).
  using difuse::norm::diffusers_rms_bits;
  using difuse::norm::diffusers_rms_value;
  std::mt19937 rng(77);
  for (uint32_t xb = 0; xb < 65536; ++xb) {
    const float x = bf16_to_float(static_cast<uint16_t>(xb));
    const float rstd = std::ldexp(1.0f + (rng() % 4096) / 4096.f, static_cast<int>(rng() % 60) - 30);
    const float w = bf16_to_float(random_bf16(rng, xb % 4));
    const uint16_t got = diffusers_rms_bits(x, rstd, w), want = float_to_bf16_rne(diffusers_rms_value(x, rstd, true, w));
    const uint16_t got1 = diffusers_rms_bits(x, rstd, 1.0f);
    const uint16_t want1 = float_to_bf16_rne(diffusers_rms_value(x, rstd, false, 0.f));
    if (std::isnan(bf16_to_float(want))) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got))) << xb;
    } else {
      ASSERT_EQ(got, want) << xb;
    }
    if (std::isnan(bf16_to_float(want1))) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got1))) << xb;
    } else {
      ASSERT_EQ(got1, want1) << xb;
    }
  }
}

TEST(RmsModulateSchedule, ElementChainRoundsWhereDiffusersDoes) {
  using difuse::norm::diffusers_rms_value;
  using difuse::norm::rms_modulate_value;
  // y = bf16(RN(x * rstd)) is rounded before the weight: x = 1, rstd = 1 + 2^-8 - 2^-12 gives y = 1 in bf16, so
  // y * w = w = 2 - 2^-7 exactly; one rounding of x * rstd * w (1.99948) would give 2 instead.
  const float rstd = 1.0f + std::ldexp(1.0f, -8) - std::ldexp(1.0f, -12), w = 2.0f - std::ldexp(1.0f, -7);
  EXPECT_EQ(diffusers_rms_value(1.0f, rstd, false, 0.f), 1.0f);
  EXPECT_EQ(diffusers_rms_value(1.0f, rstd, true, w), w);
  EXPECT_EQ(round_bf16(mul_rn(rstd, w)), 2.0f);
  // The two modulate chains differ on the same input. scale = 3 * 2^-9: the bf16 chain rounds 1 + scale to
  // 1 + 2^-7 first, and 1.5 * (1 + 2^-7) is a bf16 tie that goes up to 1.515625; the fp32 chain keeps
  // 1.5 * 1.005859375 = 1.5087890625, which rounds once, down to 1.5078125.
  const float n = 1.5f, scale = std::ldexp(1.0f, -9) * 3, shift = 0.f;
  EXPECT_EQ(rms_modulate_value(n, 1.0f, false, 0.f, scale, shift, false), 1.515625f);
  EXPECT_EQ(rms_modulate_value(n, 1.0f, false, 0.f, scale, shift, true), 1.5078125f);
}

// The quarter-batch rule: per-token gates only, and only where one more block per SM saves a wave (H200: 132 SMs,
// 9 vs 8 blocks of 4 rows at N = 3072).
TEST(RmsModulateSchedule, QuarterBatchesOnlyWhereTheySaveAWave) {
  using difuse::norm::residual_quarter_batches;
  EXPECT_TRUE(residual_quarter_batches(true, 4352 / 4, 9 * 132, 8 * 132));    // ernie_tokens: 2 waves -> 1
  EXPECT_FALSE(residual_quarter_batches(false, 4352 / 4, 9 * 132, 8 * 132));  // a [B, H] gate
  EXPECT_FALSE(residual_quarter_batches(true, 4096 / 4, 9 * 132, 8 * 132));   // one wave either way
  EXPECT_FALSE(residual_quarter_batches(true, 252 / 4 + 1, 9 * 132, 8 * 132));  // 2x126x2048 ltx2_tokens
  EXPECT_TRUE(residual_quarter_batches(true, 8 * 132 * 2 + 1, 9 * 132, 8 * 132));  // 3 waves -> 2
  EXPECT_TRUE(residual_quarter_batches(true, 9 * 132 * 8, 9 * 132, 8 * 132));      // 9 waves -> 8
  EXPECT_FALSE(residual_quarter_batches(true, 8 * 132 * 8, 9 * 132, 8 * 132));     // 8 waves either way
  EXPECT_FALSE(residual_quarter_batches(true, 1088, 8 * 132, 8 * 132));            // the same occupancy
  EXPECT_FALSE(residual_quarter_batches(true, 0, 9 * 132, 8 * 132));
  EXPECT_FALSE(residual_quarter_batches(true, 1088, 0, 8 * 132));
}

// The streamed rows by default: >= 8192 rows with staged modulation rows (both forms, any width), >= 4096 such rows
// where the streamed kernel is compiled for N = 3072 (full_width_v = 768), or the plain form's >= 4096 rows wider than
// 3072; the bench's site shapes on either side.
TEST(RmsModulateSchedule, StreamedRowsByDefault) {
  using difuse::norm::rms_streamed_by_default;
  EXPECT_TRUE(rms_streamed_by_default(false, 3072, 4352 * 2, true, 768));    // ERNIE 4352x2x3072
  EXPECT_TRUE(rms_streamed_by_default(true, 3072, 4352 * 2, true, 768));     // its residual form
  EXPECT_TRUE(rms_streamed_by_default(false, 3072, 4352 * 2, true, 0));      // ... under DIFUSE_RMSMOD_FULL_WIDTH=0
  EXPECT_TRUE(rms_streamed_by_default(true, 4096, 2 * 6144, true, 1024));    // LTX-2 2x6144x4096, residual
  EXPECT_TRUE(rms_streamed_by_default(false, 4096, 6144, false, 0));         // 1x6144x4096 per-token rows
  EXPECT_TRUE(rms_streamed_by_default(false, 4096, 4096, false, 0));         // ERNIE's layout at 4096
  EXPECT_TRUE(rms_streamed_by_default(false, 3072, 4096, true, 768));        // LTX-2 1x4096x3072, ERNIE 4096x1x3072
  EXPECT_TRUE(rms_streamed_by_default(true, 3072, 4096, true, 768));         // GRRMS LTX-2 1x4096x3072
  EXPECT_FALSE(rms_streamed_by_default(false, 3072, 4096, true, 0));         // ... the run-time width: staged rows
  EXPECT_FALSE(rms_streamed_by_default(true, 3072, 4096, true, 0));
  EXPECT_FALSE(rms_streamed_by_default(true, 3072, 4095, true, 768));        // fewer rows than measured
  EXPECT_FALSE(rms_streamed_by_default(true, 4096, 4096, true, 1024));       // VN = 1024 not timed below 8192 rows
  EXPECT_TRUE(rms_streamed_by_default(true, 4096, 8192, true, 1024));
  EXPECT_FALSE(rms_streamed_by_default(false, 3072, 4352, false, 0));        // ernie_tokens: per-token rows
  EXPECT_FALSE(rms_streamed_by_default(true, 3072, 4352, false, 0));
  EXPECT_FALSE(rms_streamed_by_default(true, 4096, 2 * 6144, false, 0));     // the residual form, rows not staged
  EXPECT_FALSE(rms_streamed_by_default(false, 3072, 8191, true, 0));
  EXPECT_TRUE(rms_streamed_by_default(false, 3072, 8192, true, 0));
  EXPECT_FALSE(rms_streamed_by_default(false, 4096, 4095, false, 0));
  EXPECT_FALSE(rms_streamed_by_default(false, 2048, 252, true, 0));          // 2x126x2048
}

// The STAGE_ALL rows by default: at most 1024 rows, all of whose one-warp blocks fit the device at once.
TEST(RmsModulateSchedule, StageAllRowsByDefault) {
  using difuse::norm::rms_stage_all_by_default;
  EXPECT_TRUE(rms_stage_all_by_default(252, 18 * 132));     // 2x126x2048 ltx2: 12 KB blocks, 18 per SM
  EXPECT_TRUE(rms_stage_all_by_default(252, 11 * 132));     // its residual form: 20 KB blocks
  EXPECT_TRUE(rms_stage_all_by_default(1024, 12 * 132));
  EXPECT_FALSE(rms_stage_all_by_default(1025, 32 * 132));   // more rows than measured
  EXPECT_FALSE(rms_stage_all_by_default(4096, 12 * 132));   // 1x4096x3072: lost on an H100
  EXPECT_FALSE(rms_stage_all_by_default(4352, 9 * 132));    // 4352x1x3072 ernie_tokens: lost
  EXPECT_FALSE(rms_stage_all_by_default(1000, 7 * 132));    // 924 resident: more than one wave
  EXPECT_TRUE(rms_stage_all_by_default(924, 7 * 132));
  EXPECT_FALSE(rms_stage_all_by_default(0, 132));
  EXPECT_FALSE(rms_stage_all_by_default(16, 0));
}

// The streamed kernel stages a modulation role in shared memory only where its rows take at most two offsets.
TEST(RmsModulateSchedule, StagedRowOffsets) {
  using difuse::detail::RowIndexer;
  using difuse::norm::staged_row_offsets;
  int64_t o[2] = {-1, -1};
  RowIndexer ernie;  // x [S = 4352, B = 2, H], chunk [B, H] of a [B, 6H] tensor: the second dim moves by 6H
  ernie.d1 = 2;
  ernie.s1 = 6 * 3072;
  EXPECT_EQ(staged_row_offsets(ernie, 4352 * 2, o), 2);
  EXPECT_EQ(o[0], 0);
  EXPECT_EQ(o[1], 6 * 3072);
  EXPECT_EQ(staged_row_offsets(ernie, 2, o), 2);  // one token
  ernie.d1 = 1;  // B = 1: one row
  EXPECT_EQ(staged_row_offsets(ernie, 4096, o), 1);
  EXPECT_EQ(o[1], 0);
  RowIndexer ltx2;  // x [B = 2, L = 6144, D], [B, 1, D] view of [B, 1, 6, D]: the first dim moves by 6D
  ltx2.d2 = 6144;
  ltx2.s0 = 6 * 4096;
  EXPECT_EQ(staged_row_offsets(ltx2, 2 * 6144, o), 2);
  EXPECT_EQ(o[1], 6 * 4096);
  EXPECT_EQ(staged_row_offsets(ltx2, 3 * 6144, o), 0);  // B = 3
  EXPECT_EQ(staged_row_offsets(ltx2, 6144, o), 1);      // B = 1
  ltx2.s2 = 6 * 4096;  // per token: every row its own
  ltx2.s0 = 6144 * 6 * 4096;
  EXPECT_EQ(staged_row_offsets(ltx2, 6144, o), 0);
  RowIndexer broadcast;  // an [H] row against every row
  broadcast.d1 = 7;
  broadcast.d2 = 9;
  EXPECT_EQ(staged_row_offsets(broadcast, 5 * 7 * 9, o), 1);
  RowIndexer two_dims;  // two moving dims of size 2: four rows
  two_dims.d1 = 2;
  two_dims.d2 = 1;
  two_dims.s0 = 100;
  two_dims.s1 = 10;
  EXPECT_EQ(staged_row_offsets(two_dims, 4, o), 0);
  EXPECT_EQ(staged_row_offsets(two_dims, 2, o), 2);  // the first dim has one index: only the second moves
  EXPECT_EQ(o[1], 10);
  EXPECT_EQ(staged_row_offsets(two_dims, 0, o), 0);
}

TEST(RmsModulateSchedule, LaneVectorsPerWidth) {
  using difuse::norm::rms_norm_modulate_lane_vectors;
  EXPECT_EQ(rms_norm_modulate_lane_vectors(127), 0);
  EXPECT_EQ(rms_norm_modulate_lane_vectors(128), 8);
  EXPECT_EQ(rms_norm_modulate_lane_vectors(1024), 8);
  EXPECT_EQ(rms_norm_modulate_lane_vectors(1028), 16);
  EXPECT_EQ(rms_norm_modulate_lane_vectors(2048), 16);  // LTX-2 audio
  EXPECT_EQ(rms_norm_modulate_lane_vectors(3072), 24);  // ERNIE-Image
  EXPECT_EQ(rms_norm_modulate_lane_vectors(4096), 32);  // LTX-2 video
  EXPECT_EQ(rms_norm_modulate_lane_vectors(5120), 48);
  EXPECT_EQ(rms_norm_modulate_lane_vectors(8160), 64);
}

// ---- predicates ------------------------------------------------------------------------------------------------
namespace {

struct Call {
  TensorView out, x, weight, scale, shift;
  bool has_w = true;
  bool fp32 = true;
};

// ERNIE-Image: x [S, B, H] sequence first, bf16 weight, scale/shift the [B, H] chunks of a [B, 6H] projection.
Call ernie(int64_t S = 4352, int64_t B = 2, int64_t H = 3072) {
  Call c;
  c.x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {S, B, H}, 0);
  c.out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {S, B, H}, 0);
  c.weight = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {H}, 0);
  c.scale = TensorView(fake(0x2000000000ull + 2 * H), DType::BF16, {B, H}, {6 * H, 1}, 0);
  c.shift = TensorView(fake(0x2000000000ull), DType::BF16, {B, H}, {6 * H, 1}, 0);
  return c;
}

// LTX-2: x [B, L, D], no weight, scale/shift [B, T, D] views of a [B, T, 6, D] sum (T = 1 or L).
Call ltx2(int64_t B = 2, int64_t L = 6144, int64_t D = 4096, bool per_token = false) {
  Call c;
  const int64_t T = per_token ? L : 1;
  c.x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, L, D}, 0);
  c.out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, L, D}, 0);
  c.has_w = false;
  c.fp32 = false;
  c.scale = TensorView(fake(0x2000000000ull + 2 * D), DType::BF16, {B, T, D}, {T * 6 * D, 6 * D, 1}, 0);
  c.shift = TensorView(fake(0x2000000000ull), DType::BF16, {B, T, D}, {T * 6 * D, 6 * D, 1}, 0);
  return c;
}

difuse::Support can_use(const Call& c) {
  return difuse::can_use_rms_norm_modulate(c.out, c.x, c.has_w ? &c.weight : nullptr, c.scale, c.shift, 1e-6, c.fp32);
}

}  // namespace

TEST(RmsNormModulatePredicate, AcceptsTheSites) {
  EXPECT_TRUE(can_use(ernie()).ok);
  EXPECT_TRUE(can_use(ernie(4096, 1, 3072)).ok);
  EXPECT_TRUE(can_use(ltx2()).ok);
  EXPECT_TRUE(can_use(ltx2(2, 6144, 4096, true)).ok);
  EXPECT_TRUE(can_use(ltx2(2, 126, 2048)).ok);  // audio stream
  // ERNIE's eager modulation: the [B, H] chunk expanded to [S, B, H] and made contiguous.
  Call e = ernie(300, 2, 3072);
  e.scale = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {300, 2, 3072}, 0);
  e.shift = TensorView::contiguous(fake(0x2800000000ull), DType::BF16, {300, 2, 3072}, 0);
  EXPECT_TRUE(can_use(e).ok);
  // The widest and narrowest replayed rows; 16 rows.
  EXPECT_TRUE(can_use(ltx2(1, 16, 8160)).ok);
  Call narrow = ltx2(1, 16, 33);
  EXPECT_TRUE(can_use(narrow).ok);
  // No rows at all: nothing to replay, nothing launched.
  Call empty = ltx2(2, 0, 4096);
  empty.x.data = empty.out.data = nullptr;
  EXPECT_TRUE(can_use(empty).ok);
  EXPECT_NO_THROW(difuse::rms_norm_modulate(empty.out, empty.x, nullptr, empty.scale, empty.shift, 1e-6, false));
}

TEST(RmsNormModulatePredicate, RefusesTheUnreplayedMeanConfigurations) {
  EXPECT_TRUE(mentions(can_use(ltx2(1, 15, 4096)), "at least 16 rows"));
  EXPECT_TRUE(mentions(can_use(ltx2(1, 64, 8164)), "[32, 8160]"));
  EXPECT_TRUE(mentions(can_use(ltx2(1, 64, 31)), "[32, 8160]"));
  EXPECT_TRUE(mentions(can_use(ltx2(1, 64, 130)), "multiple of 4"));
  Call m = ltx2();
  m.x.data = fake(0x100000002ull);
  EXPECT_TRUE(mentions(can_use(m), "x must be 8-byte aligned"));
  Call odd = ltx2(1, 64, 97);  // narrow rows take scalar loads: any alignment
  odd.x.data = fake(0x100000002ull);
  odd.scale.data = fake(0x2000000002ull);
  EXPECT_TRUE(can_use(odd).ok);
}

TEST(RmsNormModulatePredicate, BroadcastRules) {
  Call c = ltx2(2, 300, 4096, true);
  c.scale.sizes[1] = 299;
  EXPECT_TRUE(mentions(can_use(c), "scale must broadcast to x's shape [2, 300, 4096]"));
  Call last = ernie();
  last.shift.sizes[1] = 1;  // the last dim never broadcasts
  EXPECT_TRUE(mentions(can_use(last), "shift must broadcast"));
  Call rank = ltx2();
  rank.scale = TensorView(fake(0x2000000000ull), DType::BF16, {1, 2, 1, 4096}, {0, 6 * 4096, 6 * 4096, 1}, 0);
  EXPECT_TRUE(mentions(can_use(rank), "scale must broadcast"));
  Call layout = ltx2();
  layout.scale.strides[2] = 2;
  layout.shift.strides[0] = -1;
  const auto s = can_use(layout);
  EXPECT_TRUE(mentions(s, "scale must have a contiguous last dim"));
  EXPECT_TRUE(mentions(s, "shift must have non-negative strides"));
  Call lead = ernie(64, 2, 3072);  // a [1, B, H] row (stride 0 where it broadcasts) is fine too
  lead.scale = TensorView(fake(0x2000000000ull), DType::BF16, {1, 2, 3072}, {0, 6 * 3072, 1}, 0);
  EXPECT_TRUE(can_use(lead).ok);
}

TEST(RmsNormModulatePredicate, EveryViolationIsListed) {
  Call c = ernie();
  c.x.dtype = DIFUSE_F16;
  c.weight.dtype = DIFUSE_F32;
  c.scale.dtype = DIFUSE_F32;
  c.shift.device = 1;
  c.out.device = -1;
  const auto s = difuse::can_use_rms_norm_modulate(c.out, c.x, &c.weight, c.scale, c.shift, 1e-6, true);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "x must be bf16"));
  EXPECT_TRUE(mentions(s, "weight must be bf16"));
  EXPECT_TRUE(mentions(s, "scale must be bf16"));
  EXPECT_TRUE(mentions(s, "shift must be on the device of x"));
  EXPECT_TRUE(mentions(s, "out must be on the device of x"));
  EXPECT_GE(s.reasons.size(), 5u);
  Call v = ernie();
  EXPECT_EQ(difuse_can_use_rms_norm_modulate(&v.out, &v.x, &v.weight, &v.scale, &v.shift, 1e-6, 2),
            DIFUSE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(difuse_last_error()).find("fp32_modulate must be 0"), std::string::npos);
  Call t = ernie();
  t.x.strides[0] = 4 * 3072;  // not contiguous
  t.weight.sizes[0] = 3071;
  t.out.data = t.x.data;
  const auto st = can_use(t);
  EXPECT_TRUE(mentions(st, "x must be contiguous"));
  EXPECT_TRUE(mentions(st, "weight must be a contiguous [3072]"));
  EXPECT_TRUE(mentions(st, "out must not overlap"));
}

TEST(RmsNormModulatePredicate, LauncherFailsWithTheFullListAndWritesNothing) {
  Call c = ltx2();
  c.x.device = c.out.device = c.scale.device = c.shift.device = -1;  // host memory
  c.scale.dtype = DIFUSE_F32;
  try {
    difuse::rms_norm_modulate(c.out, c.x, nullptr, c.scale, c.shift, 1e-6, false);
    FAIL() << "expected difuse::Unsupported";
  } catch (const difuse::Unsupported& e) {
    EXPECT_GE(e.reasons().size(), 2u);
    EXPECT_NE(std::string(e.what()).find("difuse::rms_norm_modulate: unsupported input"), std::string::npos);
  }
  EXPECT_EQ(difuse_rms_norm_modulate(&c.out, &c.x, nullptr, &c.scale, &c.shift, 1e-6, 0, nullptr),
            DIFUSE_ERR_UNSUPPORTED);
  EXPECT_EQ(difuse_rms_norm_modulate(nullptr, &c.x, nullptr, &c.scale, &c.shift, 1e-6, 0, nullptr),
            DIFUSE_ERR_INVALID_ARGUMENT);
}

namespace {
struct ResidualCall {
  Call c;
  TensorView residual, a, gate;
};
ResidualCall ltx2_residual(bool per_token_gate = false) {
  ResidualCall r;
  r.c = ltx2(2, 6144, 4096, per_token_gate);
  r.residual = TensorView::contiguous(fake(0x4000000000ull), DType::BF16, {2, 6144, 4096}, 0);
  r.a = TensorView::contiguous(fake(0x5000000000ull), DType::BF16, {2, 6144, 4096}, 0);
  const int64_t T = per_token_gate ? 6144 : 1;
  r.gate = TensorView(fake(0x2000000000ull + 4 * 4096), DType::BF16, {2, T, 4096}, {T * 6 * 4096, 6 * 4096, 1}, 0);
  return r;
}
difuse::Support can_use(const ResidualCall& r) {
  return difuse::can_use_gated_residual_rms_norm_modulate(r.c.out, r.residual, r.c.x, r.a, r.gate,
                                                          r.c.has_w ? &r.c.weight : nullptr, r.c.scale, r.c.shift,
                                                          1e-6, r.c.fp32);
}
}  // namespace

TEST(GatedResidualRmsNormModulatePredicate, AcceptsTheSitesAndInPlace) {
  EXPECT_TRUE(can_use(ltx2_residual()).ok);
  EXPECT_TRUE(can_use(ltx2_residual(true)).ok);
  ResidualCall inplace = ltx2_residual();
  inplace.residual = inplace.c.x;
  EXPECT_TRUE(can_use(inplace).ok);
  ResidualCall e;  // ERNIE: h [S, B, H], gate the [B, H] chunk
  e.c = ernie();
  e.residual = TensorView::contiguous(fake(0x4000000000ull), DType::BF16, {4352, 2, 3072}, 0);
  e.a = TensorView::contiguous(fake(0x5000000000ull), DType::BF16, {4352, 2, 3072}, 0);
  e.gate = TensorView(fake(0x2000000000ull + 4 * 3072), DType::BF16, {2, 3072}, {6 * 3072, 1}, 0);
  EXPECT_TRUE(can_use(e).ok);
  // a as the ERNIE block hands it: the attention output [B, S, H] permuted to [S, B, H] (rows not in order)
  e.a = TensorView(fake(0x5000000000ull), DType::BF16, {4352, 2, 3072}, {3072, 4352 * 3072, 1}, 0);
  EXPECT_TRUE(can_use(e).ok);
}

TEST(GatedResidualRmsNormModulatePredicate, StridedRowsOfAMustBeContiguousAlignedRows) {
  ResidualCall e;
  e.c = ernie();
  e.residual = TensorView::contiguous(fake(0x4000000000ull), DType::BF16, {4352, 2, 3072}, 0);
  e.gate = TensorView(fake(0x2000000000ull + 4 * 3072), DType::BF16, {2, 3072}, {6 * 3072, 1}, 0);
  e.a = TensorView(fake(0x5000000000ull), DType::BF16, {4352, 2, 3072}, {3074, 4352 * 3074, 1}, 0);
  EXPECT_TRUE(mentions(can_use(e), "a must have 8-byte aligned rows"));  // a row every 3074 elements: 4-byte steps
  e.a = TensorView(fake(0x5000000000ull), DType::BF16, {4352, 2, 3072}, {3072, 2 * 4352 * 3072, 2}, 0);
  EXPECT_TRUE(mentions(can_use(e), "a must have a contiguous last dim"));
  e.a = TensorView(fake(0x5000000000ull), DType::BF16, {4352, 2, 3072}, {3076, 4352 * 3076, 1}, 0);
  EXPECT_TRUE(can_use(e).ok);  // 8-byte aligned rows are enough (the streamed kernels then load a per row)
  // the row indexer the kernels take for a places row r = s B + b at s * 3072 + b * 4352 * 3072
  difuse_tensor_view a = e.a, h = e.c.x;
  a.strides[0] = 3072;
  a.strides[1] = 4352 * 3072;
  const auto ix = difuse::norm::broadcast_row_indexer(a, h).prepare(4352 * 2);
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{4351 * 2 + 1}})
    EXPECT_EQ(ix.offset(r), (r / 2) * 3072 + (r % 2) * 4352 * 3072) << r;
}

TEST(GatedResidualRmsNormModulatePredicate, EveryViolationIsListed) {
  ResidualCall r = ltx2_residual();
  r.a.sizes[1] = 6143;
  r.gate.dtype = DIFUSE_F32;
  r.residual.data = fake(0x100000000ull + 64);  // overlaps h without being h
  r.c.x.sizes[0] = 1;
  r.c.x.sizes[1] = 8;  // 8 rows: too few for the replayed mean
  const auto s = can_use(r);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "a must have the shape of h"));
  EXPECT_TRUE(mentions(s, "gate must be bf16"));
  EXPECT_TRUE(mentions(s, "residual must be h itself (in place) or not overlap it"));
  EXPECT_TRUE(mentions(s, "at least 16 rows"));
  ResidualCall o = ltx2_residual();
  o.residual = o.c.out;
  EXPECT_TRUE(mentions(can_use(o), "residual must not overlap a, gate, weight, scale, shift or out"));
  ResidualCall m = ltx2_residual();
  m.a.data = fake(0x5000000002ull);
  EXPECT_TRUE(mentions(can_use(m), "a must have 8-byte aligned rows"));
}

TEST(GatedResidualRmsNormModulatePredicate, OutputReasonsNameH) {
  // out must match h (the norm's input here is the new residual, not an x): the reasons said "x" before.
  ResidualCall r = ltx2_residual();
  r.c.out.sizes[1] = 6143;
  r.c.out.device = 1;
  const auto s = can_use(r);
  EXPECT_TRUE(mentions(s, "out must have the shape of h")) << s.reasons.size();
  EXPECT_TRUE(mentions(s, "out must be on the device of h"));
  EXPECT_FALSE(mentions(s, "of x"));
}

TEST(RmsNormModulatePredicate, BroadcastRowIndexerFollowsTorchsRules) {
  // For every row of x: unravel its leading index (row-major), align m's dims to the right, index 0 where m has
  // size 1, and sum index * stride; the kernel's RowIndexer must give the same element offset.
  struct Case {
    std::vector<int64_t> xs, ms, mst;
  };
  const std::vector<Case> cases = {
      {{7, 2, 64}, {2, 64}, {6 * 64, 1}},                    // ERNIE: [S, B, H] x, [B, H] chunk
      {{7, 2, 64}, {7, 2, 64}, {128, 64, 1}},                // ERNIE: materialized rows
      {{2, 5, 64}, {2, 1, 64}, {6 * 64, 6 * 64, 1}},          // LTX-2: [B, 1, D] table rows
      {{2, 5, 64}, {2, 5, 64}, {5 * 6 * 64, 6 * 64, 1}},      // LTX-2: per-token unbind views
      {{3, 2, 4, 64}, {2, 1, 64}, {1000, 0, 1}},             // rank 4 x, rank 3 m
      {{3, 2, 4, 64}, {3, 1, 4, 64}, {4000, 0, 100, 1}},
      {{40, 64}, {64}, {1}},                                  // one row for all
      {{40, 64}, {40, 64}, {65, 1}},                          // per row, odd stride
  };
  for (const auto& c : cases) {
    difuse_tensor_view x{}, m{};
    x.rank = static_cast<int32_t>(c.xs.size());
    m.rank = static_cast<int32_t>(c.ms.size());
    for (int d = 0; d < x.rank; ++d) x.sizes[d] = c.xs[d];
    for (int d = 0; d < m.rank; ++d) m.sizes[d] = c.ms[d], m.strides[d] = c.mst[d];
    const auto ix = difuse::norm::broadcast_row_indexer(m, x);
    int64_t rows = 1;
    for (int d = 0; d + 1 < x.rank; ++d) rows *= x.sizes[d];
    for (int64_t r = 0; r < rows; ++r) {
      int64_t rem = r, want = 0;
      for (int d = x.rank - 2; d >= 0; --d) {
        const int64_t i = rem % x.sizes[d];
        rem /= x.sizes[d];
        const int md = d - (x.rank - m.rank);
        if (md >= 0 && m.sizes[md] != 1) want += i * m.strides[md];
      }
      ASSERT_EQ(ix.offset(r), want) << "x rank " << x.rank << " m rank " << m.rank << " row " << r;
    }
    // every_row_distinct (the residual form's per-token gate rule): the offsets of all rows differ.
    std::set<int64_t> offsets;
    for (int64_t r = 0; r < rows; ++r) offsets.insert(ix.offset(r));
    EXPECT_EQ(ix.every_row_distinct(rows), static_cast<int64_t>(offsets.size()) == rows)
        << "x rank " << x.rank << " m rank " << m.rank;
  }
}

// The half-warp kernels leave out the additions of +0 into fresh accumulators (mean_first_push_*) and of the two
// unused accumulators (mean_lane_total_first_two): the same bits for every bf16 input, specials included.
TEST(MeanSchedule, FirstPushesAndTwoLaneTotalAreTheSameBits) {
  using difuse::norm::MeanLane;
  std::vector<float> all;
  for (uint32_t b = 0; b < 65536; ++b) all.push_back(bf16_to_float(static_cast<uint16_t>(b)));
  for (size_t i = 0; i < all.size(); ++i) {
    MeanLane full, first;
    difuse::norm::mean_push_scalar(full, 1, all[i]);
    difuse::norm::mean_first_push_scalar(first, 1, all[i]);
    ASSERT_EQ(float_bits(full.a[1]), float_bits(first.a[1])) << "bf16 0x" << std::hex << i;
    MeanLane full4, first4;  // each slot sees every pattern, beside three others
    const float x[4] = {all[i], all[(i * 7 + 1) % 65536], all[(i * 13 + 2) % 65536], all[(i * 31 + 3) % 65536]};
    difuse::norm::mean_push_vec4(full4, x[0], x[1], x[2], x[3]);
    difuse::norm::mean_first_push_vec4(first4, x[0], x[1], x[2], x[3]);
    for (int k = 0; k < 4; ++k) ASSERT_EQ(float_bits(full4.a[k]), float_bits(first4.a[k])) << "bf16 0x" << std::hex << i;
  }
  // two pushed accumulators (as the 64-element span lanes push them), 2 and 3 at +0
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> pick(0, 65535);
  for (int t = 0; t < 200000; ++t) {
    const uint32_t a = t < 65536 ? static_cast<uint32_t>(t) : pick(rng), b = pick(rng);
    MeanLane l;
    difuse::norm::mean_push_scalar(l, 0, all[a]);
    difuse::norm::mean_push_scalar(l, 1, all[b]);
    ASSERT_EQ(float_bits(difuse::norm::mean_lane_total(l)), float_bits(difuse::norm::mean_lane_total_first_two(l)))
        << a << " " << b;
  }
  // and the case the argument rests on: a -0 accumulator would differ (so the test can tell the two apart)
  MeanLane neg;
  neg.a[0] = neg.a[1] = -0.0f;  // -0 + -0 is -0; + +0 makes it +0
  EXPECT_NE(float_bits(difuse::norm::mean_lane_total(neg)), float_bits(difuse::norm::mean_lane_total_first_two(neg)));
}

// diffusers_rms_pair (two elements per pack-convert) against diffusers_rms_value per half: every bf16 pattern in
// each half, random partners and weights, rstd from ordinary to extreme (inf, 0, NaN, subnormal), with and
// without a weight.
TEST(MeanSchedule, DiffusersRmsPairIsTheElementChainPacked) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> pick(0, 65535);
  const float rstds[] = {1.0f, 0.37f, 3.1e4f, 7.3e-3f, 1e30f, 1e-30f, 1e-40f, 0.0f, INFINITY, NAN, 1.9e19f};
  for (uint32_t b = 0; b < 65536; ++b) {
    for (int t = 0; t < 4; ++t) {
      const uint32_t x2 = (t % 2 ? b : pick(rng)) | ((t % 2 ? pick(rng) : b) << 16);
      const uint32_t w2 = pick(rng) | (pick(rng) << 16);
      const float rstd = rstds[(b + 3 * t) % (sizeof(rstds) / sizeof(rstds[0]))];
      for (bool has_w : {false, true}) {
        const uint32_t want = pack_bf16x2(
            difuse::norm::diffusers_rms_value(bf16_lo(x2), rstd, has_w, bf16_lo(w2)),
            difuse::norm::diffusers_rms_value(bf16_hi(x2), rstd, has_w, bf16_hi(w2)));
        ASSERT_EQ(difuse::norm::diffusers_rms_pair(x2, rstd, has_w, w2), want)
            << std::hex << x2 << " " << w2 << " rstd " << rstd << " w " << has_w;
      }
    }
  }
}
