// activation_mul: act(a) * b in bf16 with act given as the table of its 65,536 bf16 results (gated FFNs: ERNIE-Image's
// up * F.gelu(gate), FLUX.2's SwiGLU silu(x1) * x2), bit-exact (contract in activation_mul.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::activation {

detail::Support can_use_activation_mul(const difuse_tensor_view& out, const difuse_tensor_view& a,
                                       const difuse_tensor_view& b, const difuse_tensor_view& table);
void activation_mul(const difuse_tensor_view& out, const difuse_tensor_view& a, const difuse_tensor_view& b,
                    const difuse_tensor_view& table, cudaStream_t stream);

}  // namespace difuse::activation
