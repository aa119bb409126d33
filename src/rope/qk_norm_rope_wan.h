// qk_norm_rope_wan: Wan 2.x's self-attention prologue (torch.nn.RMSNorm across heads on q and k, the head
// split, Wan's own interleaved RoPE) in one launch, bit-exact (contract in qk_norm_rope_wan.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

// Views with data == nullptr and rank 0 are absent (see difuse_qk_norm_rope_wan_args).
struct QkNormRopeWanArgs {
  difuse_tensor_view q_out, k_out;
  difuse_tensor_view q, k, q_weight, k_weight;
  difuse_tensor_view freqs_cos, freqs_sin;
  int64_t heads = 0;
  double eps = 1e-6;
};

detail::Support can_use_qk_norm_rope_wan(const QkNormRopeWanArgs& a);
void qk_norm_rope_wan(const QkNormRopeWanArgs& a, cudaStream_t stream);

}  // namespace difuse::rope
