// aten's per-head RMSNorm reduction (rows of at most 128 elements: vectorized_layer_norm_kernel with rms = true,
// only its warp 0 holding data) on a row that spans SPAN lanes of a warp: 32 (aten's lanes one to one) or 16
// (two rows per warp instruction). Lane u of a span holds aten's vectors u, u + SPAN, ... (K = 32 / SPAN of
// them), so its first vector's sum combined with its second is exactly what aten's lane u holds after the first
// (offset 16) shuffle level; the levels SPAN / 2 .. 1 then run inside the span (shuffle width SPAN) and the
// span's first lane ends with aten's lane-0 bits. Lanes without data hold +0, as aten's idle threads do. Used by
// rms_norm.cu's per-head kernel and rope/qk_norm_rope.cu (FLUX's prologue); the arithmetic is
// layernorm_schedule.h's (rms_push_vec4, rms_combine, rms_finalize_roots).
#pragma once

#include <cstdint>

#include "difuse/numerics/bf16.h"
#include "norm/layernorm_schedule.h"

namespace difuse::norm {

// The lane's sum of squares after aten's offset-16 level (one vector: its plain sum).
template <int K>
__device__ __forceinline__ float rms_lane_sum(const uint2 (&x)[K]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const float t = rms_push_vec4(0.f, num::bf16_lo(x[j].x), num::bf16_hi(x[j].x), num::bf16_lo(x[j].y),
                                  num::bf16_hi(x[j].y));
    s = j == 0 ? t : rms_combine(s, t);
  }
  return s;
}

// The remaining shuffle levels for R rows at once (interleaved); every lane of the warp must call it.
template <int SPAN, int R>
__device__ __forceinline__ void rms_span_tree(float (&s)[R]) {
#pragma unroll
  for (int o = SPAN / 2; o >= 1; o /= 2) {
#pragma unroll
    for (int q = 0; q < R; ++q) s[q] = rms_combine(s[q], __shfl_down_sync(0xffffffffu, s[q], o, SPAN));
  }
}

// The span's reduced sum, broadcast from its first lane; every lane of the warp must call it.
template <int SPAN>
__device__ __forceinline__ float rms_span_total(float reduced) {
  return __shfl_sync(0xffffffffu, reduced, 0, SPAN);
}

// rstd from a span's total (aten's warps 1..3 contribute +0 roots).
__device__ __forceinline__ float rms_head_rstd(float total, int n, float eps, float inv_n_pow2) {
  const float roots[4] = {total, 0.f, 0.f, 0.f};
  return rms_finalize_roots(roots, n, eps, inv_n_pow2);
}

}  // namespace difuse::norm
