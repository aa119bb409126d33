// Division of row and head indices by a runtime divisor without a division instruction.
//
// Integer division has no hardware instruction on the GPU: a 32-bit `/` or `%` by a runtime value compiles to an
// instruction sequence and a 64-bit one to a subroutine call (div.u32 / div.s64 in the PTX; their SASS length
// was not measured here). Row kernels whose rows are short (per-head
// norms: 64 or 128 elements per row) spent most of their issue slots there. FastDivU32 divides by a
// multiply-high, an add and a shift (Granlund & Montgomery's round-up method): for a divisor d >= 1 with
// 2^(s-1) < d <= 2^s, m = floor(2^32 * (2^s - d) / d) + 1 and n / d = (umulhi(n, m) + n) >> s, exact for
// every n < 2^31 (so that the add cannot carry out of 32 bits). Index arithmetic only: no rounding point.
// tests/cpu/test_fast_div.cpp checks it exhaustively for small values and on samples over the whole range.
#pragma once

#include <cstdint>

#include "difuse/numerics/fp32.h"  // DIFUSE_HD

namespace difuse::detail {

struct FastDivU32 {
  uint32_t d = 1, m = 1, s = 0;  // d == 1: m = 1, s = 0 gives (0 + n) >> 0 = n

  FastDivU32() = default;
  // 1 <= divisor <= 2^31 (the callers check; 0 is taken as 1).
  explicit FastDivU32(uint32_t divisor) : d(divisor == 0 ? 1 : divisor) {
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
  }

  // n / d for n < 2^31.
  DIFUSE_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, m);
#else
    const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(n) * m) >> 32);
#endif
    return (t + n) >> s;
  }
  // n / d and n % d for n < 2^31.
  DIFUSE_HD uint32_t divmod(uint32_t n, uint32_t& rem) const {
    const uint32_t q = div(n);
    rem = n - q * d;
    return q;
  }
};

// n / d for the indices [0, max_n) of a kernel: FastDivU32 when they fit 31 bits (as row indices do), a 64-bit
// division otherwise. For the per-row batch index (row / sequence length) of the modulation kernels.
struct IndexDiv {
  int64_t d = 1;
  FastDivU32 f;
  bool fast = false;

  IndexDiv() = default;
  IndexDiv(int64_t divisor, int64_t max_n) : d(divisor < 1 ? 1 : divisor) {
    fast = max_n <= (int64_t{1} << 31) && d < (int64_t{1} << 31);
    if (fast) f = FastDivU32(static_cast<uint32_t>(d));
  }

  DIFUSE_HD int64_t div(int64_t n) const { return fast ? static_cast<int64_t>(f.div(static_cast<uint32_t>(n))) : n / d; }
};

}  // namespace difuse::detail
