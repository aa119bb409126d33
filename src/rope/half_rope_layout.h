// How the rotate-half kernels (rope_rotate_half, rms_norm_rope_rotate_half) place a token's rows and tables:
// x [B, S, heads, D] at any non-negative strides, cos / sin [B or 1, S, 1, R] with one set of strides.
#pragma once

#include <cstdint>

#include "difuse/difuse.h"

namespace difuse::rope {

struct HalfRopeLayout {
  int64_t x_sb = 0, x_ss = 0, x_sh = 0;  // x strides (elements) of batch, token, head
  int64_t t_sb = 0, t_ss = 0;            // the tables' strides of batch (0 when broadcast) and token
  int S = 0, H = 0;
};

// For views the op's predicate accepted (x rank 4, cos rank 4).
inline HalfRopeLayout half_rope_layout(const difuse_tensor_view& x, const difuse_tensor_view& cos) {
  HalfRopeLayout l;
  l.x_sb = x.strides[0];
  l.x_ss = x.strides[1];
  l.x_sh = x.strides[2];
  l.t_sb = cos.sizes[0] == 1 ? 0 : cos.strides[0];
  l.t_ss = cos.strides[1];
  l.S = static_cast<int>(x.sizes[1]);
  l.H = static_cast<int>(x.sizes[2]);
  return l;
}

}  // namespace difuse::rope
