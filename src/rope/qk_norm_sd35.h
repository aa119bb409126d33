// qk_norm_sd35: SD3.5's joint-attention QK path (diffusers RMSNorm per head on the BHSD views of both streams, the
// [image, context] concat of q, k, v along the sequence in BHSD) in one launch, bit-exact (contract in the .cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

// Views with data == nullptr and rank 0 are absent (see difuse_qk_norm_sd35_args).
struct QkNormSd35Args {
  difuse_tensor_view q_out, k_out, v_out;
  difuse_tensor_view q, k, v, q_weight, k_weight;                  // image ("sample") stream, [B, H, S, D] views
  difuse_tensor_view q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight;  // context stream
  double eps = 1e-6;
};

detail::Support can_use_qk_norm_sd35(const QkNormSd35Args& a);
void qk_norm_sd35(const QkNormSd35Args& a, cudaStream_t stream);

}  // namespace difuse::rope
