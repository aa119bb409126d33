// qk_norm_rope: FLUX.1's attention prologue (per-head torch.nn.RMSNorm on q and k, the joint [text, image]
// concat, interleaved real RoPE) in one launch, bit-exact (contract in qk_norm_rope.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

// Views with data == nullptr and rank 0 are absent (see difuse_qk_norm_rope_args).
struct QkNormRopeArgs {
  difuse_tensor_view q_out, k_out, v_out;
  difuse_tensor_view q, k, v, q_weight, k_weight;
  difuse_tensor_view q_first, k_first, v_first, q_first_weight, k_first_weight;
  difuse_tensor_view cos, sin;
  double eps = 1e-6;
};

detail::Support can_use_qk_norm_rope(const QkNormRopeArgs& a);
void qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream);

}  // namespace difuse::rope
