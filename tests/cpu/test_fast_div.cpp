// FastDivU32 and RowIndexer's 32-bit path: the index arithmetic the short-row kernels use instead of `/` and `%`.
#include <gtest/gtest.h>

#include <cstdint>
#include <array>
#include <random>

#include "core/fast_div.h"
#include "rope/token_place.h"
#include "core/rows.h"

using difuse::detail::FastDivU32;
using difuse::detail::RowIndexer;

TEST(FastDiv, ExhaustiveForSmallDivisorsAndIndices) {
  for (uint32_t d = 1; d <= 4096; ++d) {
    const FastDivU32 f(d);
    for (uint32_t n = 0; n < 20000; ++n) {
      uint32_t r;
      const uint32_t q = f.divmod(n, r);
      ASSERT_EQ(q, n / d) << n << " / " << d;
      ASSERT_EQ(r, n % d) << n << " % " << d;
    }
  }
}

TEST(FastDiv, SampledOverTheWholeRange) {
  std::mt19937_64 g(7);
  const uint32_t top = (1u << 31) - 1;
  for (int i = 0; i < 2000; ++i) {
    // divisors: uniform, powers of two and their neighbours, and the largest
    uint32_t d = static_cast<uint32_t>(g() % top) + 1;
    if (i % 4 == 1) d = 1u << (i % 31);
    if (i % 4 == 2) d = (1u << (i % 31)) + 1;
    if (i % 4 == 3) d = top - static_cast<uint32_t>(i);
    const FastDivU32 f(d);
    for (uint32_t n : {0u, 1u, d - 1, d, d + 1, top, top - 1, top - d % top, static_cast<uint32_t>(g() % top),
                       static_cast<uint32_t>(g() % top), static_cast<uint32_t>(g() % 100000)}) {
      if (n > top) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
    for (int k = 0; k < 2000; ++k) {
      const uint32_t n = static_cast<uint32_t>(g() % (uint64_t{top} + 1));
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}

TEST(RowIndexer, PreparedOffsetsEqualTheGeneralPath) {
  // [B, S, H] leading dims of a per-head view with strided rows (a fused qkv chunk), and broadcast strides (0).
  for (const auto& dims : {std::array<int64_t, 3>{1, 4608, 24}, std::array<int64_t, 3>{2, 333, 38},
                           std::array<int64_t, 3>{3, 1, 7}, std::array<int64_t, 3>{1, 1, 1},
                           std::array<int64_t, 3>{5, 17, 1}}) {
    RowIndexer r;
    r.d1 = dims[1];
    r.d2 = dims[2];
    r.s0 = dims[1] * dims[2] * 3 * 128;
    r.s1 = dims[2] * 3 * 128;
    r.s2 = 128;
    const int64_t rows = dims[0] * dims[1] * dims[2];
    RowIndexer f = r;
    f.prepare(rows);
    ASSERT_TRUE(f.fast);
    for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(f.offset(i), r.offset(i)) << i;
    RowIndexer b = r;
    b.s1 = 0;  // a modulation row broadcast over tokens
    RowIndexer bf = b;
    bf.prepare(rows);
    for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(bf.offset(i), b.offset(i)) << i;
  }
  RowIndexer big;
  big.d1 = int64_t{1} << 20;
  big.d2 = int64_t{1} << 12;
  big.prepare(int64_t{1} << 32);  // rows past 2^31: the 64-bit path stays
  EXPECT_FALSE(big.fast);
  EXPECT_FALSE(RowIndexer{}.prepare(0).fast);
}

TEST(RowIndexer, UniformStrideIsFoundExactlyWhereOneStridePlacesEveryRow) {
  // random leading dims and strides, many of them laid out so that one stride places every row (contiguous views,
  // the chunks of a fused projection, size-1 and broadcast dims): uniform_stride(rows) >= 0 iff such a stride exists,
  // and then offset(r) == r * stride for every r
  std::mt19937_64 rng(20261204);
  int uniform = 0, not_uniform = 0;
  for (int t = 0; t < 4000; ++t) {
    const int64_t d0 = 1 + static_cast<int64_t>(rng() % 4), d1 = 1 + static_cast<int64_t>(rng() % 5),
                  d2 = 1 + static_cast<int64_t>(rng() % 6);
    const int64_t w = 1 + static_cast<int64_t>(rng() % 3) * 64;
    RowIndexer r;
    r.d1 = d1;
    r.d2 = d2;
    r.s2 = rng() % 5 == 0 ? 0 : w * (1 + static_cast<int64_t>(rng() % 3));
    r.s1 = rng() % 2 ? r.s2 * d2 : static_cast<int64_t>(rng() % 4) * w;
    r.s0 = rng() % 2 ? r.s1 * d1 : static_cast<int64_t>(rng() % 4) * w * 7;
    const int64_t rows = d0 * d1 * d2;
    // the truth: does offset(r) - offset(0) == r * (offset(1) - offset(0)) for every r?
    const int64_t step = rows > 1 ? r.offset(1) - r.offset(0) : 0;
    bool truth = r.offset(0) == 0;
    for (int64_t i = 0; i < rows; ++i) truth = truth && r.offset(i) == i * step;
    const int64_t u = r.uniform_stride(rows);
    ASSERT_EQ(u >= 0, truth) << d0 << "x" << d1 << "x" << d2 << " strides " << r.s0 << " " << r.s1 << " " << r.s2;
    if (u >= 0) {
      for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(r.offset(i), i * u) << i;
      ++uniform;
    } else {
      ++not_uniform;
    }
  }
  EXPECT_GT(uniform, 500);  // both outcomes are exercised
  EXPECT_GT(not_uniform, 500);
  // a contiguous [2, 4096, 1536] x and a q chunk of a fused [1, 4608, 3 x 3072] projection
  RowIndexer c;
  c.d1 = 2, c.d2 = 4096, c.s0 = 2 * 4096 * 1536, c.s1 = 4096 * 1536, c.s2 = 1536;
  EXPECT_EQ(c.uniform_stride(2 * 4096), 1536);
  RowIndexer q;
  q.d2 = 4608, q.s1 = 4608 * 9216, q.s2 = 9216;
  EXPECT_EQ(q.uniform_stride(4608), 9216);
  q.s1 = 9216;  // a transposed pair of dims: no one stride
  q.d1 = 2;
  EXPECT_EQ(q.uniform_stride(2 * 4608), -1);
}

TEST(IndexDiv, BothPathsDivideExactly) {
  using difuse::detail::IndexDiv;
  for (int64_t d : {1, 2, 3, 77, 4096, 4429, 32760}) {
    const IndexDiv fast(d, 1 << 20);
    ASSERT_TRUE(fast.fast);
    for (int64_t n = 0; n < (1 << 20); n += 7) ASSERT_EQ(fast.div(n), n / d) << n << " / " << d;
    const IndexDiv wide(d, int64_t{1} << 40);  // indices past 2^31: the 64-bit division
    ASSERT_FALSE(wide.fast);
    for (int64_t n : {int64_t{0}, int64_t{1} << 33, (int64_t{1} << 40) - 1}) ASSERT_EQ(wide.div(n), n / d);
  }
  EXPECT_EQ(IndexDiv(0, 10).d, 1);  // a zero-length sequence never divides (no rows)
}

// The prologue kernels' token -> (batch, joint position, place in its stream), by a FastDivU32 made on the host,
// against / and %: the site shapes (FLUX 512 + 4096, Qwen 512 + 4096, SD3.5 4429 + 333 image first), small and odd
// ones, and the last token of a launch near 2^31 tokens.
TEST(TokenPlace, MatchesDivisionAndRemainder) {
  struct Case { int64_t S_first, S_second, B; };
  const Case cases[] = {{512, 4096, 2}, {4429, 333, 2}, {34, 4096, 1}, {0, 7, 3}, {5, 0, 4}, {1, 1, 9}, {13, 6, 5}};
  for (const Case& c : cases) {
    const int64_t S = c.S_first + c.S_second;
    const difuse::detail::FastDivU32 seq(static_cast<uint32_t>(S));
    for (int64_t token = 0; token < c.B * S; ++token) {
      const difuse::rope::TokenPlace t = difuse::rope::token_place(static_cast<unsigned>(token), seq, c.S_first);
      ASSERT_EQ(t.b, token / S);
      ASSERT_EQ(t.sj, token % S);
      ASSERT_EQ(t.in_first, token % S < c.S_first);
      ASSERT_EQ(t.s, t.in_first ? token % S : token % S - c.S_first);
    }
  }
  const int64_t S = 4608, B = ((int64_t{1} << 31) - 1) / S;  // the largest launch the predicates allow
  const difuse::detail::FastDivU32 seq(static_cast<uint32_t>(S));
  for (int64_t token = B * S - 5000; token < B * S; ++token) {
    const difuse::rope::TokenPlace t = difuse::rope::token_place(static_cast<unsigned>(token), seq, 512);
    ASSERT_EQ(t.b, token / S);
    ASSERT_EQ(t.sj, token % S);
  }
}
