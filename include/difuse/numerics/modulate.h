// difuse/numerics/modulate.h — the adaLN modulate step `n * (1 + scale) + shift` in its two eager roundings.
//
// bf16 chain (diffusers LTX-2, FLUX, SD3, ...: every op a bf16 kernel):
//     a = bf16(RN(scale + 1));  u = bf16(RN(n * a));  out = bf16(RN(u + shift))
// fp32 chain (diffusers ERNIE-Image: `(n.float() * (1 + scale.float()) + shift.float()).to(bf16)`; Wan alike):
//     out = bf16(RN(RN(n * RN(scale + 1)) + shift))      three fp32 kernels, no fma between them
// n, scale and shift are bf16 values (widened exactly); the Python `1` is the fp32 1.0f of aten's
// CUDAFunctorOnSelf_add (shared/reference/torch-2.11-numerics.md §4).
#pragma once

#include "difuse/numerics/bf16.h"

namespace difuse::num {

// The bf16 chain on two packed elements. The packed add and mul equal the fp32 op followed by a bf16
// rounding here (bf16.h): any two bf16 add exactly in fp32's grid or round the same way, and a = bf16(1 + s)
// is 0 or at least 2^-8 in magnitude, so n * a never falls below fp32's subnormal grid (2^-149).
DIFUSE_HD uint32_t modulate_bf16x2(uint32_t n2, uint32_t scale2, uint32_t shift2) {
  const uint32_t a2 = bf16x2_add_rn(scale2, kBf16x2One);
  return bf16x2_add_rn(bf16x2_mul_rn(n2, a2), shift2);
}

// The same chain on one element, every rounding spelled out (the host reference of modulate_bf16x2).
DIFUSE_HD float modulate_bf16_value(float n, float scale, float shift) {
  const float a = round_bf16(add_rn(scale, 1.0f));
  const float u = round_bf16(mul_rn(n, a));
  return round_bf16(add_rn(u, shift));
}

// The fp32 chain before its single bf16 rounding (the caller rounds at the store).
DIFUSE_HD float modulate_f32(float n, float scale, float shift) {
  return add_rn(mul_rn(n, add_rn(scale, 1.0f)), shift);
}

}  // namespace difuse::num
