// rope_rotate_half: ERNIE-Image's rotate-half RoPE on bf16 q or k with bf16 cos/sin tables, bit-exact
// (contract in rope_rotate_half.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

detail::Support can_use_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                         const difuse_tensor_view& cos, const difuse_tensor_view& sin);
void rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& cos,
                      const difuse_tensor_view& sin, cudaStream_t stream);

}  // namespace difuse::rope
