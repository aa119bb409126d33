// The C ABI's error path and layernorm_modulate's predicate: every violated precondition is listed,
// nothing is launched. Predicates never touch memory, so fake device addresses are enough here.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "activation/gelu_tanh.h"
#include "difuse/difuse.hpp"
#include "norm/layernorm_modulate.h"

using difuse::DType;
using difuse::TensorView;

namespace {

void* fake(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

struct Case {
  TensorView out, x, scale, shift;
};

// A valid FLUX-like call: x [B, L, H], scale/shift column chunks of a [B, 6H] projection.
Case valid(int64_t B = 2, int64_t L = 300, int64_t H = 3072) {
  Case c;
  c.x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, L, H}, 0);
  c.out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, L, H}, 0);
  c.scale = TensorView(fake(0x2000000000ull + 2 * H), DType::BF16, {B, H}, {6 * H, 1}, 0);
  c.shift = TensorView(fake(0x2000000000ull), DType::BF16, {B, H}, {6 * H, 1}, 0);
  return c;
}

difuse::Support can_use(const Case& c, double eps = 1e-6) {
  return difuse::can_use_layernorm_modulate(c.out, c.x, c.scale, c.shift, eps);
}

bool mentions(const difuse::Support& s, const std::string& needle) {
  for (const auto& r : s.reasons)
    if (r.find(needle) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST(CApi, ValidCallPassesThePredicate) {
  EXPECT_TRUE(can_use(valid()).ok);
  EXPECT_TRUE(can_use(valid(1, 1, 4)).ok);
  EXPECT_TRUE(can_use(valid(1, 3, 1 << 24)).ok);
  EXPECT_TRUE(can_use(valid(4, 33000, 16384)).ok);
}

TEST(CApi, PerTokenModulationIsAccepted) {
  Case c = valid(2, 300, 3072);
  c.scale = TensorView(fake(0x2000000000ull + 2 * 3072), DType::BF16, {2, 300, 3072}, {300 * 6 * 3072, 6 * 3072, 1}, 0);
  EXPECT_TRUE(can_use(c).ok);
  c.scale.sizes[1] = 299;
  EXPECT_TRUE(mentions(can_use(c), "scale must have shape [2, 3072] or [2, 300, 3072]"));
}

TEST(CApi, EveryViolationIsListed) {
  Case c = valid();
  c.x.dtype = DIFUSE_F32;
  c.scale.strides[1] = 2;
  c.shift.device = 1;
  c.out.device = -1;
  const auto s = can_use(c);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "x must be bf16"));
  EXPECT_TRUE(mentions(s, "scale must have a contiguous last dim"));
  EXPECT_TRUE(mentions(s, "shift must be on the device of x"));
  EXPECT_TRUE(mentions(s, "out must be on a CUDA device"));
  EXPECT_GE(s.reasons.size(), 4u);
}

TEST(CApi, RefusesWhatAtenSendsDownItsOtherPath) {
  Case c = valid(1, 7, 3070);
  c.scale.sizes[1] = c.shift.sizes[1] = 3070;
  EXPECT_TRUE(mentions(can_use(c), "multiple of 4"));
  Case m = valid();
  m.x.data = fake(0x100000002ull);  // a contiguous view at an odd element offset
  EXPECT_TRUE(mentions(can_use(m), "8-byte aligned"));
  Case big = valid(1, 2, (int64_t{1} << 24) + 4);
  big.scale.sizes[1] = big.shift.sizes[1] = big.x.sizes[2];
  EXPECT_TRUE(mentions(can_use(big), "at most 2^24"));
}

TEST(CApi, RefusesLayoutsAndShapes) {
  Case c = valid();
  c.x.strides[1] = 2 * 3072;  // non-contiguous x
  EXPECT_TRUE(mentions(can_use(c), "x must be contiguous"));
  Case r = valid();
  r.x.rank = 2;
  EXPECT_TRUE(mentions(can_use(r), "rank 3"));
  Case s = valid();
  s.scale.sizes[0] = 1;
  EXPECT_TRUE(mentions(can_use(s), "scale must have shape [2, 3072]"));
  Case o = valid();
  o.out.data = o.x.data;
  EXPECT_TRUE(mentions(can_use(o), "must not overlap"));
  Case n = valid();
  n.shift.strides[0] = -3072;
  EXPECT_TRUE(mentions(can_use(n), "shift must have non-negative strides"));
}

TEST(CApi, EmptyInputsAreSupportedAndLaunchNothing) {
  Case c = valid(2, 0, 3072);
  c.x.data = c.out.data = nullptr;
  c.x.strides[0] = c.x.strides[1] = 3072;  // torch's strides for an empty [2, 0, 3072]
  c.out.strides[0] = c.out.strides[1] = 3072;
  EXPECT_TRUE(can_use(c).ok);
  EXPECT_NO_THROW(difuse::layernorm_modulate(c.out, c.x, c.scale, c.shift, 1e-6));
}

TEST(CApi, LauncherFailsWithTheFullListAndWritesNothing) {
  Case c = valid();
  c.x.device = c.out.device = c.scale.device = c.shift.device = -1;  // host memory
  c.x.dtype = DIFUSE_F16;
  try {
    difuse::layernorm_modulate(c.out, c.x, c.scale, c.shift, 1e-6);
    FAIL() << "expected difuse::Unsupported";
  } catch (const difuse::Unsupported& e) {
    EXPECT_EQ(e.status(), DIFUSE_ERR_UNSUPPORTED);
    EXPECT_GE(e.reasons().size(), 5u);  // 4 x host memory + dtype
    EXPECT_NE(std::string(e.what()).find("difuse::layernorm_modulate: unsupported input"), std::string::npos);
  }
  // The C ABI reports the same through a status and the thread's last error.
  EXPECT_EQ(difuse_layernorm_modulate(&c.out, &c.x, &c.scale, &c.shift, 1e-6, nullptr), DIFUSE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(difuse_last_error()).find("x must be bf16, got fp16"), std::string::npos);
}

TEST(CApi, NullAndMalformedViews) {
  Case c = valid();
  EXPECT_EQ(difuse_layernorm_modulate(nullptr, &c.x, &c.scale, &c.shift, 1e-6, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("out is a NULL"), std::string::npos);
  c.x.rank = 9;
  EXPECT_EQ(difuse_can_use_layernorm_modulate(&c.out, &c.x, &c.scale, &c.shift, 1e-6), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("rank 9"), std::string::npos);
  c = valid();
  c.scale.sizes[0] = -2;  // a size no tensor has: refused before any predicate multiplies sizes
  EXPECT_EQ(difuse_can_use_layernorm_modulate(&c.out, &c.x, &c.scale, &c.shift, 1e-6), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("scale has a negative size -2 in dim 0"), std::string::npos)
      << difuse_last_error();
  // sizes whose product overflows int64 (it wrapped to 0: an "empty" view every predicate accepted)
  const TensorView huge(nullptr, DType::BF16, {int64_t{1} << 32, int64_t{1} << 32, 1024}, {0, 0, 1}, 0);
  EXPECT_EQ(difuse_can_use_gelu_tanh(&huge, &huge), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("more than 2^63 elements"), std::string::npos)
      << difuse_last_error();
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::BF16, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 0), difuse::Error);
}

TEST(EnvKnobs, OnlyAWholeIntegerCounts) {
  int v = -5;
  EXPECT_TRUE(difuse::detail::parse_knob_int("K", "24", v) && v == 24);
  EXPECT_TRUE(difuse::detail::parse_knob_int("K", "0", v) && v == 0);
  EXPECT_TRUE(difuse::detail::parse_knob_int("K", "-1", v) && v == -1);
  for (const char* bad : {"on", "true", "8x", "1e3", "0x10", "99999999999", " "}) {
    v = 42;
    EXPECT_FALSE(difuse::detail::parse_knob_int("K", bad, v)) << bad;
    EXPECT_EQ(v, 42) << bad;
  }
  ::setenv("DIFUSE_TEST_KNOB", "on", 1);
  EXPECT_EQ(difuse::detail::env_knob_or("DIFUSE_TEST_KNOB", 7), 7);  // garbage: the default, not 0 ("off")
  EXPECT_EQ(difuse::detail::positive_env_knob("DIFUSE_TEST_KNOB"), 0);
  ::setenv("DIFUSE_TEST_KNOB", "12", 1);
  EXPECT_EQ(difuse::detail::env_knob_or("DIFUSE_TEST_KNOB", 7), 12);
  EXPECT_EQ(difuse::detail::positive_env_knob("DIFUSE_TEST_KNOB"), 12);
  ::unsetenv("DIFUSE_TEST_KNOB");
  EXPECT_EQ(difuse::detail::env_knob_or("DIFUSE_TEST_KNOB", 7), 7);
}

TEST(DeviceSlots, DevicesOutsideTheCachesAreRefused) {
  EXPECT_EQ(difuse::detail::device_slot(0), 0);
  EXPECT_EQ(difuse::detail::device_slot(63), 63);
  EXPECT_THROW(difuse::detail::device_slot(64), difuse::detail::Failure);
  EXPECT_THROW(difuse::detail::device_slot(-1), difuse::detail::Failure);
}

// DRAM bytes per SM cycle from the runtime's clocks (kHz) and bus width, and gelu_tanh's table policy on it: an H100
// SXM (2,619 MHz HBM3 on 5,120 bits, 1,980 MHz SMs) computes on all 132 SMs and takes the table on 94 (the H200
// proxy), an H200 (HBM3e ~3.2 GHz on 6,144 bits) takes the table; DIFUSE_GELU_TABLE=0|1 overrides either way.
TEST(DevicePolicy, DramBytesPerSmCycleAndTheGeluTable) {
  using difuse::activation::gelu_table_pays;
  const double h100 = difuse::detail::dram_bytes_per_cycle(2619000, 5120, 1980000);
  EXPECT_NEAR(h100, 1693.1, 0.1);
  EXPECT_NEAR(h100 / 132, 12.83, 0.01);
  const double h200 = difuse::detail::dram_bytes_per_cycle(3201000, 6144, 1980000);
  EXPECT_NEAR(h200 / 132, 18.81, 0.01);
  EXPECT_EQ(difuse::detail::dram_bytes_per_cycle(2619000, 5120, 0), 0.0);  // a clock or width not reported
  EXPECT_EQ(difuse::detail::dram_bytes_per_cycle(0, 5120, 1980000), 0.0);
  EXPECT_EQ(difuse::detail::dram_bytes_per_cycle(2619000, 0, 1980000), 0.0);
  EXPECT_FALSE(gelu_table_pays(h100 / 132, -1));
  EXPECT_TRUE(gelu_table_pays(h100 / 94, -1));
  EXPECT_TRUE(gelu_table_pays(h200 / 132, -1));
  EXPECT_TRUE(gelu_table_pays(h100 / 132, 1));
  EXPECT_FALSE(gelu_table_pays(h200 / 132, 0));
  EXPECT_FALSE(gelu_table_pays(h100 / 132, 2));  // an unknown knob value leaves the choice to the device
  EXPECT_TRUE(gelu_table_pays(h200 / 132, 2));
  EXPECT_TRUE(gelu_table_pays(0.0, -1));  // clocks not reported: the table, as before the policy
  EXPECT_FALSE(gelu_table_pays(0.0, 0));
}

TEST(DeviceSlots, PredicatesNameADevicePastTheCaches) {
  // The launchers refuse ordinals past 63 (device_slot above); the predicates say so as a reason, so a caller that
  // asks first falls back instead of failing at the launch.
  Case c = valid();
  c.x.device = c.out.device = c.scale.device = c.shift.device = 63;
  EXPECT_TRUE(can_use(c).ok);
  c.x.device = c.out.device = c.scale.device = c.shift.device = 64;
  EXPECT_TRUE(mentions(can_use(c), "x is on cuda:64, outside the devices 0..63 difuse supports"));
  EXPECT_TRUE(mentions(can_use(c), "shift is on cuda:64"));
  EXPECT_FALSE(mentions(can_use(c), "host memory"));
  EXPECT_TRUE(mentions(difuse::can_use_gated_residual(c.out, c.x, c.x, c.scale), "gate is on cuda:64"));
  EXPECT_TRUE(mentions(difuse::can_use_gelu_tanh(c.out, c.x), "out is on cuda:64"));
  const TensorView w = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {3072}, 64);
  EXPECT_TRUE(mentions(difuse::can_use_rms_norm(c.out, c.x, &w, 1e-6), "x is on cuda:64"));
  c.x.device = -1;
  EXPECT_TRUE(mentions(can_use(c), "x must be on a CUDA device, got host memory"));
}

TEST(CApi, LastErrorIsPerThreadAndClearedOnSuccess) {
  Case bad = valid();
  bad.x.dtype = DIFUSE_I64;
  ASSERT_EQ(difuse_can_use_layernorm_modulate(&bad.out, &bad.x, &bad.scale, &bad.shift, 1e-6), DIFUSE_ERR_UNSUPPORTED);
  std::string other;
  std::thread([&] { other = difuse_last_error(); }).join();
  EXPECT_TRUE(other.empty());
  EXPECT_NE(std::string(difuse_last_error()).find("int64"), std::string::npos);
  Case good = valid();
  ASSERT_EQ(difuse_can_use_layernorm_modulate(&good.out, &good.x, &good.scale, &good.shift, 1e-6), DIFUSE_OK);
  EXPECT_STREQ(difuse_last_error(), "");
}

TEST(CApi, NamesAndVersion) {
  EXPECT_STREQ(difuse_status_name(DIFUSE_ERR_UNSUPPORTED), "unsupported");
  EXPECT_STREQ(difuse_dtype_name(DIFUSE_BF16), "bf16");
  EXPECT_STREQ(difuse_dtype_name(DIFUSE_F8E4M3), "fp8_e4m3");
  EXPECT_STREQ(difuse_dtype_name(99), "unknown_dtype");
  EXPECT_STREQ(difuse_version(), "0.1.0");
}

TEST(LayernormModulateConfig, PicksTheScheduleByWidthAndAlignment) {
  using difuse::norm::layernorm_modulate_config;
  auto c = layernorm_modulate_config(3072, true);
  EXPECT_EQ(c.threads_per_row, 64);
  EXPECT_TRUE(c.paired);
  EXPECT_EQ(c.sweeps, 6);
  EXPECT_FALSE(layernorm_modulate_config(3076, true).paired);  // H % 8 != 0: 8-byte accesses
  EXPECT_FALSE(layernorm_modulate_config(3072, false).paired);
  EXPECT_EQ(layernorm_modulate_config(4, true).sweeps, 1);
  EXPECT_EQ(layernorm_modulate_config(3584, true).threads_per_row, 64);  // 7 sweeps: the last two-warp width
  EXPECT_EQ(layernorm_modulate_config(3588, true).threads_per_row, 128);
  c = layernorm_modulate_config(5120, true);
  EXPECT_EQ(c.threads_per_row, 128);
  EXPECT_FALSE(c.paired);
  EXPECT_EQ(c.sweeps, 10);
  c = layernorm_modulate_config(16384, true);
  EXPECT_EQ(c.threads_per_row, 128);
  EXPECT_FALSE(c.paired);
  EXPECT_EQ(c.sweeps, 32);
  EXPECT_EQ(layernorm_modulate_config(24576, true).threads_per_row, 128);
  EXPECT_EQ(layernorm_modulate_config(24580, true).threads_per_row, 0);
}

// layernorm_modulate: four warps per row for few rows at 3-7 sweeps, the width's schedule otherwise.
TEST(LayernormModulateConfig, FewRowsTakeFourWarpsFrom1024To3584) {
  using difuse::norm::layernorm_modulate_rows_config;
  auto c = layernorm_modulate_rows_config(3072, true, 512);  // FLUX's text rows
  EXPECT_EQ(c.threads_per_row, 128);
  EXPECT_FALSE(c.paired);
  EXPECT_EQ(c.sweeps, 6);
  EXPECT_EQ(layernorm_modulate_rows_config(1536, true, 666).threads_per_row, 128);   // SD3.5's context, 3 sweeps
  EXPECT_EQ(layernorm_modulate_rows_config(3072, true, 1024).threads_per_row, 128);
  EXPECT_EQ(layernorm_modulate_rows_config(3072, true, 1025).threads_per_row, 64);
  EXPECT_TRUE(layernorm_modulate_rows_config(3072, true, 1025).paired);
  EXPECT_EQ(layernorm_modulate_rows_config(2240, true, 2048).threads_per_row, 64);   // 2x1024x2240
  EXPECT_EQ(layernorm_modulate_rows_config(1024, true, 600).threads_per_row, 64);    // 2 sweeps
  EXPECT_EQ(layernorm_modulate_rows_config(1028, true, 600).threads_per_row, 128);   // 3 sweeps, partial
  EXPECT_EQ(layernorm_modulate_rows_config(5120, true, 32760).threads_per_row, 128); // the width's four warps
  EXPECT_EQ(layernorm_modulate_rows_config(24580, true, 16).threads_per_row, 0);     // the two-pass kernel
}

// The streamed LayerNorms' consumer groups: one warp each up to the measured widths (plain 4096, GRLN 1536), two
// warps above; DIFUSE_LNMOD_STREAM_WARP's 1 and 0 override the width.
TEST(LayernormModulateConfig, StreamedRowsTakeOneWarpGroupsUpToTheMeasuredWidths) {
  using difuse::norm::stream_one_warp_groups;
  for (int64_t h : {512, 1536, 2432, 3072, 4096}) EXPECT_TRUE(stream_one_warp_groups(false, h, -1)) << h;
  for (int64_t h : {4104, 5120, 24576}) EXPECT_FALSE(stream_one_warp_groups(false, h, -1)) << h;
  for (int64_t h : {512, 1536}) EXPECT_TRUE(stream_one_warp_groups(true, h, -1)) << h;
  for (int64_t h : {1544, 2432, 3072, 5120}) EXPECT_FALSE(stream_one_warp_groups(true, h, -1)) << h;
  for (bool grln : {false, true}) {
    EXPECT_TRUE(stream_one_warp_groups(grln, 5120, 1));
    EXPECT_FALSE(stream_one_warp_groups(grln, 1536, 0));
  }
}

// The plain LayerNorms' streamed rows by default (no knob): >= 4096 rows with staged modulation rows, up to H = 4096
// on every device, wider rows (the two-warp groups: Wan 14B's 5120) only where DRAM outpaces the SMs (a whole H100 SXM,
// 12.83 bytes per SM cycle, ran 1x32760x5120 9 % faster staged at bf84066; the H200, 18.42, 13 % faster streamed).
TEST(LayernormModulateConfig, PlainStreamedRowsByDefaultByWidthAndDevice) {
  using difuse::detail::kDramOutpacesSmsBytesPerSmCycle;
  using difuse::norm::plain_layernorm_streamed_by_default;
  constexpr double kH200 = 18.42, kH100At94 = 18.01, kWholeH100 = 12.83;  // as read
  for (double device : {kH200, kH100At94, kWholeH100, 0.0}) {
    for (int64_t h : {1536, 2432, 3072, 4096}) {
      EXPECT_TRUE(plain_layernorm_streamed_by_default(32760, h, true, device)) << h << " " << device;
      EXPECT_TRUE(plain_layernorm_streamed_by_default(4096, h, true, device)) << h << " " << device;
      EXPECT_FALSE(plain_layernorm_streamed_by_default(4095, h, true, device)) << h << " " << device;  // few rows
      EXPECT_FALSE(plain_layernorm_streamed_by_default(32760, h, false, device)) << h << " " << device;  // no smod
    }
    EXPECT_FALSE(plain_layernorm_streamed_by_default(32760, 5120, false, device)) << device;
  }
  for (int64_t h : {4104, 4224, 5120, 24576}) {
    for (double device : {kH200, kH100At94, kDramOutpacesSmsBytesPerSmCycle, 0.0})
      EXPECT_TRUE(plain_layernorm_streamed_by_default(32760, h, true, device)) << h << " " << device;
    for (double device : {kWholeH100, kDramOutpacesSmsBytesPerSmCycle - 0.01})
      EXPECT_FALSE(plain_layernorm_streamed_by_default(32760, h, true, device)) << h << " " << device;
  }
}

// Many rows at <= 3 sweeps: one warp per row (layernorm_modulate and the fp32 norms), the width's schedule otherwise.
TEST(LayernormModulateConfig, ManyNarrowRowsTakeOneWarp) {
  using difuse::norm::layernorm_fp32_rows_config;
  using difuse::norm::layernorm_modulate_rows_config;
  auto c = layernorm_modulate_rows_config(1536, true, 32760);  // Wan 2.1 1.3B
  EXPECT_EQ(c.threads_per_row, 32);
  EXPECT_TRUE(c.paired);
  EXPECT_EQ(c.sweeps, 3);
  EXPECT_FALSE(layernorm_modulate_rows_config(1536, false, 32760).paired);
  EXPECT_EQ(layernorm_modulate_rows_config(1536, true, 8192).threads_per_row, 32);   // SD3.5-medium, CFG batch 2
  EXPECT_EQ(layernorm_modulate_rows_config(1536, true, 8191).threads_per_row, 64);
  EXPECT_EQ(layernorm_modulate_rows_config(1536, true, 4096).threads_per_row, 64);   // not measured: two warps
  EXPECT_EQ(layernorm_modulate_rows_config(1540, true, 32760).threads_per_row, 64);  // 4 sweeps
  EXPECT_EQ(layernorm_modulate_rows_config(512, true, 32760).threads_per_row, 32);   // 1 sweep
  EXPECT_EQ(layernorm_modulate_rows_config(3072, true, 32760).threads_per_row, 64);
  EXPECT_EQ(layernorm_modulate_rows_config(5120, true, 32760).threads_per_row, 128);
  EXPECT_EQ(layernorm_modulate_rows_config(1536, true, 666).threads_per_row, 128);   // few rows: four warps
  c = layernorm_fp32_rows_config(1536, true, 32760);
  EXPECT_EQ(c.threads_per_row, 32);
  EXPECT_EQ(c.sweeps, 3);
  EXPECT_EQ(layernorm_fp32_rows_config(1536, true, 600).threads_per_row, 64);  // fp32 rows: no four-warp rule
  EXPECT_EQ(layernorm_fp32_rows_config(5120, true, 32760).threads_per_row, 128);
  EXPECT_EQ(layernorm_fp32_rows_config(1536, true, 8191).threads_per_row, 64);
}

// GRLN: four warps per row for few rows at 5-7 sweeps, the plain schedule otherwise.
TEST(LayernormModulateConfig, GatedResidualTakesFourWarpsForFewRowsAt3072) {
  using difuse::norm::gated_residual_layernorm_modulate_config;
  using difuse::norm::layernorm_modulate_config;
  auto c = gated_residual_layernorm_modulate_config(3072, true, 512);  // FLUX's text rows
  EXPECT_EQ(c.threads_per_row, 128);
  EXPECT_FALSE(c.paired);
  EXPECT_EQ(c.sweeps, 6);
  EXPECT_EQ(gated_residual_layernorm_modulate_config(3072, true, 1024).threads_per_row, 128);
  EXPECT_EQ(gated_residual_layernorm_modulate_config(3072, true, 1025).threads_per_row, 64);
  EXPECT_EQ(gated_residual_layernorm_modulate_config(3072, true, 4096).threads_per_row, 64);
  EXPECT_TRUE(gated_residual_layernorm_modulate_config(3072, true, 4096).paired);
  EXPECT_EQ(gated_residual_layernorm_modulate_config(3584, true, 600).threads_per_row, 128);  // 7 sweeps
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2564, true, 600).threads_per_row, 128);  // 6 sweeps, partial
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2560, true, 600).threads_per_row, 128);  // 5 sweeps
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2432, true, 666).threads_per_row, 128);  // SD3.5-large's context
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2052, true, 600).threads_per_row, 128);  // 5 sweeps, partial
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2048, true, 600).threads_per_row, 64);   // 4 sweeps
  EXPECT_EQ(gated_residual_layernorm_modulate_config(2432, true, 8192).threads_per_row, 64);  // SD3.5's image rows
  // many narrow rows: the 32-register two-warp kernel, unpaired
  c = gated_residual_layernorm_modulate_config(1536, true, 8192);  // 2x4096x1536
  EXPECT_EQ(c.threads_per_row, 64);
  EXPECT_TRUE(c.dense);
  EXPECT_FALSE(c.paired);
  EXPECT_TRUE(gated_residual_layernorm_modulate_config(512, true, 32760).dense);     // 1 sweep
  EXPECT_FALSE(gated_residual_layernorm_modulate_config(1536, true, 8191).dense);
  EXPECT_FALSE(gated_residual_layernorm_modulate_config(1540, true, 8192).dense);    // 4 sweeps
  EXPECT_FALSE(gated_residual_layernorm_modulate_config(3072, true, 4096).dense);
  EXPECT_FALSE(gated_residual_layernorm_modulate_config(1536, true, 666).dense);     // few rows
  EXPECT_FALSE(layernorm_modulate_config(1536, true).dense);
  EXPECT_EQ(gated_residual_layernorm_modulate_config(1536, true, 666).threads_per_row, 64);   // SD3.5's context
  EXPECT_EQ(layernorm_modulate_config(3072, true).threads_per_row, 64);  // the plain op keeps two warps
  c = gated_residual_layernorm_modulate_config(5120, true, 77);          // already four warps
  EXPECT_EQ(c.threads_per_row, 128);
  EXPECT_EQ(c.sweeps, 10);
}

// Wan's fp32 rows: float4 loads only where every row of both tensors starts 16-byte aligned.
TEST(LayernormModulate, Fp32RowsReadAsFloat4OnlyWhenAligned) {
  using difuse::norm::layernorm_fp32_rows_vec4;
  const int64_t B = 2, H = 5120;
  // [B, 1, H] chunks 1 and 2 of a [B, 6, H] fp32 table (the WanTransformerBlock's scale_shift_table + temb)
  const TensorView sc(fake(0x3000000000ull + 4 * H), DType::F32, {B, 1, H}, {6 * H, H, 1}, 0);
  const TensorView sh(fake(0x3000000000ull + 8 * H), DType::F32, {B, 1, H}, {6 * H, H, 1}, 0);
  EXPECT_TRUE(layernorm_fp32_rows_vec4(sc, sh));
  TensorView off = sh;
  off.data = fake(0x3000000000ull + 8 * H + 8);
  EXPECT_FALSE(layernorm_fp32_rows_vec4(sc, off));  // 8-byte aligned only
  TensorView stride = sc;
  stride.strides[0] = 6 * H + 2;  // the second batch's row is not 16-byte aligned
  EXPECT_FALSE(layernorm_fp32_rows_vec4(stride, sh));
  TensorView tok(fake(0x3000000000ull), DType::F32, {B, 7, H}, {7 * H, H, 1}, 0);  // per token
  EXPECT_TRUE(layernorm_fp32_rows_vec4(tok, tok));
  tok.strides[2] = 2;
  EXPECT_FALSE(layernorm_fp32_rows_vec4(tok, sh));  // not contiguous in H
  const TensorView w(fake(0x4000000000ull), DType::F32, {B, H}, {0, 1}, 0);  // norm2's weight as rows
  EXPECT_TRUE(layernorm_fp32_rows_vec4(w, w));
}

TEST(Support, RenameReplacesWholeWordsOnly) {
  difuse::detail::Support s;
  s.violations = {"x must be contiguous, got bf16[4, 4096x1] on cuda:0", "out must be on the device of x (cuda:0)",
                  "out must not overlap x, scale or shift", "max_x and x_ stay", "x"};
  s.rename("x", "h");
  EXPECT_EQ(s.violations[0], "h must be contiguous, got bf16[4, 4096x1] on cuda:0");
  EXPECT_EQ(s.violations[1], "out must be on the device of h (cuda:0)");
  EXPECT_EQ(s.violations[2], "out must not overlap h, scale or shift");
  EXPECT_EQ(s.violations[3], "max_x and x_ stay");
  EXPECT_EQ(s.violations[4], "h");
  s.rename("scale", "weight_scale");  // the new name may contain the old one
  EXPECT_EQ(s.violations[2], "out must not overlap h, weight_scale or shift");
}

// GRLN asks the plain LayerNorm's predicate with h in x's place: its reasons name h; a NULL gate is refused.
TEST(GatedResidualLayernormModulate, ReasonsNameHAndANullGateIsRefused) {
  const int64_t B = 1, L = 16, H = 3072;
  const auto h = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, L, H}, 0);
  const auto a = TensorView::contiguous(fake(0x200000000ull), DType::BF16, {B, L, H}, 0);
  const auto out = TensorView::contiguous(fake(0x300000000ull), DType::BF16, {B, L, H}, 0);
  const auto res = TensorView::contiguous(fake(0x400000000ull), DType::BF16, {B, L, H}, 0);
  const TensorView gate(fake(0x500000000ull), DType::BF16, {B, H}, {6 * H, 1}, 0);
  const TensorView scale(fake(0x500000000ull + 2 * H), DType::BF16, {B, H}, {6 * H, 1}, 0);
  const TensorView shift(fake(0x500000000ull + 4 * H), DType::BF16, {B, H}, {6 * H, 1}, 0);
  using difuse::can_use_gated_residual_layernorm_modulate;  // through the C ABI
  EXPECT_TRUE(can_use_gated_residual_layernorm_modulate(out, res, h, a, gate, scale, shift, 1e-6).ok);
  TensorView h2 = h;
  h2.strides[1] = 2 * H;  // not contiguous
  TensorView out2 = out;
  out2.device = 1;
  std::string all;
  for (const auto& v : can_use_gated_residual_layernorm_modulate(out2, res, h2, a, gate, scale, shift, 1e-6).reasons)
    all += v + "\n";
  EXPECT_NE(all.find("h must be contiguous"), std::string::npos) << all;
  EXPECT_NE(all.find("out must be on the device of h"), std::string::npos) << all;
  EXPECT_EQ(all.find("x must"), std::string::npos) << all;
  EXPECT_EQ(all.find("of x"), std::string::npos) << all;
  TensorView null_gate = gate;
  null_gate.data = nullptr;
  std::string why;
  for (const auto& v : can_use_gated_residual_layernorm_modulate(out, res, h, a, null_gate, scale, shift, 1e-6).reasons)
    why += v;
  EXPECT_NE(why.find("gate has a null data pointer"), std::string::npos) << why;
}

// ---- gated_residual's predicate and vector width ----------------------------------------------------------
#include "modulate/gated_residual.h"

namespace {
struct GrCase {
  TensorView out, h, a, gate;
};
GrCase gr_valid(int64_t B = 2, int64_t L = 300, int64_t H = 3072) {
  GrCase c;
  c.h = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, L, H}, 0);
  c.a = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, L, H}, 0);
  c.out = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, L, H}, 0);
  c.gate = TensorView(fake(0x3000000000ull + 4 * H), DType::BF16, {B, H}, {6 * H, 1}, 0);
  return c;
}
difuse::Support gr_can_use(const GrCase& c) { return difuse::can_use_gated_residual(c.out, c.h, c.a, c.gate); }
}  // namespace

TEST(GatedResidual, ValidCallsPass) {
  EXPECT_TRUE(gr_can_use(gr_valid()).ok);
  GrCase inplace = gr_valid();
  inplace.out = inplace.h;
  EXPECT_TRUE(gr_can_use(inplace).ok);
  GrCase per_token = gr_valid(2, 7, 3);  // any H, per-token gate
  per_token.gate = TensorView(fake(0x3000000000ull), DType::BF16, {2, 7, 3}, {100, 10, 1}, 0);
  EXPECT_TRUE(gr_can_use(per_token).ok);
}

TEST(GatedResidual, EveryViolationIsListed) {
  GrCase c = gr_valid();
  c.h.dtype = DIFUSE_F16;
  c.a.sizes[2] = 3071;
  c.gate.strides[1] = 2;
  c.out.data = fake(0x100000000ull + 2);  // overlaps h without being h
  const auto s = gr_can_use(c);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "h must be bf16"));
  EXPECT_TRUE(mentions(s, "a must have the shape of h"));
  EXPECT_TRUE(mentions(s, "gate must have a contiguous last dim"));
  EXPECT_TRUE(mentions(s, "out must be h itself (in place) or not overlap it"));
}

TEST(GatedResidual, VectorWidthFollowsAlignment) {
  using difuse::modulate::gated_residual_vector_width;
  GrCase c = gr_valid();
  EXPECT_EQ(gated_residual_vector_width(c.out, c.h, c.a, c.gate), 8);
  c.a.data = fake(0x1000000000ull + 8);
  EXPECT_EQ(gated_residual_vector_width(c.out, c.h, c.a, c.gate), 4);
  c.a.data = fake(0x1000000000ull + 2);
  EXPECT_EQ(gated_residual_vector_width(c.out, c.h, c.a, c.gate), 1);
  GrCase odd = gr_valid(1, 5, 6);
  odd.gate.strides[0] = 6;
  EXPECT_EQ(gated_residual_vector_width(odd.out, odd.h, odd.a, odd.gate), 2);
}

TEST(GatedResidual, Fp32VectorWidthFollowsAlignmentOfEveryTensor) {
  using difuse::modulate::gated_residual_fp32_vector_width;
  const int64_t B = 1, L = 300, H = 5120;
  GrCase c = gr_valid(B, L, H);
  // Wan's gate: [B, 1, H] chunk of a [B, 6, H] fp32 table (chunk 2: 2H floats in, 16-byte aligned)
  c.gate = TensorView(fake(0x3000000000ull + 4 * 2 * H), DType::F32, {B, 1, H}, {6 * H, H, 1}, 0);
  EXPECT_EQ(gated_residual_fp32_vector_width(c.out, c.h, c.a, c.gate), 8);
  GrCase g8 = c;
  g8.gate.data = fake(0x3000000000ull + 8);  // float2-aligned gate
  EXPECT_EQ(gated_residual_fp32_vector_width(g8.out, g8.h, g8.a, g8.gate), 2);
  g8.gate.data = fake(0x3000000000ull + 4);  // float-aligned only
  EXPECT_EQ(gated_residual_fp32_vector_width(g8.out, g8.h, g8.a, g8.gate), 1);
  GrCase rs = c;
  rs.gate.strides[0] = 6 * H + 2;  // rows 8-byte apart from each other only
  EXPECT_EQ(gated_residual_fp32_vector_width(rs.out, rs.h, rs.a, rs.gate), 2);
  GrCase tok = c;  // per-token gate whose token stride breaks 16-byte rows
  tok.gate = TensorView(fake(0x3000000000ull), DType::F32, {B, L, H}, {L * (H + 2), H + 2, 1}, 0);
  EXPECT_EQ(gated_residual_fp32_vector_width(tok.out, tok.h, tok.a, tok.gate), 2);
  GrCase ha = c;
  ha.a.data = fake(0x1000000000ull + 4);
  EXPECT_EQ(gated_residual_fp32_vector_width(ha.out, ha.h, ha.a, ha.gate), 2);
  ha.out.data = fake(0x2000000000ull + 2);
  EXPECT_EQ(gated_residual_fp32_vector_width(ha.out, ha.h, ha.a, ha.gate), 1);
  GrCase odd = gr_valid(B, L, 5122);
  odd.gate = TensorView(fake(0x3000000000ull), DType::F32, {B, 5122}, {5122, 1}, 0);
  EXPECT_EQ(gated_residual_fp32_vector_width(odd.out, odd.h, odd.a, odd.gate), 2);
}

// ---- rms_norm's predicate ------------------------------------------------------------------------------------
TEST(RmsNorm, PredicateAcceptsSitesAndListsViolations) {
  // FLUX per-head q from a fused QKV projection: [1, 4608, 24, 128] view with strides (4608*9216, 9216, 128, 1).
  const TensorView q(fake(0x100000000ull), DType::BF16, {1, 4608, 24, 128}, {4608 * 9216, 9216, 128, 1}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 4608, 24, 128}, 0);
  const auto w = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {128}, 0);
  EXPECT_TRUE(difuse::can_use_rms_norm(out, q, &w, 1e-6).ok);
  EXPECT_TRUE(difuse::can_use_rms_norm(out, q, nullptr, 1e-6).ok);
  TensorView bad = q;
  bad.sizes[3] = 126;
  bad.data = fake(0x100000002ull);
  TensorView wbad = w;
  wbad.dtype = DIFUSE_F32;
  const auto s = difuse::can_use_rms_norm(out, bad, &wbad, 1e-6);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "multiple of 4"));
  EXPECT_TRUE(mentions(s, "8-byte aligned rows"));
  EXPECT_TRUE(mentions(s, "weight must be bf16"));
  EXPECT_TRUE(mentions(s, "out must have the shape of x"));
  // A contiguous but misaligned x is aten's two-kernel path: refused with that reason.
  TensorView c = TensorView::contiguous(fake(0x100000002ull), DType::BF16, {8, 128}, 0);
  const auto oc = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {8, 128}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rms_norm(oc, c, nullptr, 1e-6), "two-kernel"));
}

// ---- rms_norm_diffusers: the mean's factor and the replayed configurations ------------------------------------
#include "norm/rms_norm_diffusers.h"

TEST(RmsNormDiffusers, MeanFactorIsFormedLikeAten) {
  using difuse::norm::diffusers_mean_factor;
  EXPECT_EQ(diffusers_mean_factor(110592, 128), 1.0f / 128.0f);
  // rows * n = 16777227 is not representable in fp32: aten rounds the element count first (to 16777228),
  // and the factor then differs from RN(1/n). The kernel uses aten's formula whatever the width.
  EXPECT_EQ(static_cast<float>(int64_t{5592409} * 3), 16777228.0f);
  EXPECT_NE(diffusers_mean_factor(5592409, 3), 1.0f / 3.0f);
  EXPECT_EQ(diffusers_mean_factor(5592409, 3), 5592409.0f / 16777228.0f);
}

TEST(RmsNormDiffusers, PredicateListsTheUnreplayedConfigurations) {
  const auto x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {8, 130}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {8, 130}, 0);
  const auto s = difuse::can_use_rms_norm_diffusers(out, x, nullptr, 1e-6);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "at least 16 rows"));
  EXPECT_TRUE(mentions(s, "multiple of 4"));
  const auto q = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 4608, 24, 128}, 0);
  const auto oq = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 4608, 24, 128}, 0);
  const auto w = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {128}, 0);
  EXPECT_TRUE(difuse::can_use_rms_norm_diffusers(oq, q, &w, 1e-6).ok);
  // aten splits a row across the block's warps once ceil(N / 32) >= 256: 8160 is the widest replayed row.
  for (int64_t n : {int64_t{8160}, int64_t{8164}}) {
    const auto xw = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {64, n}, 0);
    const auto ow = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {64, n}, 0);
    const auto sw = difuse::can_use_rms_norm_diffusers(ow, xw, nullptr, 1e-6);
    EXPECT_EQ(sw.ok, n == 8160) << n;
    if (!sw.ok) {
      EXPECT_TRUE(mentions(sw, "[32, 8160]"));
    }
  }
}

// ---- Wan's fp32 chains: predicates ----------------------------------------------------------------------------
TEST(WanFp32, PredicatesAcceptTableChunksAndRefuseBf16Rows) {
  const int64_t H = 5120;
  const auto x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 32760, H}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 32760, H}, 0);
  const TensorView shift(fake(0x2000000000ull), DType::F32, {1, 1, H}, {6 * H, H, 1}, 0);  // chunk of [1, 6, H]
  const TensorView scale(fake(0x2000000000ull + 4 * H), DType::F32, {1, 1, H}, {6 * H, H, 1}, 0);
  EXPECT_EQ(difuse_can_use_layernorm_modulate_fp32(&out, &x, &scale, &shift, 1e-6), DIFUSE_OK) << difuse_last_error();
  TensorView bf = scale;
  bf.dtype = DIFUSE_BF16;
  EXPECT_EQ(difuse_can_use_layernorm_modulate_fp32(&out, &x, &bf, &shift, 1e-6), DIFUSE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(difuse_last_error()).find("scale must be fp32"), std::string::npos);
  const auto a = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {1, 32760, H}, 0);
  const TensorView gate(fake(0x2000000000ull + 8 * H), DType::F32, {1, 1, H}, {6 * H, H, 1}, 0);
  EXPECT_EQ(difuse_can_use_gated_residual_fp32(&out, &x, &a, &gate), DIFUSE_OK) << difuse_last_error();
  EXPECT_EQ(difuse_can_use_gated_residual_fp32(&out, &x, &a, &bf), DIFUSE_ERR_UNSUPPORTED);
  // fp32 rows 2 bytes off their element alignment (the C ABI can make them; torch cannot): the C ABI refuses the
  // view itself, and the core predicates (behind it) refuse them too, naming the tensor
  TensorView half = scale;
  half.data = fake(0x2000000000ull + 4 * H + 2);
  EXPECT_EQ(difuse_can_use_layernorm_modulate_fp32(&out, &x, &half, &shift, 1e-6), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("scale's data pointer is not aligned to its 4-byte elements"),
            std::string::npos);
  auto has = [](const difuse::detail::Support& s, const std::string& needle) {
    for (const auto& v : s.violations)
      if (v.find(needle) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(has(difuse::norm::can_use_layernorm_modulate_fp32(out, x, half, shift, 1e-6), "scale must be 4-byte aligned"));
  EXPECT_TRUE(has(difuse::norm::can_use_layernorm_modulate_fp32(out, x, scale, half, 1e-6), "shift must be 4-byte aligned"));
  TensorView gate2 = gate;
  gate2.data = fake(0x2000000000ull + 8 * H + 2);
  EXPECT_EQ(difuse_can_use_gated_residual_fp32(&out, &x, &a, &gate2), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(difuse::modulate::can_use_gated_residual_fp32(out, x, a, gate2), "gate must be 4-byte aligned"));
}

// The C ABI refuses views no tensor has: a pointer off its element alignment. A NULL pointer with elements is a
// meta or fake tensor's view (torch.compile's tracing asks the predicates through the binding): the predicates answer.
TEST(CApi, ViewsOffTheirElementAlignmentAreRefused) {
  const int64_t H = 3072;
  const auto x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 16, H}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 16, H}, 0);
  const TensorView gate(fake(0x3000000000ull), DType::BF16, {1, H}, {6 * H, 1}, 0);
  const auto a = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {1, 16, H}, 0);
  EXPECT_EQ(difuse_can_use_gated_residual(&out, &x, &a, &gate), DIFUSE_OK) << difuse_last_error();
  TensorView null_a = a;  // a meta tensor's view: the predicate's answer, not an invalid argument
  null_a.data = nullptr;
  EXPECT_NE(difuse_can_use_gated_residual(&out, &x, &null_a, &gate), DIFUSE_ERR_INVALID_ARGUMENT);
  TensorView odd = a;
  odd.data = fake(0x2000000000ull + 1);
  EXPECT_EQ(difuse_can_use_gated_residual(&out, &x, &odd, &gate), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("not aligned to its 2-byte elements"), std::string::npos);
  TensorView empty = a;  // no elements: no address needed
  empty.data = nullptr;
  empty.sizes[1] = 0;
  TensorView empty_x = x, empty_out = out;
  empty_x.sizes[1] = empty_out.sizes[1] = 0;
  EXPECT_EQ(difuse_can_use_gated_residual(&empty_out, &empty_x, &empty, &gate), DIFUSE_OK) << difuse_last_error();
}

// A launcher reads and writes the memory: elements behind a NULL pointer are refused before any predicate (some take
// such a view as absent: a NULL cos skipped qk_norm_rope's RoPE), while the predicates keep answering for them.
TEST(CApi, LaunchersRefuseElementsBehindANullPointer) {
  const int64_t H = 3072;
  const auto x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 16, H}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 16, H}, 0);
  const TensorView gate(fake(0x3000000000ull), DType::BF16, {1, H}, {6 * H, 1}, 0);
  TensorView null_a = TensorView::contiguous(nullptr, DType::BF16, {1, 16, H}, 0);
  EXPECT_NE(difuse_can_use_gated_residual(&out, &x, &null_a, &gate), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(difuse_gated_residual(&out, &x, &null_a, &gate, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("a has 49152 elements and a NULL data pointer"), std::string::npos)
      << difuse_last_error();
  TensorView null_w = TensorView::contiguous(nullptr, DType::BF16, {H}, 0);
  EXPECT_EQ(difuse_rms_norm(&out, &x, &null_w, 1e-6, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("weight has 3072 elements"), std::string::npos)
      << difuse_last_error();
  TensorView empty = null_a;  // no elements: nothing to read, no address needed
  empty.sizes[1] = 0;
  TensorView empty_x = x, empty_out = out;
  empty_x.sizes[1] = empty_out.sizes[1] = 0;
  EXPECT_NE(difuse_gated_residual(&empty_out, &empty_x, &empty, &gate, nullptr), DIFUSE_ERR_INVALID_ARGUMENT)
      << difuse_last_error();
}

#include "core/rows.h"

TEST(RowIndexer, WalksStridedLeadingDimsInRowMajorOrder) {
  // SD3.5's BHSD view of a [B=2, S=5, H=3, D=64] tensor: sizes [2, 3, 5, 64], strides (960, 64, 192, 1).
  const TensorView v(fake(0x1000), DType::BF16, {2, 3, 5, 64}, {960, 64, 192, 1}, 0);
  const auto ix = difuse::detail::row_indexer(v);
  int64_t r = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t s = 0; s < 5; ++s, ++r) EXPECT_EQ(ix.offset(r), b * 960 + h * 64 + s * 192) << r;
  const auto one = difuse::detail::row_indexer(TensorView::contiguous(fake(0x1000), DType::BF16, {128}, 0));
  EXPECT_EQ(one.offset(0), 0);
}

TEST(WanFp32, AffineNormPredicate) {
  const auto x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 32760, 5120}, 0);
  const auto out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, 32760, 5120}, 0);
  const auto w = TensorView::contiguous(fake(0x2000000000ull), DType::F32, {5120}, 0);
  const auto b = TensorView::contiguous(fake(0x2000100000ull), DType::F32, {5120}, 0);
  EXPECT_EQ(difuse_can_use_layernorm_affine_fp32(&out, &x, &w, &b, 1e-6), DIFUSE_OK) << difuse_last_error();
  TensorView wb = w;
  wb.dtype = DIFUSE_BF16;
  EXPECT_EQ(difuse_can_use_layernorm_affine_fp32(&out, &x, &wb, &b, 1e-6), DIFUSE_ERR_UNSUPPORTED);
  // the reasons name weight and bias, not the modulation predicate's scale and shift
  const std::string why = difuse_last_error();
  EXPECT_NE(why.find("weight must be fp32"), std::string::npos) << why;
  EXPECT_EQ(why.find("scale"), std::string::npos) << why;
  auto aligned_w = w;
  aligned_w.data = fake(0x1000000000ull);  // inside out: "out must not overlap weight or bias"
  EXPECT_EQ(difuse_can_use_layernorm_affine_fp32(&out, &x, &aligned_w, &b, 1e-6), DIFUSE_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(difuse_last_error()).find("overlap weight or bias"), std::string::npos) << difuse_last_error();
  TensorView b2 = b;
  b2.data = fake(0x2000100000ull + 2);
  EXPECT_EQ(difuse_can_use_layernorm_affine_fp32(&out, &x, &w, &b2, 1e-6), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_FALSE(difuse::norm::can_use_layernorm_affine_fp32(out, x, w, b2, 1e-6).ok());
}

// ---- qk_norm_rope: the FLUX prologue's predicate ----------------------------------------------------------------
namespace {

struct QkCase {
  TensorView q, k, v, q1, k1, v1, wq, wk, wq1, wk1, cos, sin, oq, ok, ov;
  difuse_qk_norm_rope_args args() const {
    difuse_qk_norm_rope_args a{};
    a.q = &q, a.k = &k, a.v = &v, a.q_weight = &wq, a.k_weight = &wk;
    a.q_first = &q1, a.k_first = &k1, a.v_first = &v1, a.q_first_weight = &wq1, a.k_first_weight = &wk1;
    a.cos = &cos, a.sin = &sin, a.q_out = &oq, a.k_out = &ok, a.v_out = &ov, a.eps = 1e-6;
    return a;
  }
};

// FLUX.1 double block: image q, k, v as chunks of a fused to_qkv output [1, 4096, 3 * 3072], text as separate
// projections [1, 512, 3072], joint outputs [1, 4608, 24, 128].
QkCase flux_case() {
  const int64_t S1 = 512, S2 = 4096, H = 24, D = 128, W = H * D;
  QkCase c;
  const uintptr_t img = 0x100000000ull;
  c.q = TensorView(fake(img), DType::BF16, {1, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
  c.k = TensorView(fake(img + 2 * W), DType::BF16, {1, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
  c.v = TensorView(fake(img + 4 * W), DType::BF16, {1, S2, H, D}, {S2 * 3 * W, 3 * W, D, 1}, 0);
  c.q1 = TensorView::contiguous(fake(0x200000000ull), DType::BF16, {1, S1, H, D}, 0);
  c.k1 = TensorView::contiguous(fake(0x210000000ull), DType::BF16, {1, S1, H, D}, 0);
  c.v1 = TensorView::contiguous(fake(0x220000000ull), DType::BF16, {1, S1, H, D}, 0);
  c.wq = TensorView::contiguous(fake(0x300000000ull), DType::BF16, {D}, 0);
  c.wk = TensorView::contiguous(fake(0x300001000ull), DType::BF16, {D}, 0);
  c.wq1 = TensorView::contiguous(fake(0x300002000ull), DType::BF16, {D}, 0);
  c.wk1 = TensorView::contiguous(fake(0x300003000ull), DType::BF16, {D}, 0);
  c.cos = TensorView::contiguous(fake(0x400000000ull), DType::F32, {S1 + S2, D}, 0);
  c.sin = TensorView::contiguous(fake(0x410000000ull), DType::F32, {S1 + S2, D}, 0);
  c.oq = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {1, S1 + S2, H, D}, 0);
  c.ok = TensorView::contiguous(fake(0x1100000000ull), DType::BF16, {1, S1 + S2, H, D}, 0);
  c.ov = TensorView::contiguous(fake(0x1200000000ull), DType::BF16, {1, S1 + S2, H, D}, 0);
  return c;
}

}  // namespace

TEST(QkNormRope, AcceptsTheFluxDoubleAndSingleBlockCalls) {
  const QkCase c = flux_case();
  const auto a = c.args();
  EXPECT_TRUE(difuse::can_use_qk_norm_rope(a).ok) << difuse_last_error();
  // single block: one stream of 4608 tokens, no v, no first stream
  QkCase s = flux_case();
  s.q = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {1, 4608, 24, 128}, 0);
  s.k = TensorView::contiguous(fake(0x180000000ull), DType::BF16, {1, 4608, 24, 128}, 0);
  auto b = s.args();
  b.v = b.v_out = b.q_first = b.k_first = b.v_first = b.q_first_weight = b.k_first_weight = nullptr;
  EXPECT_TRUE(difuse::can_use_qk_norm_rope(b).ok) << difuse_last_error();
}

TEST(QkNormRope, ListsEveryViolation) {
  QkCase c = flux_case();
  c.wq = TensorView::contiguous(fake(0x300000000ull), DType::F32, {128}, 0);        // fp32 weight
  c.cos = TensorView::contiguous(fake(0x400000000ull), DType::F32, {4096, 128}, 0);  // image tokens only
  c.ok = c.oq;                                                                       // outputs overlap
  auto a = c.args();
  a.v_first = nullptr;                                                               // v without v_first
  const auto s = difuse::can_use_qk_norm_rope(a);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "q_weight must be bf16"));
  EXPECT_TRUE(mentions(s, "cos must be a contiguous [4608, 128]"));
  EXPECT_TRUE(mentions(s, "q_out and k_out overlap"));
  EXPECT_TRUE(mentions(s, "v_first must be given exactly when v is"));
  EXPECT_GE(s.reasons.size(), 4u);
}

TEST(QkNormRope, LaunchRefusesATableWithElementsAndNoData) {
  // The predicate takes a view with a NULL pointer as a meta tensor's; at a launch a cos with elements and no data
  // would have been taken as "no RoPE" by the kernel's choice: the C ABI refuses it first.
  QkCase c = flux_case();
  c.cos.data = nullptr;
  const auto a = c.args();
  EXPECT_NE(difuse_can_use_qk_norm_rope(&a), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(difuse_qk_norm_rope(&a, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("cos has 589824 elements and a NULL data pointer"),
            std::string::npos)
      << difuse_last_error();
}

TEST(QkNormRope, RefusesAValueOutputOverlappingTheQOrKOutput) {
  for (int which = 0; which < 3; ++which) {
    QkCase c = flux_case();
    if (which == 0) c.ov = c.oq;  // v_out is q_out
    if (which == 1) c.ov = c.ok;  // v_out is k_out
    if (which == 2) c.ov.data = fake(0x1100000000ull + 256);  // inside k_out, not k_out itself
    const auto s = difuse::can_use_qk_norm_rope(c.args());
    ASSERT_FALSE(s.ok) << which;
    EXPECT_TRUE(mentions(s, which == 0 ? "v_out and q_out overlap" : "v_out and k_out overlap")) << which;
  }
}

TEST(QkNormRope, RefusesWideHeadsMisalignedRowsAndMissingOutputs) {
  QkCase c = flux_case();
  const int64_t D = 256;
  c.q = TensorView::contiguous(fake(0x100000002ull), DType::BF16, {1, 4096, 12, D}, 0);  // 2-byte aligned
  auto a = c.args();
  a.v_out = nullptr;
  const auto s = difuse::can_use_qk_norm_rope(a);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "q rows must be 8-byte aligned"));
  EXPECT_TRUE(mentions(s, "v_out must be given exactly when v is"));
  EXPECT_TRUE(mentions(s, "k and v must have q's shape"));
  auto none = c.args();
  none.q = nullptr;
  EXPECT_TRUE(mentions(difuse::can_use_qk_norm_rope(none), "q and k are required"));
}

// The streaming-ceiling probe (bench only): its arguments are checked before anything reaches the GPU, every
// violation listed; its variants have stable names the bench records carry.
TEST(StreamCopyProbe, ListsEveryViolationWithoutLaunching) {
  const difuse_status s = difuse_probe_stream_copy(fake(0x1000000008ull), nullptr, 24, 88, nullptr);
  ASSERT_EQ(s, DIFUSE_ERR_INVALID_ARGUMENT);
  const std::string e = difuse_last_error();
  EXPECT_NE(e.find("src is NULL"), std::string::npos) << e;
  EXPECT_NE(e.find("dst is not 16-byte aligned"), std::string::npos) << e;
  EXPECT_NE(e.find("nbytes = 24 is not a positive multiple of 16"), std::string::npos) << e;
  EXPECT_NE(e.find("variant 88 outside [0, 88)"), std::string::npos) << e;
  EXPECT_EQ(e.find("overlap"), std::string::npos) << e;
  EXPECT_EQ(difuse_probe_stream_copy(fake(0x1000000010ull), fake(0x1000000000ull), 32, 0, nullptr),
            DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("dst and src overlap"), std::string::npos);
  EXPECT_EQ(difuse_probe_stream_copy(fake(0x1000000000ull), fake(0x2000000000ull), 0, -1, nullptr),
            DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("variant -1 outside"), std::string::npos);
}

// The SM-partition probe (bench only, `bench ops --sms N`): malformed calls fail before any CUDA call, naming what is
// wrong; the launch SM count it sets is what every grid-sizing launcher reads.
TEST(SmPartitionProbe, RefusesMalformedCallsWithoutCuda) {
  void* stream = nullptr;
  int32_t sms = 0;
  EXPECT_EQ(difuse_probe_sm_partition_stream(0, 8, nullptr, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  std::string e = difuse_last_error();
  EXPECT_NE(e.find("stream_out is NULL"), std::string::npos) << e;
  EXPECT_NE(e.find("sms_out is NULL"), std::string::npos) << e;
  EXPECT_EQ(difuse_probe_sm_partition_stream(0, 8, &stream, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  e = difuse_last_error();
  EXPECT_EQ(e.find("stream_out is NULL"), std::string::npos) << e;
  EXPECT_EQ(difuse_probe_sm_partition_stream(64, 8, &stream, &sms), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("outside the devices 0..63"), std::string::npos);
  EXPECT_EQ(stream, nullptr);
  EXPECT_EQ(sms, 0);
  EXPECT_EQ(difuse_probe_set_launch_sm_count(0, -3), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("a negative SM count (-3)"), std::string::npos);
  EXPECT_EQ(difuse_probe_set_launch_sm_count(-1, 0), DIFUSE_ERR_INVALID_ARGUMENT);
}

TEST(DevicePolicy, DramBytesPerSmCycleRefusals) {
  double v = -1.0;
  EXPECT_EQ(difuse_device_dram_bytes_per_sm_cycle(0, nullptr), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("out is NULL"), std::string::npos);
  EXPECT_EQ(difuse_device_dram_bytes_per_sm_cycle(64, &v), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("outside the devices 0..63"), std::string::npos);
  EXPECT_EQ(v, -1.0);  // untouched on failure
}

TEST(SmPartitionProbe, LaunchSmCountFollowsTheOverride) {
  // Set through the detail hook (the C call also checks the count against the device, which needs a GPU).
  difuse::detail::launch_sm_override(5).store(93);
  EXPECT_EQ(difuse::detail::sm_count(5), 93);
  EXPECT_EQ(difuse::detail::sm_count(5), 93);
  difuse::detail::launch_sm_override(5).store(0);
  // Restoring the device's own count, 0 is accepted without asking the device.
  EXPECT_EQ(difuse_probe_set_launch_sm_count(5, 0), DIFUSE_OK) << difuse_last_error();
  EXPECT_EQ(difuse::detail::launch_sm_override(5).load(), 0);
}

TEST(StreamCopyProbe, VariantNames) {
  ASSERT_EQ(difuse_probe_stream_copy_variants(), 88);
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(0), "u1_t128_onepass_default");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(6), "u4_t256_onepass_default");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(63), "u8_t1024_resident_evict_first");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(64), "bulk4096_t32_onepass");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(67), "bulk32768_t32_onepass");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(68), "ring3072_w24_stg");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(69), "ring3072_w24_bulk");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(70), "ring6144_w24_stg");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(71), "ring3072_w24_stg_grab4_all");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(72), "ring3072_w24_stg_grab8");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(73), "ring3072_w24_stg_grab16");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(74), "ring3072_w24_stg_guided");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(75), "ring3072_w24_stg_p2");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(76), "ring3072_w24_stg_p4");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(77), "ring3072_w24_stg_p8");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(78), "ring6144_w24_stg_p4");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(79), "ring3072_w24_stg_r128");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(80), "ring3072_w12_stg_r64");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(81), "ring3072_w12_stg_p4_r64");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(82), "ring3072_w12_stg_r32");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(83), "ring3072_w8_stg_r32");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(84), "wring3072_s2_r4");
  EXPECT_STREQ(difuse_probe_stream_copy_variant_name(87), "wring3072_s3_r8");
  EXPECT_EQ(difuse_probe_stream_copy_variant_name(88), nullptr);
  EXPECT_EQ(difuse_probe_stream_copy_variant_name(-1), nullptr);
}

// ---- rope_rotate_half and activation_mul: the predicates (fake device addresses) ------------------------------------
TEST(RopeRotateHalf, AcceptsErnieLayoutsAndListsEveryViolation) {
  const int64_t B = 2, S = 4352, H = 32, D = 128;
  const TensorView x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, S, H, D}, 0);
  const TensorView out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, S, H, D}, 0);
  const TensorView cos = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, 1, D}, 0);
  const TensorView sin = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {B, S, 1, D}, 0);
  EXPECT_TRUE(difuse::can_use_rope_rotate_half(out, x, cos, sin).ok);
  // the block's [S, B] buffer seen as [B, S, heads, D]; tables broadcast over the batch; in place
  const TensorView x_bsh(fake(0x100000000ull), DType::BF16, {B, S, H, D}, {H * D, B * H * D, D, 1}, 0);
  EXPECT_TRUE(difuse::can_use_rope_rotate_half(out, x_bsh, cos, sin).ok);
  const TensorView cos1 = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {1, S, 1, D}, 0);
  const TensorView sin1 = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {1, S, 1, D}, 0);
  EXPECT_TRUE(difuse::can_use_rope_rotate_half(out, x, cos1, sin1).ok);
  EXPECT_TRUE(difuse::can_use_rope_rotate_half(x, x, cos, sin).ok);

  TensorView bad_x = x;
  bad_x.dtype = DIFUSE_F32;
  TensorView odd = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, 1, 63}, 0);
  TensorView sin_strided(fake(0x3000000000ull), DType::BF16, {B, S, 1, 63}, {S * 80, 80, 80, 1}, 0);
  TensorView overlapping = out;
  overlapping.data = fake(0x100000000ull + 2);  // overlaps x without being x
  auto s = difuse::can_use_rope_rotate_half(overlapping, bad_x, odd, sin_strided);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "x must be bf16"));
  EXPECT_TRUE(mentions(s, "R must be even"));
  EXPECT_TRUE(mentions(s, "cos and sin must have the same strides"));
  EXPECT_TRUE(mentions(s, "out must be x itself (in place) or not overlap it"));
  const TensorView wide = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, 1, 130}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rope_rotate_half(out, x, wide, wide), "2 <= R <= D"));
  const TensorView short_s = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S - 1, 1, D}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rope_rotate_half(out, x, short_s, short_s), "[B or 1, S, 1, R]"));
  const TensorView x3 = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, S, H * D}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rope_rotate_half(out, x3, cos, sin), "x must be [B, S, heads, D]"));
}

TEST(RmsNormRopeRotateHalf, AcceptsErnieLayoutsAndListsEveryViolation) {
  const int64_t B = 2, S = 4352, H = 32, D = 128;
  const TensorView x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, S, H, D}, 0);
  const TensorView out = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {B, S, H, D}, 0);
  const TensorView w = TensorView::contiguous(fake(0x4000000000ull), DType::BF16, {D}, 0);
  const TensorView cos = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, 1, D}, 0);
  const TensorView sin = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {B, S, 1, D}, 0);
  EXPECT_TRUE(difuse::can_use_rms_norm_rope_rotate_half(out, x, &w, cos, sin, 1e-6).ok);
  EXPECT_TRUE(difuse::can_use_rms_norm_rope_rotate_half(out, x, nullptr, cos, sin, 1e-6).ok);
  // q as the fused projection's columns of a [B, S, 3 H D] buffer; tables broadcast over the batch
  const TensorView x_cols(fake(0x100000000ull), DType::BF16, {B, S, H, D}, {S * 3 * H * D, 3 * H * D, D, 1}, 0);
  const TensorView cos1 = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {1, S, 1, D}, 0);
  const TensorView sin1 = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {1, S, 1, D}, 0);
  EXPECT_TRUE(difuse::can_use_rms_norm_rope_rotate_half(out, x_cols, &w, cos1, sin1, 1e-6).ok);

  const TensorView x96 = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {B, S, H, 96}, 0);
  auto s = difuse::can_use_rms_norm_rope_rotate_half(out, x96, &w, cos, sin, 1e-6);
  EXPECT_TRUE(mentions(s, "x must be [B, S, heads, 128]"));
  EXPECT_TRUE(mentions(s, "out must have the shape of x"));
  const TensorView r64 = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {B, S, 1, 64}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rms_norm_rope_rotate_half(out, x, &w, r64, r64, 1e-6),
                       "cos must be [B or 1, S, 1, 128] (R = D)"));
  const TensorView odd_rows(fake(0x100000002ull), DType::BF16, {B, S, H, D}, {S * H * D, H * D, D, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_rms_norm_rope_rotate_half(out, odd_rows, &w, cos, sin, 1e-6),
                       "x must have 8-byte aligned rows"));
  TensorView w_bad = w;
  w_bad.dtype = DIFUSE_F32;
  const TensorView sin_other(fake(0x3000000000ull), DType::BF16, {B, S, 1, D}, {2 * S * D, 2 * D, D, 1}, 0);
  s = difuse::can_use_rms_norm_rope_rotate_half(x, x, &w_bad, cos, sin_other, 1e-6);
  EXPECT_TRUE(mentions(s, "weight must be bf16"));
  EXPECT_TRUE(mentions(s, "cos and sin must have the same sizes and strides"));
  EXPECT_TRUE(mentions(s, "out must not overlap the inputs"));
}

// The row stride of a view whose leading dims collapse (core/tensor.h collapsed_row_stride, behind gelu_tanh's and
// activation_mul's row views): a dim of size 1 neither breaks the chain nor hides a dim that does not collapse.
TEST(RowViews, SizeOneDimsNeitherHideNorBreakTheRowStride) {
  const int64_t C = 64;
  const TensorView table = TensorView::contiguous(fake(0x5000000000ull), DType::BF16, {65536}, 0);
  const TensorView out = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {2, 1, 3, C}, 0);
  // torch.empty(2, 1, 10, C)[:, :, :3]: rows 10 C apart per batch entry, C apart within it: no one row stride
  const TensorView sliced(fake(0x100000000ull), DType::BF16, {2, 1, 3, C}, {10 * C, 10 * C, C, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_gelu_tanh(out, sliced), "x's leading dims must collapse"));
  EXPECT_TRUE(mentions(difuse::can_use_activation_mul(out, sliced, sliced, table), "a's leading dims must collapse"));
  EXPECT_TRUE(mentions(difuse::can_use_gelu_tanh(sliced, out), "out's leading dims must collapse"));
  // ... a single row of it is fine, and so is a size-1 dim of any stride in a dense layout
  const TensorView one_row(fake(0x100000000ull), DType::BF16, {1, 1, 1, C}, {10 * C, 10 * C, C, 1}, 0);
  const TensorView out1 = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {1, 1, 1, C}, 0);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(out1, one_row).ok);
  const TensorView odd_unit(fake(0x100000000ull), DType::BF16, {2, 1, 3, C}, {3 * C, 7, C, 1}, 0);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(out, odd_unit).ok);
  EXPECT_TRUE(difuse::can_use_activation_mul(out, odd_unit, odd_unit, table).ok);
  // rows of a wider buffer with a size-1 dim between: one row stride (2 C)
  const TensorView cols(fake(0x100000000ull), DType::BF16, {2, 1, 3, C}, {6 * C, 5, 2 * C, 1}, 0);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(out, cols).ok);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(cols, out).ok);  // out as a column slice
  // a negative stride behind a size-1 dim
  const TensorView neg(fake(0x100000000ull), DType::BF16, {2, 1, 3, C}, {-3 * C, 7, C, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_activation_mul(out, neg, neg, table), "a's leading dims must collapse"));
}

TEST(GeluTanh, OutIsXItselfOrOverlapsNothingNotEvenItself) {
  const int64_t C = 64;
  const TensorView x = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {4, C}, 0);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(x, x).ok);  // in place
  // the same pointer with other row strides: rows of out land on other rows of x
  const TensorView wider(fake(0x100000000ull), DType::BF16, {4, C}, {2 * C, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_gelu_tanh(wider, x), "out must be x itself (in place) or not overlap it"));
  const TensorView half(fake(0x100000000ull), DType::BF16, {4, C}, {C / 2, 1}, 0);
  auto s = difuse::can_use_gelu_tanh(half, x);
  EXPECT_TRUE(mentions(s, "out must be x itself (in place) or not overlap it"));
  EXPECT_TRUE(mentions(s, "out's rows must not overlap"));
  // every row written to one place (a broadcast out), in its own buffer
  const TensorView bcast(fake(0x2000000000ull), DType::BF16, {4, C}, {0, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_gelu_tanh(bcast, x), "out's rows must not overlap"));
  // ... while x may be read that way
  const TensorView out = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {4, C}, 0);
  const TensorView x_bcast(fake(0x100000000ull), DType::BF16, {4, C}, {0, 1}, 0);
  EXPECT_TRUE(difuse::can_use_gelu_tanh(out, x_bcast).ok);
}

TEST(ActivationMul, AcceptsBothFfnLayoutsAndListsEveryViolation) {
  const int64_t S = 4352, B = 2, F = 12288;
  const TensorView table = TensorView::contiguous(fake(0x5000000000ull), DType::BF16, {65536}, 0);
  const TensorView gate = TensorView::contiguous(fake(0x100000000ull), DType::BF16, {S, B, F}, 0);
  const TensorView up = TensorView::contiguous(fake(0x1000000000ull), DType::BF16, {S, B, F}, 0);
  const TensorView out = TensorView::contiguous(fake(0x2000000000ull), DType::BF16, {S, B, F}, 0);
  EXPECT_TRUE(difuse::can_use_activation_mul(out, gate, up, table).ok);
  EXPECT_TRUE(difuse::can_use_activation_mul(up, gate, up, table).ok);  // in place into b
  // FLUX.2: the halves of one [1, L, 2F] projection
  const int64_t L = 4608, G = 18432;
  const TensorView x1(fake(0x100000000ull), DType::BF16, {1, L, G}, {L * 2 * G, 2 * G, 1}, 0);
  const TensorView x2(fake(0x100000000ull + 2 * G), DType::BF16, {1, L, G}, {L * 2 * G, 2 * G, 1}, 0);
  const TensorView out2 = TensorView::contiguous(fake(0x3000000000ull), DType::BF16, {1, L, G}, 0);
  EXPECT_TRUE(difuse::can_use_activation_mul(out2, x1, x2, table).ok);
  // ... written into the MLP columns of the single block's [attention 6144, MLP G] concat buffer
  const TensorView into_concat(fake(0x3000000000ull + 2 * 6144), DType::BF16, {1, L, G}, {L * (6144 + G), 6144 + G, 1},
                               0);
  EXPECT_TRUE(difuse::can_use_activation_mul(into_concat, x1, x2, table).ok);
  const TensorView rows_overlap(fake(0x3000000000ull), DType::BF16, {1, L, G}, {L * G, G / 2, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_activation_mul(rows_overlap, x1, x2, table), "out must be contiguous or rows"));
  const TensorView uncollapsed(fake(0x3000000000ull), DType::BF16, {S, B, F}, {B * F * 3, F, 1}, 0);
  EXPECT_TRUE(mentions(difuse::can_use_activation_mul(uncollapsed, gate, up, table), "out must be contiguous or rows"));

  TensorView bad_a = gate;
  bad_a.dtype = DIFUSE_F16;
  TensorView short_b = up;
  short_b.sizes[2] = F - 1;
  TensorView short_table = table;
  short_table.sizes[0] = 256;
  TensorView strided_out(fake(0x2000000000ull), DType::BF16, {S, B, F}, {B * F * 2, F * 2, 2}, 0);  // every 2nd
  auto s = difuse::can_use_activation_mul(strided_out, bad_a, short_b, short_table);
  ASSERT_FALSE(s.ok);
  EXPECT_TRUE(mentions(s, "a must be bf16"));
  EXPECT_TRUE(mentions(s, "b must have the sizes of a"));
  EXPECT_TRUE(mentions(s, "table must be a contiguous bf16 [65536]"));
  EXPECT_TRUE(mentions(s, "out must be contiguous or rows"));
  TensorView overlapping = out2;
  overlapping.data = fake(0x100000000ull + 2);  // inside x1's span without being x1
  EXPECT_TRUE(mentions(difuse::can_use_activation_mul(overlapping, x1, x2, table), "out must be a itself"));
  const TensorView rank5(fake(0x100000000ull), DType::BF16, {1, 1, 1, 1, 8}, {8, 8, 8, 8, 1}, 0);
  s = difuse::can_use_activation_mul(rank5, rank5, rank5, table);
  EXPECT_TRUE(mentions(s, "a must have rank 1 to 4"));
  EXPECT_FALSE(mentions(s, "2^31"));  // no element-count reason for a view of an invalid rank
}
