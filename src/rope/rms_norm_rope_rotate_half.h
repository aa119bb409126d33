// rms_norm_rope_rotate_half: ERNIE-Image's per-head QK RMSNorm and rotate-half RoPE on one q or k tensor in one
// pass, bit-exact (contract in rms_norm_rope_rotate_half.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

// weight: nullptr-data view (rank 0) for none.
detail::Support can_use_rms_norm_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                                  const difuse_tensor_view& weight, const difuse_tensor_view& cos,
                                                  const difuse_tensor_view& sin, double eps);
void rms_norm_rope_rotate_half(const difuse_tensor_view& out, const difuse_tensor_view& x,
                               const difuse_tensor_view& weight, const difuse_tensor_view& cos,
                               const difuse_tensor_view& sin, double eps, cudaStream_t stream);

}  // namespace difuse::rope
