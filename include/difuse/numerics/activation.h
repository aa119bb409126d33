// difuse/numerics/activation.h — activation functions exactly as torch 2.11's CUDA kernels compute them.
//
// GELU, approximate='tanh' (aten GeluCUDAKernelImpl; shared/reference/torch-2.11-numerics.md §5, verified on
// all 65,536 bf16 inputs there):
//   c = RN(RN(x*x)*x);  inner = RN(kBeta * fma(c, kKappa, x));  y = RN(RN(0.5f*x) * RN(1.0f + tanhf(inner)))
// with kBeta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5) and kKappa = 0.044715f. tanhf is libdevice's accurate
// version; the build must not use --use_fast_math or -ftz (nvcc's defaults, as torch's build). On the host
// tanh_cuda is std::tanh, an approximation: host results are for tolerance checks only.
#pragma once

#include "difuse/numerics/fp32.h"

namespace difuse::num {

constexpr float kGeluBeta = 0.79788458347320556641f;   // (float)(M_SQRT2 * M_2_SQRTPI * 0.5)
constexpr float kGeluKappa = 0.044714998453855514526f;  // 0.044715f

DIFUSE_HD float tanh_cuda(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

DIFUSE_HD float gelu_tanh(float x) {
  const float c = mul_rn(mul_rn(x, x), x);
  const float inner = mul_rn(kGeluBeta, fma_rn(c, kGeluKappa, x));
  return mul_rn(mul_rn(0.5f, x), add_rn(1.0f, tanh_cuda(inner)));
}

// A gated FFN's product act(a) * b (ERNIE-Image: up * F.gelu(gate); FLUX.2's SwiGLU: silu(x1) * x2): the
// activation's own kernel rounds its result to bf16 (act_bf16, read back exactly), then aten's bf16 multiply
// (BinaryFunctor<bf16, bf16, bf16, MulFunctor<float>>) computes one fp32 product, rounded to bf16 by the caller.
// The product is commutative, so the operand order of the eager expression does not matter.
DIFUSE_HD float gated_product(float act_bf16, float b) { return mul_rn(act_bf16, b); }

}  // namespace difuse::num
