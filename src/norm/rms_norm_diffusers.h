// rms_norm_diffusers: the diffusers RMSNorm class chain (two roundings), bit-exact (contract in the .cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::norm {

detail::Support can_use_rms_norm_diffusers(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                           const difuse_tensor_view& weight, double eps);
void rms_norm_diffusers(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                        double eps, cudaStream_t stream);
// The mean's scale as aten computes it: (float)rows / (float)(rows * n).
float diffusers_mean_factor(int64_t rows, int64_t n);

}  // namespace difuse::norm
