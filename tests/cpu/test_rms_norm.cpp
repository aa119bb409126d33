// rms_norm's launch rule on the CPU: which rows take the streamed rows (rms_norm_streamed) by default and under
// DIFUSE_RMS_STREAMED (src/norm/rms_norm.cu, STREAMED_DEFAULT: measured at 1x32760x1536 on the H200 at b9178f7, and
// by the device's DRAM bytes per SM cycle since the forty-third session: a whole H100 keeps aten's layout).
#include <gtest/gtest.h>

#include "norm/rms_norm.h"

namespace {

using difuse::detail::kDramOutpacesSmsBytesPerSmCycle;
using difuse::norm::rms_norm_streamed_by_default;

constexpr double kH200 = 18.42;     // as read at fd5c83b
constexpr double kH100At94 = 18.01;  // 94 of an H100's 132 SMs, as read at 485a376
constexpr double kWholeH100 = 12.83;  // as read at 485a376

TEST(RmsNormSchedule, StreamedRowsByDefault) {
  for (double device : {kH200, kH100At94}) {
    EXPECT_TRUE(rms_norm_streamed_by_default(1536, 32760, -1, device));   // Wan 1.3B's QK norm, 1x32760x1536
    EXPECT_TRUE(rms_norm_streamed_by_default(1536, 2 * 32760, -1, device));
    EXPECT_TRUE(rms_norm_streamed_by_default(136, 8192, -1, device));     // the narrowest row past the per-head kernels
    EXPECT_TRUE(rms_norm_streamed_by_default(2048, 8192, -1, device));
    EXPECT_FALSE(rms_norm_streamed_by_default(1536, 8191, -1, device));   // one row short
    EXPECT_FALSE(rms_norm_streamed_by_default(2056, 32760, -1, device));  // past 2048
    EXPECT_FALSE(rms_norm_streamed_by_default(5120, 32760, -1, device));  // Wan 14B: aten's layout (faster there)
    EXPECT_FALSE(rms_norm_streamed_by_default(128, 32760, -1, device));   // per-head rows have their own kernels
  }
}

TEST(RmsNormSchedule, StreamedRowsOnlyWhereDramOutpacesTheSms) {
  EXPECT_FALSE(rms_norm_streamed_by_default(1536, 32760, -1, kWholeH100));  // 81.2 us streamed vs 76.4 at 485a376
  EXPECT_FALSE(rms_norm_streamed_by_default(2048, 8192, -1, kWholeH100));
  EXPECT_FALSE(rms_norm_streamed_by_default(1536, 32760, -1, kDramOutpacesSmsBytesPerSmCycle - 0.01));
  EXPECT_TRUE(rms_norm_streamed_by_default(1536, 32760, -1, kDramOutpacesSmsBytesPerSmCycle));
  EXPECT_TRUE(rms_norm_streamed_by_default(1536, 32760, -1, 0.0));  // clocks unknown: the choice before the rule
  EXPECT_FALSE(rms_norm_streamed_by_default(1536, 8191, -1, 0.0));
}

TEST(RmsNormSchedule, KnobOverridesTheRule) {
  for (double device : {kH200, kWholeH100, 0.0}) {
    EXPECT_FALSE(rms_norm_streamed_by_default(1536, 32760, 0, device));  // DIFUSE_RMS_STREAMED=0: never
    EXPECT_TRUE(rms_norm_streamed_by_default(5120, 16, 1, device));      // =G: wherever they can run
    EXPECT_TRUE(rms_norm_streamed_by_default(136, 1, 24, device));
  }
}

}  // namespace
