// The head rows of one token, as the per-token attention-prologue kernels (qk_norm_rope, qk_norm_rope_qwen,
// qk_norm_sd35) walk them: a block owns one token and its roles x heads rows (row r: role r / H, head r % H).
// Everything that depends only on the token is computed once per block (each role's row base and head stride);
// a row then costs one multiply-high (detail::FastDivU32) for its role and head and a multiply-add for its
// address, instead of the integer-division sequences and 64-bit products a row paid before. Index arithmetic
// only: the kernels' arithmetic on the elements is unchanged.
#pragma once

#include <cstdint>

#include "core/fast_div.h"
#include "difuse/difuse.h"
#include "rope/head_views.h"
#include "rope/token_place.h"

namespace difuse::rope {

// A rank-4 bf16 head view as the kernels index it: batch, sequence and head strides in elements (the last dim is
// contiguous). Absent views (NULL data, rank 0) stay empty.
struct HeadView {
  const uint16_t* data = nullptr;
  int64_t sb = 0, ss = 0, sh = 0;
};

// One stream's q, k, v views and its q and k norm weights (nullptr: none).
struct StreamViews {
  HeadView t[3];
  const uint16_t* w[2] = {nullptr, nullptr};
};

// seq_dim, head_dim: where the sequence and head dims sit (BSHD: 1, 2; BHSD: 2, 1).
inline StreamViews stream_views(const difuse_tensor_view& q, const difuse_tensor_view& k, const difuse_tensor_view& v,
                                const difuse_tensor_view& wq, const difuse_tensor_view& wk, int seq_dim,
                                int head_dim) {
  StreamViews s;
  const difuse_tensor_view* t[3] = {&q, &k, &v};
  for (int r = 0; r < 3; ++r) {
    if (!heads::present(*t[r])) continue;
    s.t[r].data = static_cast<const uint16_t*>(t[r]->data);
    s.t[r].sb = t[r]->strides[0];
    s.t[r].ss = t[r]->strides[seq_dim];
    s.t[r].sh = t[r]->strides[head_dim];
  }
  s.w[0] = heads::present(wq) ? static_cast<const uint16_t*>(wq.data) : nullptr;
  s.w[1] = heads::present(wk) ? static_cast<const uint16_t*>(wk.data) : nullptr;
  return s;
}

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
