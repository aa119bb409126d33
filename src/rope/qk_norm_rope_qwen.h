// qk_norm_rope_qwen: Qwen-Image's attention prologue (diffusers RMSNorm per head on both streams, complex RoPE per
// stream, the joint [text, image] concat of q, k, v) in one launch, bit-exact (contract in qk_norm_rope_qwen.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::rope {

// Views with data == nullptr and rank 0 are absent (see difuse_qk_norm_rope_qwen_args).
struct QkNormRopeQwenArgs {
  difuse_tensor_view q_out, k_out, v_out;
  difuse_tensor_view q, k, v, q_weight, k_weight;                  // image stream
  difuse_tensor_view q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight;  // text stream
  difuse_tensor_view freqs, freqs_txt;  // fp32 (re, im) pairs [S, head_dim]: the complex64 tables viewed as real
  double eps = 1e-6;
};

detail::Support can_use_qk_norm_rope_qwen(const QkNormRopeQwenArgs& a);
void qk_norm_rope_qwen(const QkNormRopeQwenArgs& a, cudaStream_t stream);

}  // namespace difuse::rope
