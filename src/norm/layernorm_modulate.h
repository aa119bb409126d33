// layernorm_modulate: adaLN LayerNorm + modulate, bit-exact (contract in layernorm_modulate.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::norm {

detail::Support can_use_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                           const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                           double eps);
// Throws detail::Failure (DIFUSE_ERR_UNSUPPORTED with every reason, or DIFUSE_ERR_CUDA).
void layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& scale,
                        const difuse_tensor_view& shift, double eps, cudaStream_t stream);

// Wan's chain: (LN_f32(f32(x)) * (1 + scale) + shift).type_as(x) with fp32 scale/shift [B, H], [B, 1, H] or
// [B, L, H]; H <= 24576.
detail::Support can_use_layernorm_modulate_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                                const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                                double eps);
void layernorm_modulate_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& scale,
                             const difuse_tensor_view& shift, double eps, cudaStream_t stream);

// Wan's norm2: F.layer_norm(x.float(), (H,), weight, bias, eps).type_as(x), fp32 weight and bias [H].
detail::Support can_use_layernorm_affine_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                              const difuse_tensor_view& weight, const difuse_tensor_view& bias,
                                              double eps);
void layernorm_affine_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                           const difuse_tensor_view& bias, double eps, cudaStream_t stream);

// The pre-FF site: residual = h + gate * a (both eager roundings), out = layernorm_modulate(residual).
// residual may be h itself. gate [B, H] or [B, L, H]; H <= 24576.
detail::Support can_use_gated_residual_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                                          const difuse_tensor_view& h, const difuse_tensor_view& a,
                                                          const difuse_tensor_view& gate, const difuse_tensor_view& scale,
                                                          const difuse_tensor_view& shift, double eps);
void gated_residual_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                       const difuse_tensor_view& h, const difuse_tensor_view& a,
                                       const difuse_tensor_view& gate, const difuse_tensor_view& scale,
                                       const difuse_tensor_view& shift, double eps, cudaStream_t stream);

// Which schedule a row width and alignment take (exposed for tests and the kernel list).
struct LayernormModulateConfig {
  int threads_per_row;  // 32, 64, 128 (rows staged in shared memory); 0 = the two-pass kernel (H > 24576)
  bool paired;          // 16-byte accesses
  int sweeps;           // sweeps of 512 elements (aten's 128 threads x 4) per row
  // gated_residual_layernorm_modulate only: two warps per row on the 32-register kernel (8 blocks per SM, the
  // modulation rows and a from global memory, the unpaired map; what DIFUSE_LNMOD_BLOCKS_PER_SM=8 forces)
  bool dense = false;
};
LayernormModulateConfig layernorm_modulate_config(int64_t h, bool aligned16);
// gated_residual_layernorm_modulate's schedule: layernorm_modulate_config's, except four warps per row for at most
// 1024 rows at 5-7 sweeps (H in (2048, 3584]), where the two-warp blocks leave SMs with one block each, and the
// 32-register two-warp kernel (`dense`) for at least 8192 rows at 1-3 sweeps (H <= 1536).
LayernormModulateConfig gated_residual_layernorm_modulate_config(int64_t h, bool aligned16, int64_t rows);
// layernorm_modulate's schedule: layernorm_modulate_config's, except four warps per row (with the batched epilogue)
// for at most 1024 rows at 3-7 sweeps (H in (1024, 3584]), and one warp per row for at least 8192 rows at 1-3 sweeps
// (H <= 1536).
LayernormModulateConfig layernorm_modulate_rows_config(int64_t h, bool aligned16, int64_t rows);
// The fp32 norms' schedule (layernorm_modulate_fp32, layernorm_affine_fp32): layernorm_modulate_config's, except one
// warp per row for at least 8192 rows at 1-3 sweeps (Wan 2.1 1.3B's 1536).
LayernormModulateConfig layernorm_fp32_rows_config(int64_t h, bool aligned16, int64_t rows);
// Whether the fp32 kernels read the fp32 modulation (or affine) rows as float4: both rows 16-byte aligned at
// every batch / token step and contiguous in H. Otherwise four scalar loads; the arithmetic is the same.
bool layernorm_fp32_rows_vec4(const difuse_tensor_view& scale, const difuse_tensor_view& shift);
// Whether a LayerNorm's streamed rows run on one-warp consumer groups (24 groups, four slots per thread) instead of
// 12 two-warp groups: knob = DIFUSE_LNMOD_STREAM_WARP (1: always, 0: never, -1 unset: the default by width). The
// default, measured on the H200 at e7993bf (layernorm_modulate.cu, stream_warp_groups): the plain LayerNorms
// (layernorm_modulate, layernorm_modulate_fp32, layernorm_affine_fp32) up to H = 4096, GRLN (grln) up to 1536.
bool stream_one_warp_groups(bool grln, int64_t h, int knob);
// Whether the plain LayerNorms (layernorm_modulate, layernorm_modulate_fp32, layernorm_affine_fp32) take the streamed
// rows by default, no knob set: at least 4096 rows whose modulation (or affine) rows the ring stages (smod), and rows
// up to H = 4096 anywhere, wider rows (the two-warp groups: Wan 14B's 5120) only where DRAM outpaces the SMs
// (detail::dram_outpaces_sms on detail::dram_bytes_per_sm_cycle: 15.5 bytes per SM cycle; 0, unknown, keeps the
// streamed rows, the choice before this rule). Measured at 1x32760x5120 (contract in layernorm_modulate.cu,
// plain_streamed_by_default_or_knob): the H200 streamed 181.8 us vs 209.8 staged (fp32 chain, e831f9c), a whole H100
// SXM (12.83) 260.0-261.8 vs 237.5-238.0 (bf84066, bench/results/h100/streamed-norms-bf84066/).
bool plain_layernorm_streamed_by_default(int64_t rows, int64_t h, bool smod, double dram_bytes_per_sm_cycle);

}  // namespace difuse::norm
