// The gated residual's rounding rules on two packed bf16. gated_residual_pair (shared by gated_residual and the
// residual prologue of gated_residual_layernorm_modulate):  bf16(RN(h + bf16(RN(g * a)))).
// The product is formed in fp32 and rounded (a bf16 x bf16 product can fall below fp32's subnormal grid);
// the sum uses add.rn.bf16x2, equal to the fp32 add + bf16 rounding for any two bf16 (numerics/bf16.h).
#pragma once

#include "difuse/numerics/bf16.h"

namespace difuse::modulate {

DIFUSE_HD uint32_t gated_residual_pair(uint32_t h2, uint32_t a2, uint32_t g2) {
  const uint32_t t2 = num::pack_bf16x2(num::mul_rn(num::bf16_lo(g2), num::bf16_lo(a2)),
                                       num::mul_rn(num::bf16_hi(g2), num::bf16_hi(a2)));
  return num::bf16x2_add_rn(h2, t2);
}

#ifdef __CUDACC__
// Four packed bf16 (an 8-byte vector of each of h, a and g): gated_residual_pair on both words.
__device__ __forceinline__ uint2 gated_residual_vec4(uint2 h, uint2 a, uint2 g) {
  return make_uint2(gated_residual_pair(h.x, a.x, g.x), gated_residual_pair(h.y, a.y, g.y));
}
#endif

// Wan's fp32-gate form on two packed bf16 with their two fp32 gates: bf16(RN(f(h) + RN(f(a) * g))), one bf16
// rounding (bf16 x fp32 promotes to fp32; the eager mul and add are one fp32 TensorIterator kernel each).
DIFUSE_HD uint32_t gated_residual_fp32_pair(uint32_t h2, uint32_t a2, float g_lo, float g_hi) {
  return num::pack_bf16x2(num::add_rn(num::bf16_lo(h2), num::mul_rn(num::bf16_lo(a2), g_lo)),
                          num::add_rn(num::bf16_hi(h2), num::mul_rn(num::bf16_hi(a2), g_hi)));
}

}  // namespace difuse::modulate
