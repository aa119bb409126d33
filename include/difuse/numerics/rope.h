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

// Wan's own apply_rotary_emb (diffusers 0.42.1 WanAttnProcessor), for a bf16 x and fp32 freqs [1, S, 1, D]:
//     x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)                pairs (x[2i], x[2i+1])
//     cos = freqs_cos[..., 0::2]; sin = freqs_sin[..., 1::2]      c = cos[2i], s = sin[2i+1]
//     out[..., 0::2] = x1 * cos - x2 * sin                        fp32 mul, mul, sub (three kernels)
//     out[..., 1::2] = x1 * sin + x2 * cos                        fp32 mul, mul, add
// and the strided copy into the bf16 `out` rounds once. Bitwise this is rope_interleaved_pair with
// (c0, s0, c1, s1) = (c, s, c, s): RN(a - b) == RN(a + -b) and RN(-x * s) == -RN(x * s) for every operand,
// zeros included, and the sum is commutative (tests/cpu/test_numerics.cpp checks it).
DIFUSE_HD void rope_wan_pair(float x0, float x1, float c, float s, float& o0, float& o1) {
  o0 = sub_rn(mul_rn(x0, c), mul_rn(x1, s));
  o1 = add_rn(mul_rn(x0, s), mul_rn(x1, c));
}

DIFUSE_HD uint32_t rope_wan_bf16x2(uint32_t x2, float c, float s) {
  float o0, o1;
  rope_wan_pair(bf16_lo(x2), bf16_hi(x2), c, s, o0, o1);
  return pack_bf16x2(o0, o1);
}

// Qwen-Image's apply_rotary_emb_qwen(x, freqs_cis, use_real=False) (diffusers 0.42.1), for a bf16 x and
// complex64 freqs [S, D/2]:
//     x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))   x[2i] + i x[2i+1] (exact widening)
//     out = torch.view_as_real(x_c * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)
// One complex64 mul kernel (binary_internal::MulFunctor<c10::complex<float>>), then one bf16 rounding per part.
// c10::complex's operator*= writes real = a*c - b*d, imag = a*d + b*c for (a + bi) * (c + di), and nvcc
// contracts it. The sm_90 SASS of every MulFunctor<c10::complex<float>> kernel in torch 2.11.0+cu130's
// libtorch_cuda.so (vectorized 2/4/8, unrolled, elementwise with and without casts) is
//     FMUL t = b*d; FMUL u = b*c; FFMA re = a*c + (-t); FFMA im = a*d + u
// with (a, b) loaded from operand 0 (x, the left factor in diffusers' `x_rotated * freqs_cis`) and (c, d) from
// operand 1 (the freqs). So re = fma(a, c, -RN(b*d)) and im = fma(a, d, RN(b*c)); the operand order matters for
// im (fma(c, b, RN(d*a)) rounds differently), not for re.
DIFUSE_HD void complex_mul_torch(float a, float b, float c, float d, float& re, float& im) {
  re = fma_rn(a, c, -mul_rn(b, d));
  im = fma_rn(a, d, mul_rn(b, c));
}

// One interleaved pair of bf16 x (element 2i in the low half) times the complex freq (c, d) -> packed bf16.
DIFUSE_HD uint32_t rope_complex_bf16x2(uint32_t x2, float c, float d) {
  float re, im;
  complex_mul_torch(bf16_lo(x2), bf16_hi(x2), c, d, re, im);
  return pack_bf16x2(re, im);
}

// ERNIE-Image's apply_rotary_emb (diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor; Megatron's rotate-half,
// rotary_interleaved=False), for a bf16 x [B, S, heads, D] and fp32 angles freqs [B, S, 1, R]:
//     cos_, sin_ = torch.cos(freqs).to(bf16), torch.sin(freqs).to(bf16)    (torch's own kernels, kept eager)
//     x1, x2 = x[..., :R].chunk(2, -1)                                      halves: partner of i is i +- R/2
//     out = cat(x * cos_ + cat(-x2, x1) * sin_, x[..., R:])                 bf16 mul, neg, mul, add: each op
//                                                                           computes in fp32 and rounds to bf16
// so with h = R/2, for i < h: out[i] = bf16(RN(rb(RN(x[i] * c[i])) + rb(RN(-x[i+h] * s[i])))) and
// out[i+h] = bf16(RN(rb(RN(x[i+h] * c[i+h])) + rb(RN(x[i] * s[i+h])))), rb = the bf16 rounding of an
// intermediate tensor; columns >= R are copied. The negation is applied to the bf16 operand before the product
// (it decides the sign of a zero product); the add's alpha = 1 multiply is exact.
// (xa, xb) = (x[i], x[i+h]) with table entries (ca, sa) at i and (cb, sb) at i+h; results before the final
// .to(bf16).
DIFUSE_HD void rope_rotate_half_pair(float xa, float xb, float ca, float sa, float cb, float sb, float& oa,
                                     float& ob) {
  oa = add_rn(round_bf16(mul_rn(xa, ca)), round_bf16(mul_rn(-xb, sa)));
  ob = add_rn(round_bf16(mul_rn(xb, cb)), round_bf16(mul_rn(xa, sb)));
}

}  // namespace difuse::num
