// rms_norm_modulate: RMSNorm-based adaLN (diffusers ERNIE-Image, LTX-2), bit-exact (contract in the .cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "core/rows.h"
#include "difuse/difuse.h"

namespace difuse::norm {

// out = diffusers RMSNorm(x, weight, eps), then * (1 + scale) + shift with torch broadcasting, in the bf16
// chain (fp32_modulate == 0: LTX-2) or the fp32 chain (fp32_modulate == 1: ERNIE-Image). weight may be a
// view with data == nullptr and rank 0 (none).
detail::Support can_use_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                          const difuse_tensor_view& weight, const difuse_tensor_view& scale,
                                          const difuse_tensor_view& shift, double eps, int fp32_modulate);
void rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                       const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps, int fp32_modulate,
                       cudaStream_t stream);

// residual = h + gate * a (both eager roundings; gate broadcast like scale), out = rms_norm_modulate(residual).
// residual may be h itself (in place).
detail::Support can_use_gated_residual_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                                         const difuse_tensor_view& h, const difuse_tensor_view& a,
                                                         const difuse_tensor_view& gate, const difuse_tensor_view& weight,
                                                         const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                                         double eps, int fp32_modulate);
void gated_residual_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                      const difuse_tensor_view& h, const difuse_tensor_view& a,
                                      const difuse_tensor_view& gate, const difuse_tensor_view& weight,
                                      const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps,
                                      int fp32_modulate, cudaStream_t stream);

// Vectors of 4 elements each lane holds in registers for a row of width n (n >= 128, n % 4 == 0): the
// kernel instance taken (8, 16, 24, 32, 48 or 64); 0 for rows the register kernels do not take (n < 128).
int rms_norm_modulate_lane_vectors(int64_t n);

// Whether the residual form's staged rows take the quarter-batch kernel (54 registers, one block per SM more than
// the default's 64): only for a per-token gate (every row its own gate row) and only when that saves a wave, i.e. a
// grid of `blocks` needs fewer waves at `resident_quarter` blocks at once than at `resident_default`. Measured on the
// H200 (rms_norm_modulate.cu, launch): a wave saved 5.5 us at 4352x1x3072, while in one wave either way the
// quarter batches cost 3-4.5 us (1x4096x3072, 2x126x2048), and [B, H] gates lost even where a wave was saved.
bool residual_quarter_batches(bool per_token_gate, int64_t blocks, int64_t resident_quarter, int64_t resident_default);

// Where the modulation row of x's row r starts: x's leading dims right-aligned into a RowIndexer carrying m's
// strides where m has that dim and 0 where it broadcasts (torch's rules; the predicate has checked the shapes).
detail::RowIndexer broadcast_row_indexer(const difuse_tensor_view& m, const difuse_tensor_view& x);

// The distinct modulation rows of rows [0, rows) under r, where there are at most two (the streamed kernel's staged
// rows): 1 (every row reads offset 0: [H] or [1, H] rows, or B = 1), or 2 with offsets[1] the row the second index
// of the one leading dim of size 2 that moves (ERNIE's [B, H] chunks against [S, B, H], LTX-2's [B, 1, D] against
// [B, L, D], B = 2) starts at; 0 where more rows are distinct (per-token rows, B > 2: loaded from global memory).
// offsets[0] is 0 whenever the result is nonzero.
int staged_row_offsets(const detail::RowIndexer& r, int64_t rows, int64_t offsets[2]);

// Whether rms_norm_modulate (residual: gated_residual_rms_norm_modulate) takes its streamed rows by default, where no
// measurement knob forces another kernel: at least 8192 rows whose weight and modulation rows the block stages
// (staged_mod_rows: at most two distinct rows per role, 8-byte words), at least 4096 such rows where the streamed
// kernel for them is compiled for N = 3072 (full_width_v: full_width_for's vector count, 768 there; 0 for the run-time
// width; fiftieth session; the residual form's 1024 keeps 8192, not yet timed below it), or the plain form at least
// 4096 rows wider than 3072 (where the staged rows are not the default). Measured on the H200 and, the N = 3072 rule,
// on an H100 at 94 SMs (rms_norm_modulate.cu, launch).
bool rms_streamed_by_default(bool residual, int64_t n, int64_t rows, bool staged_mod_rows, int full_width_v);

// The most rows rms_norm_modulate's STAGE_ALL rows take by default (the LayerNorms' few-row bound; 252 rows measured).
constexpr int64_t kRmsStageAllMaxRows = 1024;

// Whether rms_norm_modulate (either form) takes its STAGE_ALL rows by default (fifty-second session; the rows that
// kernel can run: 8-byte modulation rows, N % 8 == 0, x 16-byte aligned), where no measurement knob forces another
// kernel: at most kRmsStageAllMaxRows rows, all of whose one-warp blocks are resident at once (resident: the device's
// SMs times the kernel's blocks per SM at the row's shared memory). There a row's time is its chain of round trips,
// which the kernel cuts to one burst; with more rows than fit at once it lost. Measured on an H100 at 94 SMs
// (rms_norm_modulate.cu, launch).
bool rms_stage_all_by_default(int64_t rows, int64_t resident);

}  // namespace difuse::norm
