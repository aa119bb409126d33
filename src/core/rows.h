// Rows of a strided view: up to three leading dims (any non-negative strides) over a contiguous last dim.
#pragma once

#include <cstdint>

#include "difuse/difuse.h"
#include "core/fast_div.h"
#include "difuse/numerics/fp32.h"

namespace difuse::detail {

struct RowIndexer {
  int64_t d1 = 1, d2 = 1;          // sizes of the 2nd and 3rd leading dims (1 when absent)
  int64_t s0 = 0, s1 = 0, s2 = 0;  // strides of the leading dims, in elements
  // Set by prepare(rows) when every row index fits 31 bits: the two index divisions then take FastDivU32's
  // multiply-high instead of 64-bit division subroutines (the same offsets; tests/cpu/test_fast_div.cpp).
  bool fast = false;
  FastDivU32 f1, f2;

  // Element offset of row r (rows numbered in the leading dims' row-major order).
  DIFUSE_HD int64_t offset(int64_t r) const {
    if (fast) {
      uint32_t i2, i1;
      const uint32_t t = f2.divmod(static_cast<uint32_t>(r), i2);
      const uint32_t i0 = f1.divmod(t, i1);
      return static_cast<int64_t>(i0) * s0 + static_cast<int64_t>(i1) * s1 + static_cast<int64_t>(i2) * s2;
    }
    const int64_t i2 = r % d2, t = r / d2;
    const int64_t i1 = t % d1, i0 = t / d1;
    return i0 * s0 + i1 * s1 + i2 * s2;
  }

  // Whether rows [0, rows) all start at different offsets: every leading dim of more than one index moves (a
  // per-token modulation or gate tensor, where the [B, H] chunks broadcast). Assumes non-negative strides and
  // non-overlapping dims, as the predicates require.
  bool every_row_distinct(int64_t rows) const {
    const int64_t d0 = d1 * d2 > 0 ? rows / (d1 * d2) : 0;
    return (d0 <= 1 || s0 != 0) && (d1 <= 1 || s1 != 0) && (d2 <= 1 || s2 != 0);
  }

  // The one stride that places rows [0, rows) (offset(r) == r * stride for every r), or -1 where there is none
  // (0 for a single row). Host only: a kernel whose rows step by it needs no index division per row.
  int64_t uniform_stride(int64_t rows) const {
    const int64_t d0 = d1 * d2 > 0 ? rows / (d1 * d2) : 0;
    const int64_t sizes[3] = {d2, d1, d0}, strides[3] = {s2, s1, s0};  // innermost first
    int64_t stride = -1, span = 1;  // the stride found so far and the rows it spans
    for (int k = 0; k < 3; ++k) {
      if (sizes[k] <= 1) continue;
      if (stride < 0) {
        stride = strides[k];
      } else if (strides[k] != stride * span) {
        return -1;
      }
      span *= sizes[k];
    }
    return stride < 0 ? 0 : stride;
  }

  // For indexing rows [0, rows): takes the 32-bit path when rows <= 2^31 - 1 (then d1, d2 < 2^31 too).
  RowIndexer& prepare(int64_t rows) {
    fast = rows > 0 && rows < (int64_t{1} << 31) && d1 >= 1 && d2 >= 1 && d1 < (int64_t{1} << 31) &&
           d2 < (int64_t{1} << 31);
    if (fast) {
      f1 = FastDivU32(static_cast<uint32_t>(d1));
      f2 = FastDivU32(static_cast<uint32_t>(d2));
    }
    return *this;
  }
};

// The leading dims of a view of rank 1 to 4, right-aligned into (d0, d1, d2).
inline RowIndexer row_indexer(const difuse_tensor_view& v) {
  int64_t sz[3] = {1, 1, 1}, st[3] = {0, 0, 0};
  for (int d = v.rank - 2, k = 2; d >= 0 && k >= 0; --d, --k) sz[k] = v.sizes[d], st[k] = v.strides[d];
  RowIndexer r;
  r.d1 = sz[1];
  r.d2 = sz[2];
  r.s0 = st[0];
  r.s1 = st[1];
  r.s2 = st[2];
  return r;
}

// The I/O of a row kernel over a strided bf16 x, an optional bf16 weight row and a contiguous bf16 out.
struct BF16RowsIO {
  const uint16_t* x = nullptr;
  uint16_t* out = nullptr;
  const uint16_t* w = nullptr;  // nullptr: no weight
  bool has_w = false;
  int n = 0;                    // row width
  float inv_n_pow2 = 0.0f;      // 1/n when n is a power of two, else 0 (num::div_by_width_rn)
  int64_t rows = 0;
  RowIndexer rows_of;           // row r of x starts at x + rows_of.offset(r)
};

// For a non-empty x of rank 1 to 4 (the caller's predicate has checked it).
inline BF16RowsIO bf16_rows_io(const difuse_tensor_view& out, const difuse_tensor_view& x,
                               const difuse_tensor_view& weight) {
  BF16RowsIO io;
  io.x = static_cast<const uint16_t*>(x.data);
  io.out = static_cast<uint16_t*>(out.data);
  io.w = static_cast<const uint16_t*>(weight.data);
  io.has_w = weight.data != nullptr;
  io.n = static_cast<int>(x.sizes[x.rank - 1]);
  io.inv_n_pow2 = num::inv_pow2_or_zero(io.n);
  int64_t total = 1;
  for (int d = 0; d < x.rank; ++d) total *= x.sizes[d];
  io.rows = total / io.n;
  io.rows_of = row_indexer(x).prepare(io.rows);
  return io;
}

}  // namespace difuse::detail
