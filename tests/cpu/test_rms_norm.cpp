// rms_norm's launch rule on the CPU: which rows take the streamed rows (rms_norm_streamed) by default and under
// DIFUSE_RMS_STREAMED (src/norm/rms_norm.cu, STREAMED_DEFAULT: measured at 1x32760x1536 on the H200 at b9178f7).
#include <gtest/gtest.h>

#include "norm/rms_norm.h"

namespace {

using difuse::norm::rms_norm_streamed_by_default;

TEST(RmsNormSchedule, StreamedRowsByDefault) {
  EXPECT_TRUE(rms_norm_streamed_by_default(1536, 32760, -1));   // Wan 1.3B's QK norm, 1x32760x1536
  EXPECT_TRUE(rms_norm_streamed_by_default(1536, 2 * 32760, -1));
  EXPECT_TRUE(rms_norm_streamed_by_default(136, 8192, -1));     // the narrowest row past the per-head kernels
  EXPECT_TRUE(rms_norm_streamed_by_default(2048, 8192, -1));
  EXPECT_FALSE(rms_norm_streamed_by_default(1536, 8191, -1));   // one row short
  EXPECT_FALSE(rms_norm_streamed_by_default(2056, 32760, -1));  // past 2048
  EXPECT_FALSE(rms_norm_streamed_by_default(5120, 32760, -1));  // Wan 14B: aten's layout (faster there)
  EXPECT_FALSE(rms_norm_streamed_by_default(128, 32760, -1));   // per-head rows have their own kernels
}

TEST(RmsNormSchedule, KnobOverridesTheRule) {
  EXPECT_FALSE(rms_norm_streamed_by_default(1536, 32760, 0));   // DIFUSE_RMS_STREAMED=0: never
  EXPECT_TRUE(rms_norm_streamed_by_default(5120, 16, 1));       // =G: wherever they can run
  EXPECT_TRUE(rms_norm_streamed_by_default(136, 1, 24));
}

}  // namespace
