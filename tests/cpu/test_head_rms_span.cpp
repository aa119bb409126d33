// The half-warp row layout of norm/head_rms_span.cuh, emulated on the host: lane u holding aten's lanes u and
// u + 16 (their sums combined inside the lane), then the shuffle levels 8..1 within 16 lanes, must end with the
// bits aten's 32-lane tree (levels 16..1) leaves in lane 0, for every row width the per-head kernels take.
// Shuffle semantics emulated: __shfl_down_sync returns the caller's own value when the source lane is past the
// width, which only lanes whose results aten discards ever see.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "difuse/numerics/bf16.h"
#include "norm/layernorm_schedule.h"

namespace {

using difuse::norm::rms_combine;
using difuse::norm::rms_push_vec4;

float tree(std::vector<float> s, int width) {
  for (int o = width / 2; o >= 1; o /= 2) {
    std::vector<float> next(s.size());
    for (int l = 0; l < width; ++l) next[l] = rms_combine(s[l], l + o < width ? s[l + o] : s[l]);
    s = next;
  }
  return s[0];
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

TEST(HeadRmsSpan, HalfWarpLayoutEndsWithAtensLaneZeroBits) {
  std::mt19937 g(11);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int trial = 0; trial < 20000; ++trial) {
    const int D = 4 * (1 + trial % 32);  // 4..128
    const float scale = trial % 5 == 0 ? 3e18f : trial % 5 == 1 ? 1e-20f : 1.f;
    std::vector<float> x(128, 0.f);
    for (int i = 0; i < D; ++i) x[i] = difuse::num::round_bf16(n(g) * scale);
    std::vector<float> lane(32, 0.f);  // aten lane l: its vector l (zeros past D)
    for (int l = 0; l < 32; ++l)
      lane[l] = rms_push_vec4(0.f, x[4 * l], x[4 * l + 1], x[4 * l + 2], x[4 * l + 3]);
    const float aten = tree(lane, 32);
    std::vector<float> half(16);
    for (int u = 0; u < 16; ++u) half[u] = rms_combine(lane[u], lane[u + 16]);
    ASSERT_EQ(bits(tree(half, 16)), bits(aten)) << "D " << D << " trial " << trial;
  }
}
