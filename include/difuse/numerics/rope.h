// difuse/numerics/rope.h — the rounding points of diffusers' rotary embeddings.
//
// apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1) (FLUX.1, Wan; diffusers 0.42.1
// models/embeddings.py) computes, for a bf16 x and fp32 tables:
//     x_real, x_imag = x.reshape(..., -1, 2).unbind(-1)           pairs (x[2i], x[2i+1])
//     x_rotated = stack([-x_imag, x_real], -1).flatten(3)          bf16 negation: exact
//     out = (x.float() * cos + x_rotated.float() * sin).to(bf16)   three fp32 kernels: mul, mul, add
// so element 2i is bf16(RN(RN(x[2i] * c[2i]) + RN(-x[2i+1] * s[2i]))) and element 2i+1 is
// bf16(RN(RN(x[2i+1] * c[2i+1]) + RN(x[2i] * s[2i+1]))): each product rounded on its own (no FMA), the
// negation applied to the bf16 operand before the product (it decides the sign of a zero product).
#pragma once

#include <cstdint>

#include "difuse/numerics/bf16.h"
#include "difuse/numerics/fp32.h"

namespace difuse::num {

// One interleaved pair (x0, x1) at elements (2i, 2i+1) with table entries (c0, s0), (c1, s1); the results are the
// fp32 values before the final .to(bf16).
DIFUSE_HD void rope_interleaved_pair(float x0, float x1, float c0, float s0, float c1, float s1, float& o0,
                                     float& o1) {
  o0 = add_rn(mul_rn(x0, c0), mul_rn(-x1, s0));
  o1 = add_rn(mul_rn(x1, c1), mul_rn(x0, s1));
}

// Two packed bf16 elements (one pair) -> two packed bf16 results.
DIFUSE_HD uint32_t rope_interleaved_bf16x2(uint32_t x2, float c0, float s0, float c1, float s1) {
  float o0, o1;
  rope_interleaved_pair(bf16_lo(x2), bf16_hi(x2), c0, s0, c1, s1, o0, o1);
  return pack_bf16x2(o0, o1);
}

}  // namespace difuse::num
