// rms_norm: torch.nn.RMSNorm / F.rms_norm (aten's fused kernel), bit-exact (contract in rms_norm.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::norm {

// weight may be a view with data == nullptr (no weight).
detail::Support can_use_rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                 const difuse_tensor_view& weight, double eps);
void rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight, double eps,
              cudaStream_t stream);

}  // namespace difuse::norm
