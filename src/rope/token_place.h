// Where a token of a per-token attention-prologue launch sits (host and device, so CPU tests can check it).
// Index arithmetic only.
#pragma once

#include <cstdint>

#include "core/fast_div.h"

namespace difuse::rope {

// Token `token` of a launch over B * S joint tokens (one block, or one loop step, per token), the first S_first of
// each batch's S from the first stream: its batch b, joint position sj and place s in its stream.
struct TokenPlace {
  int64_t b, sj, s;
  bool in_first;
};

// seq: a FastDivU32 by S, made on the host (a multiply-high where a 32-bit division costs ~20 instructions in
// every warp of every block).
DIFUSE_HD TokenPlace token_place(unsigned token, const detail::FastDivU32& seq, int64_t S_first) {
  TokenPlace t;  // B * S < 2^31 (the predicates): token < 2^31, as FastDivU32 needs
  uint32_t sj;
  t.b = seq.divmod(token, sj);
  t.sj = sj;
  t.in_first = t.sj < S_first;
  t.s = t.in_first ? t.sj : t.sj - S_first;
  return t;
}

}  // namespace difuse::rope
