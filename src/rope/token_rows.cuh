// The head rows of one token, as the per-token attention-prologue kernels (qk_norm_rope, qk_norm_rope_qwen,
// qk_norm_sd35) walk them: a block owns one token and its roles x heads rows (row r: role r / H, head r % H).
// Everything that depends only on the token is computed once per block (each role's row base and head stride);
// a row then costs one multiply-high (detail::FastDivU32) for its role and head and a multiply-add for its
// address, instead of the integer-division sequences and 64-bit products a row paid before. Index arithmetic
// only: the kernels' arithmetic on the elements is unchanged.
#pragma once

#include <cstdint>

#include "core/fast_div.h"

namespace difuse::rope {

struct TokenRows {
  const uint16_t* at[3];  // role's row of head 0 for this token
  int64_t sh[3];          // role's head stride, in elements

  // T: a view with data, sb (batch), ss (sequence) and sh (head) strides in elements.
  template <class T>
  __device__ __forceinline__ TokenRows(const T& q, const T& k, const T& v, int64_t b, int64_t s) {
    const T* t[3] = {&q, &k, &v};
#pragma unroll
    for (int role = 0; role < 3; ++role) {
      at[role] = t[role]->data + b * t[role]->sb + s * t[role]->ss;
      sh[role] = t[role]->sh;
    }
  }

  // Row (role, head); selects rather than an indexed array, which would live in local memory.
  __device__ __forceinline__ const uint16_t* row(uint32_t role, uint32_t head) const {
    const uint16_t* a = role == 0 ? at[0] : role == 1 ? at[1] : at[2];
    const int64_t st = role == 0 ? sh[0] : role == 1 ? sh[1] : sh[2];
    return a + head * st;
  }
};

// Row r of `rows` -> role (its return value) and head; 3 for a row past the end.
__device__ __forceinline__ uint32_t role_and_head(const detail::FastDivU32& heads, int r, int rows, uint32_t& head) {
  head = 0;
  return r < rows ? heads.divmod(static_cast<uint32_t>(r), head) : 3u;
}

// One of three role outputs by role (selects).
template <class P>
__device__ __forceinline__ P by_role(uint32_t role, P a, P b, P c) {
  return role == 0 ? a : role == 1 ? b : c;
}

}  // namespace difuse::rope
