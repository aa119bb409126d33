// difuse/numerics/fp32.h — fp32 operations with one rounding each, never contracted.
//
// Every eager PyTorch op is a rounding point; a fused kernel must round exactly where the eager chain
// does. These helpers name each operation explicitly so that neither nvcc nor the host compiler can
// fuse a multiply into an add the eager chain kept separate (or split an fma the eager chain fused).
// Device code uses the CUDA _rn intrinsics, which are never contracted; host code relies on IEEE
// single precision with contraction off (the build passes -ffp-contract=off to host compilers).
//
// Device-only sequences that have no exact host twin live in rsqrt_cuda(): see its comment.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DIFUSE_HD __host__ __device__ __forceinline__
#define DIFUSE_DEVICE __device__ __forceinline__
#else
#define DIFUSE_HD inline
#define DIFUSE_DEVICE inline
#endif

namespace difuse::num {

DIFUSE_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;  // volatile: keeps the host compiler from fusing with a neighbour
  return r;
#endif
}

DIFUSE_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}

DIFUSE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}

// a*b + c with a single rounding (FFMA), as the contracted aten kernels compute it.
DIFUSE_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Correctly rounded IEEE division: aten's `a / b` (div.rn.f32 / the FCHK slow-path sequence).
DIFUSE_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  volatile float r = a / b;
  return r;
#endif
}

// a / n for a row width n, correctly rounded, as aten divides a row's sum by its width (div.rn.f32). When n is a
// power of two, 1/n is exact and a * (1/n) is the same real number as a / n, so one correctly rounded multiply
// (FMUL) gives the same bits as the division (subnormal results included: both round the same real value) at
// a tenth of the instructions; other widths divide. `inv_pow2` is 1/n when n is a power of two, else 0 (see
// inv_pow2_or_zero); tests/cpu/test_numerics.cpp compares the two paths over the whole exponent range.
DIFUSE_HD float div_by_width_rn(float a, float n, float inv_pow2) {
  return inv_pow2 != 0.0f ? mul_rn(a, inv_pow2) : div_rn(a, n);
}

// 1/n when n >= 1 is a power of two (exact in fp32 for n <= 2^126), else 0: the argument div_by_width_rn takes.
inline float inv_pow2_or_zero(long long n) {
  if (n < 1 || n > (1LL << 62) || (n & (n - 1)) != 0) return 0.0f;
  return 1.0f / static_cast<float>(n);
}

// Correctly rounded reciprocal: what nvcc emits for `1.f / x` under -prec-div=true (rcp.rn.f32).
// aten's vectorized LayerNorm Welford multiplies by this instead of dividing.
DIFUSE_HD float rcp_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  volatile float r = 1.0f / x;
  return r;
#endif
}

// The correctly rounded reciprocal of a small positive integer, folded at compile time. Equal to
// rcp_rn((float)k) for every k < 2^24 (both are the IEEE quotient 1/k rounded to nearest even).
DIFUSE_HD constexpr float rcp_of_count(int k) { return 1.0f / static_cast<float>(k); }

// CUDA's rsqrtf compiled without -ftz: MUFU.RSQ, with inputs below FLT_MIN scaled by 2^24 first and the
// result by 2^12. It is NOT correctly rounded, and torch's rsqrt / norm kernels use exactly this, so
// device code must call rsqrtf itself. The host version is an approximation (1/sqrt in double, rounded)
// used only by host emulations that are compared within a tolerance, never bit for bit with the GPU.
DIFUSE_HD float rsqrt_cuda(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(x)));
#endif
}

// rsqrt_cuda for an input whose magnitude is at least FLT_MIN, or an infinity or NaN (never zero nor subnormal):
// rsqrtf's sequence scales only inputs with |x| < FLT_MIN (FSETP.GEU |x|, FLT_MIN, which NaN passes as
// unordered), so for every other input it is MUFU.RSQ alone, which rsqrt.approx.ftz.f32 issues without the test
// and the two predicated multiplies: rsqrtf's bits, 3 instructions fewer. The caller proves the range (e.g. a
// norm's RN(mean + eps) with mean >= +0 or NaN and eps >= FLT_MIN, as RN is monotone).
DIFUSE_HD float rsqrt_cuda_normal_input(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return rsqrt_cuda(x);
#endif
}

DIFUSE_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

DIFUSE_HD float float_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

}  // namespace difuse::num
