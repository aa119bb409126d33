// difuse/numerics/bf16.h — the bf16 rounding boundary.
//
// bf16 values travel as raw 16-bit patterns (uint16_t) so that host code, CPU tests and device code
// share one representation. Widening bf16 -> fp32 is exact. Narrowing fp32 -> bf16 is round to
// nearest, ties to even: on the device it is cvt.rn.bf16.f32 (SASS F2FP.BF16.F32.PACK_AB, what torch's
// c10::BFloat16 uses on sm_80+); on the host an integer emulation of the same instruction:
//   - finite and infinite values: RNE on the fp32 bit pattern (overflow rounds to +-inf);
//   - subnormals are kept (no flush to zero), +-0 keep their sign;
//   - every NaN becomes the canonical NaN 0x7FFF (what cvt produces; the GPU tests check the kernel's
//     NaN outputs against torch bit for bit).
#pragma once

#include "difuse/numerics/fp32.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace difuse::num {

DIFUSE_HD float bf16_to_float(uint16_t b) { return float_from_bits(static_cast<uint32_t>(b) << 16); }

DIFUSE_HD uint16_t float_to_bf16_rne(float f) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat16 h = __float2bfloat16_rn(f);
  return __bfloat16_as_ushort(h);
#else
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN -> canonical NaN
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
#endif
}

// fp32 -> bf16 -> fp32: the value an eager bf16 op stores, as its consumer reads it back.
DIFUSE_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16_rne(f)); }

// Two bf16 packed in a 32-bit word (element 0 in the low half, as in memory on little-endian).
DIFUSE_HD float bf16_lo(uint32_t w) { return float_from_bits(w << 16); }
DIFUSE_HD float bf16_hi(uint32_t w) { return float_from_bits(w & 0xffff0000u); }

DIFUSE_HD uint32_t pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // one F2FP.BF16.F32.PACK_AB, RNE on both halves
  uint32_t w;
  memcpy(&w, &p, sizeof w);
  return w;
#else
  return static_cast<uint32_t>(float_to_bf16_rne(lo)) | (static_cast<uint32_t>(float_to_bf16_rne(hi)) << 16);
#endif
}

// ---- packed bf16x2 arithmetic (element 0 in the low half) -------------------------------------------
// The eager bf16 ops compute in fp32 and round the result to bf16: two roundings. Where that equals ONE
// correct rounding of the exact result, the device may use the native add.rn.bf16x2 / mul.rn.bf16x2 (two
// elements per instruction, no fp32 round trip):
//   add (always): the exact sum of two bf16 fits fp32's 24 bits unless the exponents differ by more than
//        16, and then the smaller operand is below a quarter bf16 ulp of the larger: both return the larger;
//   mul (only when the caller guarantees it): two 8-bit significands give an exact 16-bit product UNLESS
//        it falls below fp32's subnormal grid (2^-149), where the fp32 step rounds first. Use it only for
//        products whose operands rule that out (layernorm_modulate: bf16(1 + scale) is 0 or a multiple of
//        2^-8, so n * a keeps its bits above 2^-141); otherwise multiply in fp32 and round (pack_bf16x2).
// tests/cpu/test_numerics.cpp checks the claim against exact arithmetic; the GPU tests check the hardware
// (subnormal results included) against torch. The .rn forms are never contracted into an fma.
DIFUSE_HD uint32_t bf16x2_add_rn(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return pack_bf16x2(add_rn(bf16_lo(a), bf16_lo(b)), add_rn(bf16_hi(a), bf16_hi(b)));
#endif
}

DIFUSE_HD uint32_t bf16x2_mul_rn(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return pack_bf16x2(mul_rn(bf16_lo(a), bf16_lo(b)), mul_rn(bf16_hi(a), bf16_hi(b)));
#endif
}

constexpr uint32_t kBf16x2One = 0x3F803F80u;

}  // namespace difuse::num
