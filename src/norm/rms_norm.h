// rms_norm: torch.nn.RMSNorm / F.rms_norm (aten's fused kernel), bit-exact (contract in rms_norm.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::norm {

// weight may be a view with data == nullptr (no weight).
detail::Support can_use_rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                 const difuse_tensor_view& weight, double eps);
void rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight, double eps,
              cudaStream_t stream);

// Whether rows of n > 128 elements, `rows` of them, go to the streamed rows (rms_norm_streamed; the launcher also
// needs n % 8 == 0 and 16-byte aligned rows and out): knob is DIFUSE_RMS_STREAMED (> 0 always, 0 never, < 0 unset:
// the default, 129..2048 elements and at least 8192 rows; contract in rms_norm.cu, STREAMED_DEFAULT).
bool rms_norm_streamed_by_default(int64_t n, int64_t rows, int knob);

}  // namespace difuse::norm
