// gelu_tanh: F.gelu(x, approximate="tanh") in bf16, bit-exact (contract in gelu_tanh.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::activation {

detail::Support can_use_gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x);
void gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x, cudaStream_t stream);

}  // namespace difuse::activation
