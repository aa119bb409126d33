// The staged attention-prologue kernels' shared pieces (qk_norm_rope, qk_norm_rope_qwen, qk_norm_sd35 with
// DIFUSE_QK_STAGED=1): a block copies all of its token's head rows into shared memory with cp.async, every copy in
// flight at once, before its per-row arithmetic (unchanged) reads them from there. Index and copy code only.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/fast_div.h"
#include "core/tensor.h"
#include "norm/row_staging.cuh"
#include "rope/token_rows.cuh"

namespace difuse::rope {

// Issues the copies of a token's `rows` head rows (row r = role * H + head, CHUNKS 16-byte chunks each) into dst,
// chunk c of row r at dst[r * CHUNKS + c]; the block's THREADS threads share them. The caller waits
// (cp_async_wait_all) and synchronises the block.
template <int CHUNKS, int THREADS>
__device__ __forceinline__ void stage_token_rows(uint4* dst, const TokenRows& tr, const detail::FastDivU32& heads,
                                                 int rows) {
  for (int c = static_cast<int>(threadIdx.x); c < rows * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, part = c % CHUNKS;
    uint32_t head;
    const uint32_t role = heads.divmod(static_cast<uint32_t>(r), head);
    norm::cp_async(dst + c, tr.row(role, head) + part * 8, true);
  }
}

// Host: every present q, k, v view of the streams has 16-byte aligned rows (pointer, batch, sequence and head
// strides), as stage_token_rows' 16-byte copies need.
inline bool head_rows_aligned16(std::initializer_list<const StreamViews*> streams) {
  for (const StreamViews* st : streams)
    for (const HeadView& v : st->t)
      if (v.data != nullptr && (!detail::aligned(v.data, 16) || v.sb % 8 != 0 || v.ss % 8 != 0 || v.sh % 8 != 0))
        return false;
  return true;
}

}  // namespace difuse::rope
