// diffusers' RMSNorm class (two roundings) on the rows of one attention head, 32 <= D <= 128, one warp per row:
// the pieces the attention-prologue kernels (rope/qk_norm_rope_qwen.cu, rope/qk_norm_sd35.cu) and their host
// emulation (tests/cpu/test_qk_norm_qwen_sd35.cpp) share.
//
// The arithmetic is rms_modulate_schedule.h's (aten's generic mean, reduce_kernel in its (32, 16) block, one warp
// per row; then RN(var + eps), rsqrtf, bf16(RN(x * rstd)), bf16(RN(y * w))). Only where a lane's elements come
// from differs: the kernels load a row as runs of E consecutive elements per lane (E = 4 above 64 elements, else
// 2: full-width coalesced loads, and each RoPE pair (2i, 2i + 1) inside one lane), lane l holding elements
// [E l, E l + E). aten's lane l owns
//   D == 128 (vectorized: dim0 >= 128): the float4 vector l, elements 4l..4l + 3, one per accumulator: exactly
//            our lane l's run (E = 4);
//   D <  128: element l + 32 i in accumulator i (main loop or tail: the same assignment for one group of 128):
//            taken from lane (l + 32 i) / E, position (l + 32 i) % E (a shuffle on the device).
// Then ((a0 + a1) + a2) + a3, the shuffle-down tree 16..1, mean = RN(sum * factor) with the factor of THAT
// norm's input tensor, (float)rows / (float)(rows * D), rows = every row of the tensor normalised.
#pragma once

#include <cstdint>

#include "difuse/numerics/bf16.h"
#include "norm/rms_modulate_schedule.h"

namespace difuse::norm {

// Elements per lane for a head of d elements.
DIFUSE_HD constexpr int head_lane_elems(int d) { return d > 64 ? 4 : 2; }

// E bf16 elements of a row, element 0 in the low half of w[0] (what one lane loads and stores).
template <int E>
struct HeadRun {
  uint32_t w[E / 2];
};

// a when pick, else b, word by word (a select, never an indexed local array).
template <int E>
DIFUSE_HD HeadRun<E> select_run(bool pick, const HeadRun<E>& a, const HeadRun<E>& b) {
  HeadRun<E> r;
  for (int j = 0; j < E / 2; ++j) r.w[j] = pick ? a.w[j] : b.w[j];
  return r;
}

template <int E>
DIFUSE_HD float run_elem(const HeadRun<E>& r, int pos) {
  const uint32_t word = r.w[pos / 2];
  return (pos & 1) ? num::bf16_hi(word) : num::bf16_lo(word);
}

// One lane's total of aten's four mean accumulators for a row of d elements. own = this lane's run (zeros past
// the row); fetch(src, pos) = element pos of lane src's run. Every lane calls fetch the same number of times
// (the loop bound depends on d only): on the device it is a warp shuffle.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <int E, class Fetch>
DIFUSE_HD float head_mean_lane_total(int lane, int d, const HeadRun<E>& own, const Fetch& fetch) {
  MeanLane acc;
  if (E == 4 && d >= 128) {  // vectorized: our run is aten's float4 vector (d == 128)
    mean_push_vec4(acc, run_elem(own, 0), run_elem(own, 1), run_elem(own, 2 % E), run_elem(own, 3 % E));
  } else {
    for (int i = 0; i < 4 && 32 * i < d; ++i) {
      const int e = lane + 32 * i;
      const float v = fetch(e / E, e % E);
      if (e < d) mean_push_scalar(acc, i, v);
    }
  }
  return mean_lane_total(acc);
}

// Rows of exactly 64 elements on half a warp (16 lanes, two rows per warp instruction): span lane u holds
// elements u, u + 16, u + 32, u + 48 (x[0..3]). aten's lane u owns elements u and u + 32 (accumulators 0 and 1;
// 2 and 3 stay +0) and its lane u + 16 elements u + 16 and u + 48, so the span lane forms both lanes' totals and
// aten's offset-16 tree step (lane u + lane u + 16) itself; the steps 8..1 then run at shuffle width 16 and the
// span's first lane ends with aten's lane-0 sum (lane 0's result never reads lanes 16..31 after the first step).
// Each accumulator takes one push and 2, 3 none, so the +0 additions are left out (mean_first_push_scalar,
// mean_lane_total_first_two: the same bits, 8 instructions fewer per row and lane).
DIFUSE_HD float head64_span_lane_sum(const float (&x)[4]) {
  MeanLane lo, hi;
  mean_first_push_scalar(lo, 0, x[0]);
  mean_first_push_scalar(lo, 1, x[2]);
  mean_first_push_scalar(hi, 0, x[1]);
  mean_first_push_scalar(hi, 1, x[3]);
  return mean_tree_step(mean_lane_total_first_two(lo), mean_lane_total_first_two(hi));
}

// The norm of one run: bf16(RN(x * rstd)), then bf16(RN(y * w)) with a weight (diffusers_rms_value per element).
template <int E>
DIFUSE_HD HeadRun<E> diffusers_norm_run(const HeadRun<E>& x, float rstd, bool has_w, const HeadRun<E>& w) {
  HeadRun<E> y;
  for (int j = 0; j < E / 2; ++j)
    y.w[j] = diffusers_rms_pair(x.w[j], rstd, has_w, w.w[j]);  // diffusers_rms_value per half, packed
  return y;
}

#if defined(__CUDACC__)
template <int E>
__device__ __forceinline__ HeadRun<E> load_run(const uint16_t* row, int lane) {
  HeadRun<E> r;
  if constexpr (E == 4) {
    const uint2 v = reinterpret_cast<const uint2*>(row)[lane];
    r.w[0] = v.x;
    r.w[1] = v.y;
  } else {
    r.w[0] = reinterpret_cast<const uint32_t*>(row)[lane];
  }
  return r;
}

template <int E>
__device__ __forceinline__ void store_run(uint16_t* row, int lane, const HeadRun<E>& r) {
  if constexpr (E == 4)
    reinterpret_cast<uint2*>(row)[lane] = make_uint2(r.w[0], r.w[1]);
  else
    reinterpret_cast<uint32_t*>(row)[lane] = r.w[0];
}

template <int E>
__device__ __forceinline__ HeadRun<E> zero_run() {
  HeadRun<E> r;
  for (int j = 0; j < E / 2; ++j) r.w[j] = 0u;
  return r;
}

// fetch for head_mean_lane_total on the device: element pos of lane src's run, by shuffles of every word (the
// word wanted depends on the calling lane).
template <int E>
struct ShuffleFetch {
  const HeadRun<E>& run;
  __device__ __forceinline__ float operator()(int src, int pos) const {
    uint32_t word = __shfl_sync(0xffffffffu, run.w[0], src & 31);
    if constexpr (E == 4) {
      const uint32_t w1 = __shfl_sync(0xffffffffu, run.w[1], src & 31);
      if (pos & 2) word = w1;
    }
    return (pos & 1) ? num::bf16_hi(word) : num::bf16_lo(word);
  }
};

// rstd of R rows of one norm input held by one warp (their trees interleaved): every lane returns each row's rstd.
template <int E, int R>
__device__ __forceinline__ void head_rstd(const HeadRun<E> (&x)[R], int lane, int d, float factor, float eps,
                                          float (&rstd)[R]) {
  float tot[R];
#pragma unroll
  for (int q = 0; q < R; ++q) tot[q] = head_mean_lane_total<E>(lane, d, x[q], ShuffleFetch<E>{x[q]});
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
#pragma unroll
    for (int q = 0; q < R; ++q) tot[q] = mean_tree_step(tot[q], __shfl_down_sync(0xffffffffu, tot[q], o));
  }
#pragma unroll
  for (int q = 0; q < R; ++q) rstd[q] = diffusers_rstd(__shfl_sync(0xffffffffu, tot[q], 0), factor, eps);
}

// The rest of aten's tree for R rows on half warps whose span lanes hold aten's sums after its offset-16 step:
// the steps 8..1 at shuffle width 16, the span's first lane's sum broadcast, rstd. Every lane of the warp must call
// it.
// BUTTERFLY (eps >= FLT_MIN, the caller checks): the steps 8..1 as a butterfly (xor shuffles at width 16), so every
// lane of the span ends with the bits the shuffle-down tree leaves in its first lane (mean_butterfly_host says why)
// and no broadcast follows, and rsqrtf without its subnormal scaling (diffusers_rstd_normal_eps). The same bits; one
// shuffle and ~4 other instructions fewer per slot.
template <int R, bool BUTTERFLY = false>
__device__ __forceinline__ void span16_rstd(float (&tot)[R], float factor, float eps, float (&rstd)[R]) {
#pragma unroll
  for (int o = 8; o >= 1; o /= 2) {
#pragma unroll
    for (int q = 0; q < R; ++q)
      tot[q] = mean_tree_step(tot[q], BUTTERFLY ? __shfl_xor_sync(0xffffffffu, tot[q], o, 16)
                                                : __shfl_down_sync(0xffffffffu, tot[q], o, 16));
  }
#pragma unroll
  for (int q = 0; q < R; ++q)
    rstd[q] = BUTTERFLY ? diffusers_rstd_normal_eps(tot[q], factor, eps)
                        : diffusers_rstd(__shfl_sync(0xffffffffu, tot[q], 0, 16), factor, eps);
}

// head_rstd for rows of exactly 128 elements spanning half a warp (16 lanes, two rows per warp instruction): lane
// u holds runs (aten's float4 vectors) u and u + 16, so the total of its first run combined with its second's is
// what aten's lane u holds after its offset-16 step; the steps 8..1 run at shuffle width 16 and the half's first
// lane ends with aten's lane-0 sum. Every lane of the warp must call it.
template <int R>
__device__ __forceinline__ void head_rstd_half_warp(const HeadRun<4> (&x)[R][2], float factor, float eps,
                                                    float (&rstd)[R]) {
  float tot[R];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    MeanLane a0, a1;  // one vector each: first pushes (the same bits without the +0 additions)
    mean_first_push_vec4(a0, run_elem(x[q][0], 0), run_elem(x[q][0], 1), run_elem(x[q][0], 2), run_elem(x[q][0], 3));
    mean_first_push_vec4(a1, run_elem(x[q][1], 0), run_elem(x[q][1], 1), run_elem(x[q][1], 2), run_elem(x[q][1], 3));
    tot[q] = mean_tree_step(mean_lane_total(a0), mean_lane_total(a1));
  }
  span16_rstd<R>(tot, factor, eps, rstd);
}

// rstd of R slots of 64-element rows on half warps (head64_span_lane_sum, then the steps 8..1 at width 16); every
// lane of the warp must call it.
// BUTTERFLY (eps >= FLT_MIN, the caller checks): span16_rstd's butterfly, the same bits.
template <int R, bool BUTTERFLY = false>
__device__ __forceinline__ void head64_rstd_half_warp(const float (&x)[R][4], float factor, float eps,
                                                      float (&rstd)[R]) {
  float tot[R];
#pragma unroll
  for (int q = 0; q < R; ++q) tot[q] = head64_span_lane_sum(x[q]);
  span16_rstd<R, BUTTERFLY>(tot, factor, eps, rstd);
}
#endif

}  // namespace difuse::norm
