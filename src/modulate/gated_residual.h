// gated_residual: h + gate * a with both eager roundings (contract in gated_residual.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::modulate {

detail::Support can_use_gated_residual(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                       const difuse_tensor_view& a, const difuse_tensor_view& gate);
void gated_residual(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                    const difuse_tensor_view& gate, cudaStream_t stream);
// Wan: out = (h.float() + a * gate).type_as(h), gate fp32 [B, H], [B, 1, H] or [B, L, H].
detail::Support can_use_gated_residual_fp32(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                            const difuse_tensor_view& a, const difuse_tensor_view& gate);
void gated_residual_fp32(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                         const difuse_tensor_view& gate, cudaStream_t stream);
// Elements per access (8, 4, 2 or 1) for these pointers and strides.
int gated_residual_vector_width(const difuse_tensor_view& out, const difuse_tensor_view& h, const difuse_tensor_view& a,
                                const difuse_tensor_view& gate);
// The access width gated_residual_fp32 uses: 8 (16-byte bf16 words, two float4 gates), 2 or 1, by H and alignment.
int gated_residual_fp32_vector_width(const difuse_tensor_view& out, const difuse_tensor_view& h,
                                     const difuse_tensor_view& a, const difuse_tensor_view& gate);

}  // namespace difuse::modulate
