// rms_norm — torch.nn.RMSNorm / F.rms_norm over the last dim, bit-exact against eager PyTorch.
//
// Eager chain reproduced (FLUX.1 and Wan QK norms, per head 64/128 or across heads 1536/5120), bf16:
//     out = F.rms_norm(x, (N,), weight, eps)         one aten kernel, one bf16 rounding
//
// Replays: torch 2.11.0+cu130, sm_90 — at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>
// (shared/reference/torch-2.11-numerics.md §2): 128 threads per row in aten's layout, s = fma(v, v, s) per
// element, tree s = RN(s + s_in) with offsets 16..1 then warps (0,2),(1,3),(0,1), ms = div(s, N),
// rstd = rsqrtf(RN(ms + eps)), out = bf16(RN(w * RN(rstd * x))) (or bf16(RN(rstd * x)) without weight).
// Rows of <= 128 elements (per-head norms): aten's warp 0 on half of one of our warps, four slots of two rows per
// warp at once (a full warp per row behind DIFUSE_RMS_LANES_PER_ROW=32). Wider rows: aten's own two-pass
// 128-thread layout by default; the staged kernels (layernorm_modulate's thread maps, layernorm_schedule.h, rows
// staged in shared memory) behind DIFUSE_RMS_STAGED_ROWS=1 for rows of at most 48 sweeps. Per-head rows of 64 or
// 128 elements with 16-byte aligned rows: the block's 64 rows first copied into shared memory behind
// DIFUSE_RMS_STAGED_HEADS=1 (test_staged_heads_variant: exact on the H200 at 132f46f; no faster there, knob-sweeps/:
// 1x4608x24x128 19.1 vs 19.0 us, without weight 18.7 vs 17.4). Rows wider than 128 with N % 8 == 0 and 16-byte
// aligned rows: the streamed rows (one block per SM, a ring of bulk-copied rows, one warp per row on aten's paired
// map; rms_norm_streamed, nineteenth session) behind DIFUSE_RMS_STREAMED=G, and by default (twenty-third session)
// for rows of 136..2048 elements where there are at least 8192 of them (Wan 1.3B's 1x32760x1536), with 8 producer
// lanes, on devices where DRAM outpaces the SMs (the H200; not a whole H100: STREAMED_DEFAULT below;
// DIFUSE_RMS_STREAMED=0 turns it off, =1 forces it).
//
// Guards (can_use_rms_norm; every violation is reported): x bf16 on a CUDA device, rank 1-4, last dim
// contiguous, N % 4 == 0, N <= 2^24; a contiguous x must be 8-byte aligned (otherwise aten runs its
// two-kernel path, which rounds differently); a strided x (aten copies it to an aligned buffer first) needs
// 8-byte aligned rows for our loads; weight (optional) bf16 [N] contiguous, 8-byte aligned; out
// contiguous bf16 of x's shape, overlapping nothing.
//
// Verification status: bit-exact on the H200 at 66f5a3b and again at 5f8295d (torch 2.11.0+cu130, sm_90):
// tests/gpu/test_rms_norm.py (268 cases, incl. the full-warp 2/4/8-row per-head variants, the staged kernels through
// DIFUSE_RMS_STAGED_ROWS=1 and the defaults: half-warp per-head rows, aten's two-pass layout above 128), 0 failed,
// 0 skipped. At b9178f7, with the streamed rows (8 producer lanes) the default at >= 8192 rows of 136..2048
// elements: 286 cases passed in the whole suite (bench/results/h200/tests.json, 3,387 passed, 0 failed, 0 skipped),
// incl. test_streamed_default (Wan 1.3B's 1x32760x1536, fused-projection chunks, a transposed view, adversarial rows;
// the profiler shows the streamed kernel at 8192 rows, aten's layout at 8191) and the one-lane knob cases; memcheck
// and racecheck of the smoke test under DIFUSE_RMS_STREAMED=5 (8 lanes, as many as each ring allows) clean
// (sanitizer-b9178f7-cut.log.gz).
#include "norm/rms_norm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/registry.h"
#include "core/rows.h"
#include "core/tensor.h"
#include "norm/head_rms_span.cuh"
#include "norm/layernorm_schedule.h"
#include "norm/rms_map_tree.cuh"
#include "norm/row_staging.cuh"
#include "norm/stream_rows.cuh"

namespace difuse::norm {

namespace {

const detail::KernelRegistration kRegistration{{
    "rms_norm", "cuda", "bit_exact", "F.rms_norm(x, (N,), weight, eps)  (bf16; torch.nn.RMSNorm, aten's fused kernel)",
    "verified bit-exact on H200 at 132f46f (torch 2.11.0+cu130, sm_90)", 90, 90,
    "RMSNorm over the last dim (per head or across heads), strided rows, optional weight"}};

struct Params : detail::BF16RowsIO {
  int v;  // n / 4
  float eps;
};

__device__ __forceinline__ const uint16_t* row_ptr(const Params& p, int64_t r) { return p.x + p.rows_of.offset(r); }

constexpr int rows_per_block(int g) { return g == 128 ? 1 : 256 / g; }

template <int G, bool PAIRED>
__global__ void __launch_bounds__(256) rms_norm_rows(const Params p) {
  using Map = AtenThreadMap<G, PAIRED>;
  constexpr int A = Map::kSlots;
  constexpr int ROWS = rows_per_block(G);
  constexpr int STEP = PAIRED ? 2 : 1;
  extern __shared__ uint2 staged[];  // ROWS x V vectors
  __shared__ float roots[ROWS][4];
  __shared__ float rstd_s[ROWS];

  const int i = static_cast<int>(threadIdx.x) % G;
  const int rb = static_cast<int>(threadIdx.x) / G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS + rb;
  const bool active = row < p.rows;
  if constexpr (G == 32) {
    if (!active) return;  // whole warp
  }
  const int V = p.v;
  const int sweeps = (V + kAtenThreads - 1) / kAtenThreads;
  uint2* sx = staged + static_cast<int64_t>(rb) * V;
  if (active) {
    const uint2* gx = reinterpret_cast<const uint2*>(row_ptr(p, row));
    for (int k = 0; k < sweeps; ++k) {
#pragma unroll
      for (int j = 0; j < A; j += STEP) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) cp_async(sx + vi, gx + vi, PAIRED);
      }
    }
  }
  cp_async_wait_all();

  float s[A];
#pragma unroll
  for (int j = 0; j < A; ++j) s[j] = 0.f;
  if (active) {
    for (int k = 0; k < sweeps; ++k) {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) {
          const uint2 w = sx[vi];
          s[j] = rms_push_vec4(s[j], num::bf16_lo(w.x), num::bf16_hi(w.x), num::bf16_lo(w.y), num::bf16_hi(w.y));
        }
      }
    }
  }
  rms_map_tree<Map>(s);
#pragma unroll
  for (int j = 0; j < A; ++j) {
    const int t = Map::aten_thread(i, j);
    if (t % kAtenWarp == 0) roots[rb][t / kAtenWarp] = s[j];
  }
  row_sync<G>();
  if (i == 0) rstd_s[rb] = rms_finalize_roots(roots[rb], p.n, p.eps, p.inv_n_pow2);
  row_sync<G>();
  if (!active) return;
  const float rstd = rstd_s[rb];
  uint2* orow = reinterpret_cast<uint2*>(p.out + row * p.n);
  const uint2* wv = reinterpret_cast<const uint2*>(p.w);
  for (int k = 0; k < sweeps; ++k) {
#pragma unroll
    for (int j = 0; j < A; ++j) {
      const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
      if (vi < V) {
        const uint2 xw = sx[vi];
        const uint2 ww = p.has_w ? wv[vi] : make_uint2(0, 0);
        orow[vi] = make_uint2(rms_norm_pair(xw.x, rstd, p.has_w, ww.x), rms_norm_pair(xw.y, rstd, p.has_w, ww.y));
      }
    }
  }
}

// Rows of at most 128 elements (per-head QK norms): only aten's warp 0 holds data, so a row spans SPAN lanes of
// one of our warps, 32 (lane l is aten thread l, one 4-element vector) or 16 (lane u holds aten threads u and
// u + 16), and norm/head_rms_span.cuh reproduces aten's tree and its final combine with warps 1..3's +0 roots.
// Each warp takes R slots at once (a slot: one row per span) so enough loads are in flight. Default 16 lanes, 4
// slots; DIFUSE_RMS_ROWS_PER_WARP=2 (2 slots) and DIFUSE_RMS_LANES_PER_ROW=32 (rows 2, 4 or 8) for measurements:
// the same arithmetic per row.
template <int SPAN, int R, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS) rms_norm_small_rows(const Params p) {
  constexpr int K = 32 / SPAN;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % SPAN, seg = lane / SPAN;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int64_t r0 = warp * R * K;
  if (r0 >= p.rows) return;  // whole warp
  bool on[K];
#pragma unroll
  for (int j = 0; j < K; ++j) on[j] = u + SPAN * j < p.v;
  uint2 xw[R][K];
  float s[R];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + q * K + seg;
    const uint2* row = reinterpret_cast<const uint2*>(row_ptr(p, r < p.rows ? r : 0));
#pragma unroll
    for (int j = 0; j < K; ++j) xw[q][j] = (r < p.rows && on[j]) ? row[u + SPAN * j] : make_uint2(0, 0);
  }
#pragma unroll
  for (int q = 0; q < R; ++q) s[q] = rms_lane_sum<K>(xw[q]);
  rms_span_tree<SPAN, R>(s);
  uint2 ww[K];
#pragma unroll
  for (int j = 0; j < K; ++j)
    ww[j] = (p.has_w && on[j]) ? reinterpret_cast<const uint2*>(p.w)[u + SPAN * j] : make_uint2(0, 0);
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + q * K + seg;
    const float rstd = rms_head_rstd(rms_span_total<SPAN>(s[q]), p.n, p.eps, p.inv_n_pow2);
    if (r >= p.rows) continue;
    uint2* orow = reinterpret_cast<uint2*>(p.out + r * p.n);
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (on[j])
        orow[u + SPAN * j] = make_uint2(rms_norm_pair(xw[q][j].x, rstd, p.has_w, ww[j].x),
                                        rms_norm_pair(xw[q][j].y, rstd, p.has_w, ww[j].y));
  }
}

// STAGED per-head rows (DIFUSE_RMS_STAGED_HEADS=1, for measurement; exact at 132f46f, no faster): rows of 64 or 128
// elements (CHUNKS 8 or 16 copies of 16 bytes), 16-byte aligned. The block first copies its 64 rows into shared
// memory with cp.async, every copy in flight at once (16 KB at 128 elements), then runs rms_norm_small_rows'
// half-warp arithmetic (slots of two rows, one slot at a time) reading them from there: the same bits per row. At 32
// registers 8 blocks fit an SM (the default kernel: 57 registers, 4 blocks; ncu at e383706: 40.7 % achieved
// occupancy, DRAM 47 %, 3.27 waves), so twice the rows' bytes are in flight per SM, as the staged attention
// prologues gained over their per-row kernels (FLUX 58.8 -> 53.4 us).
constexpr int kStagedHeadRows = 64;

template <int CHUNKS>
__global__ void __launch_bounds__(256, 8) rms_norm_staged_heads(const Params p) {
  constexpr int SPAN = 16, K = 2, R = 4;  // 8 warps x 4 slots x 2 rows: the block's 64 rows
  extern __shared__ uint4 rows16[];       // row rr of the block at 16-byte chunk CHUNKS * rr
  const int64_t r_first = static_cast<int64_t>(blockIdx.x) * kStagedHeadRows;
  const int nrows = static_cast<int>(p.rows - r_first < kStagedHeadRows ? p.rows - r_first : kStagedHeadRows);
  stage_block_rows<CHUNKS, 256>(rows16, nrows, [&](int rr) { return row_ptr(p, r_first + rr); });
  cp_async_wait_all();
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % SPAN, seg = lane / SPAN;
  const int r0 = static_cast<int>(threadIdx.x / 32) * R * K;  // the warp's first row in the block
  if (r0 >= nrows) return;                                     // whole warp (no barrier follows)
  bool on[K];
  uint2 ww[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    on[j] = u + SPAN * j < p.v;
    ww[j] = (p.has_w && on[j]) ? reinterpret_cast<const uint2*>(p.w)[u + SPAN * j] : make_uint2(0, 0);
  }
  // One slot at a time: the rows are in shared memory, so nothing is gained by holding several (32 registers).
#pragma unroll 1
  for (int q = 0; q < R; ++q) {
    const int rr = r0 + q * K + seg;
    const uint2* row = reinterpret_cast<const uint2*>(rows16 + CHUNKS * (rr < nrows ? rr : 0));
    uint2 xw[1][K];
#pragma unroll
    for (int j = 0; j < K; ++j) xw[0][j] = (rr < nrows && on[j]) ? row[u + SPAN * j] : make_uint2(0, 0);
    float sum[1] = {rms_lane_sum<K>(xw[0])};
    rms_span_tree<SPAN, 1>(sum);  // every lane of the warp takes part (rows past nrows carry zeros)
    const float rstd = rms_head_rstd(rms_span_total<SPAN>(sum[0]), p.n, p.eps, p.inv_n_pow2);
    if (rr >= nrows) continue;
    uint2* orow = reinterpret_cast<uint2*>(p.out + (r_first + rr) * p.n);
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (on[j])
        orow[u + SPAN * j] = make_uint2(rms_norm_pair(xw[0][j].x, rstd, p.has_w, ww[j].x),
                                        rms_norm_pair(xw[0][j].y, rstd, p.has_w, ww[j].y));
  }
}

template <int CHUNKS>
void launch_staged_heads(const Params& p, int device, cudaStream_t stream) {
  const int64_t blocks = (p.rows + kStagedHeadRows - 1) / kStagedHeadRows;  // 8 blocks of 16 KB per SM at 128
  launch_max_shared<rms_norm_staged_heads<CHUNKS>>(p, static_cast<unsigned>(blocks), 256,
                                                   sizeof(uint4) * CHUNKS * kStagedHeadRows, device, stream);
}

template <int SPAN, int R, int MIN_BLOCKS>
void launch_small_rows(const Params& p, cudaStream_t stream) {
  const int64_t warps = (p.rows + R * (32 / SPAN) - 1) / (R * (32 / SPAN));
  rms_norm_small_rows<SPAN, R, MIN_BLOCKS><<<static_cast<unsigned>((warps + 7) / 8), 256, 0, stream>>>(p);
}

// Rows wider than 128 (the default; the staged kernels above only through DIFUSE_RMS_STAGED_ROWS=1): aten's own
// layout, two passes over global memory.
// BATCHED (the default for N >= 4096 since the twelfth session; DIFUSE_RMS_STREAM_BATCH=1 every width, =0 none): the
// output pass loads kStreamBatch vectors' x and weight before any of their stores. Without it each iteration's
// loads wait for the previous iteration's store (sass-loops.sh: 3 global load batches behind a store in each pass-2
// loop), so a 1536-element row's pass 2 takes 3 round trips to L1/L2 in turn, a 5120-element row's 10. The
// arithmetic per element is the same. rms_norm_stream<false> is the kernel that ran at 0385466, PTX for PTX
// (scripts/ptx-diff.sh 0385466). Both exact on the H200 at 94cceb5 (test_batched_stream_variant and this op's
// tests, gpu-tests-94cceb5.json).
constexpr int kStreamBatch = 4;
constexpr int64_t kStreamBatchMinWidth = 4096;
template <bool BATCHED = false>
__global__ void __launch_bounds__(128) rms_norm_stream(const Params p) {
  __shared__ float roots[4];
  __shared__ float rstd_s;
  const int t = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const uint2* gx = reinterpret_cast<const uint2*>(row_ptr(p, row));
  float s = 0.f;
  for (int vi = t; vi < p.v; vi += kAtenThreads) {
    const uint2 w = gx[vi];
    s = rms_push_vec4(s, num::bf16_lo(w.x), num::bf16_hi(w.x), num::bf16_lo(w.y), num::bf16_hi(w.y));
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) s = rms_combine(s, __shfl_down_sync(0xffffffffu, s, o));
  if (t % kAtenWarp == 0) roots[t / kAtenWarp] = s;
  __syncthreads();
  if (t == 0) rstd_s = rms_finalize_roots(roots, p.n, p.eps, p.inv_n_pow2);
  __syncthreads();
  const float rstd = rstd_s;
  uint2* orow = reinterpret_cast<uint2*>(p.out + row * p.n);
  const uint2* wv = reinterpret_cast<const uint2*>(p.w);
  if constexpr (BATCHED) {
    for (int v0 = t; v0 < p.v; v0 += kAtenThreads * kStreamBatch) {
      uint2 xw[kStreamBatch], ww[kStreamBatch];
#pragma unroll
      for (int u = 0; u < kStreamBatch; ++u) {
        const int vi = v0 + kAtenThreads * u;
        xw[u] = vi < p.v ? gx[vi] : make_uint2(0, 0);
        ww[u] = vi < p.v && p.has_w ? wv[vi] : make_uint2(0, 0);
      }
#pragma unroll
      for (int u = 0; u < kStreamBatch; ++u) {
        const int vi = v0 + kAtenThreads * u;
        if (vi < p.v)
          orow[vi] = make_uint2(rms_norm_pair(xw[u].x, rstd, p.has_w, ww[u].x),
                                rms_norm_pair(xw[u].y, rstd, p.has_w, ww[u].y));
      }
    }
  } else {
    for (int vi = t; vi < p.v; vi += kAtenThreads) {
      const uint2 xw = gx[vi];
      const uint2 ww = p.has_w ? wv[vi] : make_uint2(0, 0);
      orow[vi] = make_uint2(rms_norm_pair(xw.x, rstd, p.has_w, ww.x), rms_norm_pair(xw.y, rstd, p.has_w, ww.y));
    }
  }
}

// STREAMED (DIFUSE_RMS_STREAMED=G, for measurement; nineteenth session): the streamed row schedule of the LayerNorms
// and rms_norm_modulate (norm/stream_rows.cuh) for rows wider than 128, N % 8 == 0, x's rows and out 16-byte
// aligned: one block per SM, a producer lane bulk-copying each row into a ring of shared-memory slots, G consumer
// warps each computing whole rows from their slot on aten's paired thread map at one warp per row
// (AtenThreadMap<32, true>: a lane holds aten threads 2i, 2i + 1, 2i + 64, 2i + 65, one 16-byte vector per pair and
// sweep), the weight row copied into shared memory once per block. Per aten thread the same pushes in the same order
// (s = fma(v, v, s)), aten's shuffle tree through the map (rms_norm_rows' loop), the four warp roots (aten threads 0,
// 32, 64, 96: lanes 0 and 16, slots 0 and 2) read by every lane with a shuffle and combined as rms_finalize_roots
// does, then the output pass from the slot: the same bits as rms_norm_stream, whatever the grid. Why: the default
// (aten's one 128-thread block per row, two passes over global memory) runs 1x32760x1536 in 62.3 us against a 50.4
// streaming ceiling (ops.json at 79a9492; site bound 59.1), 1x32760x5120 in 173.2 against 159.6; the LayerNorms'
// streamed rows beat their per-row kernels at these shapes (layernorm_modulate 1x32760x1536 65.2 vs 80.4).
// Predicted ~55 and ~166 us. Measured at f8154c5 (knob-sweeps/f8154c5/, against the default of the same run): no
// faster, 62.3 vs 62.4 us at 1x32760x1536 and 174.9 vs 174.0 at 1x32760x5120, with 16 or 28 warps alike (62.4,
// 62.2); the prediction assumed the ring would run these rows at the LayerNorms' streamed rate, and their own
// narrow rows are no nearer the ceiling (layernorm_modulate 1x32760x1536 65.2 us). Exact on the H200 at f8154c5
// (test_streamed_variant, gpu-tests-f8154c5.json), memcheck and racecheck clean (sanitizer-rms-streamed-f8154c5.txt).
// Kept for measurement, not the default then. DIFUSE_RMS_STREAMED_BLOCKS=N caps the grid (tests: many rows per block).
// Twenty-second session, one run each at 9a34777 (knob-sweeps/9a34777/, the same machine and rotation; the default
// was not in that run, 62.3 in ops.json): at 1x32760x1536 with DIFUSE_STREAM_PRODUCER_LANES=1 / 4 / 8: 70.8 / 60.4 /
// 58.5 us (site bound 59.1). The one-lane figure is 9 us above 918066b's 61.7 for the same knob (that run's copy_us
// 53.8 against 53.3): not explained by the code (the one-lane producer's path is unchanged but for the two `full`
// barriers and the lanes' branch beside it) and not yet measured again. 9a34777's multi-lane producer was replaced
// at 45a2975 (each lane waits on every fill of its step); measured again at b9178f7: STREAMED_DEFAULT below.
//
// STREAMED_DEFAULT (twenty-third session): the streamed rows with 8 producer lanes become the default for rows of
// 136..2048 elements (N % 8 == 0, 16-byte aligned rows and out) where there are at least 8192 rows: Wan 1.3B's
// across-heads QK norm, 1x32760x1536 (site bound 59.1 us; aten's two-pass layout 62.3 in ops.json at 79a9492). Why:
// at 9a34777 the streamed rows ran it in 58.5 us with 8 lanes (70.8 with 1, 60.4 with 4): the one lane's dependent
// chain (empty wait, arrival, the row's address, the ELECT-loop copy) has to issue a row every ~0.25 us per block
// there, and 8 lanes issue 8 rows per step. Predicted ~58.5 us at HEAD (45a2975's lanes wait on every fill of their
// step: 8 barrier tests per lane and step, a few instructions each). Width 5120 keeps aten's layout (173.2 us, bound
// 196.8; the streamed rows 174.9 with one lane at f8154c5). Rows under 8192 are not measured: they keep aten's
// layout. Measured at b9178f7 (knob-sweeps/b9178f7/, two alternating runs each on one machine): 57.2 / 57.0 us as the
// default against 63.0 / 63.0 through DIFUSE_RMS_STREAMED=0 (aten's layout) and 64.1 / 64.2 with one lane, 61.3 with
// 4; ops.json at b9178f7: 56.3 us (bound 59.1, met). At 1x32760x5120 the streamed rows with 8 lanes stay slower
// (179.3 / 179.1 against 175.6 / 176.4), so 5120 keeps aten's layout.
// By the device (forty-third session): only where DRAM outpaces the SMs (detail::dram_outpaces_sms, 15.5 bytes per
// SM cycle; the H200 18.42, 94 of an H100's SMs 18.01). On a whole H100 SXM (12.83) the streamed rows ran
// 1x32760x1536 in 81.2 / 81.3 us against aten's layout's 76.4 / 76.4 and eager's 77.2 (485a376, two alternated
// rounds, bench/results/h100/rms-norm-streamed-485a376/), so there aten's layout is the default. The rule is host
// dispatch between two kernels that both ran exact at these shapes (test_streamed_default's two runs); the rule and
// the GPU tests' device-dependent form are CPU-checked only so far (no device time was left at ffb676e).
constexpr int kRmsStreamDefaultLanes = 8;
constexpr int64_t kRmsStreamDefaultMaxWidth = 2048;
constexpr int64_t kRmsStreamDefaultMinRows = 8192;
constexpr int kRmsStreamMaxWarps = 28;  // 32 + 32 x 28 = 928 threads
constexpr int kRmsStreamDefaultWarps = 24;
constexpr int kRmsStreamMaxSlots = 48;

// BULK_OUT (DIFUSE_RMS_STREAMED_BULK_OUT=1, for measurement; twentieth session): each lane writes its output vectors
// back over the ones it read in the slot, fences the async proxy, and lane 0 stores the row with one bulk copy and
// waits for its reads of the slot before the warp releases it, instead of 16-byte stores from registers. Why: the
// probe's ring variants (src/probe/stream_copy.cu) compare the two ways of storing a streamed row without arithmetic.
// Exact at 9da6d1b (test_streamed_variant's bulk cases, gpu-tests-9da6d1b.json); no faster: 62.5 vs 62.0 us at
// 1x32760x1536 (knob-sweeps/9da6d1b/), as the probe's ring3072_w24_bulk 58.5 vs ring3072_w24_stg 58.0.
template <bool BULK_OUT>
//
// row_stride (twenty-second session): where one stride places every row of x (RowIndexer::uniform_stride: contiguous
// x, the chunks of a fused projection), the producer forms row r's address as x + r * row_stride instead of through
// RowIndexer's two index divisions; -1 elsewhere. Why: the one-lane producer's loop is 188 SASS instructions at
// 97817d7 against 163 at 918066b and ran 70.8 us against 61.7 at 1x32760x1536 (bench/results/h200/NOTES.md,
// twenty-second session), where a block must issue a row every ~0.25 us. Written after the session's device time
// ran out: not yet measured or run on the H200 (predicted: the one-lane figure back near 62 us if the producer's
// chain is the limit; its uniform path skips the two magic-number divisions and their 64-bit multiply-adds, about 25 of
// the loop's SASS instructions by a count by hand of scripts/sass-loops.sh's output, not a measurement). The
// same address either way, so the same bits; test_rms_norm.py's strided-rows script gains a transposed view (no
// one stride) so the streamed knob tests still reach the RowIndexer path. CPU test of uniform_stride:
// tests/cpu/test_fast_div.cpp.
// GRAB (DIFUSE_STREAM_GRAB, for measurement; twenty-first session): with a counter, the producer takes its rows from
// it (stream_produce_grabbed) and publishes each slot's row in slot_row; the consumers read their row there and stop
// at the end mark. Without one, the strided rows as before, issued by producer_lanes lanes (kRmsStreamDefaultLanes,
// or DIFUSE_STREAM_PRODUCER_LANES). full_barriers: the ring's `full` mbarriers per slot (stream_full_barriers_for: 2;
// 1 under DIFUSE_STREAM_FULL_BARRIERS=1 where the 48 slots are a multiple of the warps; GPU tests pass at 5d3eadf).
__global__ void __launch_bounds__(32 + 32 * kRmsStreamMaxWarps, 1)
    rms_norm_streamed(const Params p, int slots, bool read_fence, StreamGrabCounter* counter, StreamGrab grab,
                      int producer_lanes, int full_barriers, int64_t row_stride) {
  using Map = AtenThreadMap<32, true>;
  constexpr int A = Map::kSlots;  // 4
  extern __shared__ uint4 stream_smem[];  // the weight row (V 8-byte words, where there is one), then the ring
  __shared__ uint64_t full[2 * kRmsStreamMaxSlots], empty[kRmsStreamMaxSlots];
  __shared__ int64_t slot_row[kRmsStreamMaxSlots];
  const int tid = static_cast<int>(threadIdx.x);
  const int V = p.v;
  const int sweeps = (V + kAtenThreads - 1) / kAtenThreads;
  const uint32_t row_bytes = static_cast<uint32_t>(p.n) * 2u;
  uint2* const wsm = reinterpret_cast<uint2*>(stream_smem);
  uint2* const ring = wsm + (p.has_w ? V : 0);  // V is even: the ring stays 16-byte aligned
  stream_init_barriers(full, empty, slots, 32);   // the only block barrier
  const int groups = static_cast<int>(blockDim.x) / 32 - 1;
  if (tid < 32) {                                 // the producer warp
    const auto issue = [&](int64_t row, int s, uint64_t* bar) {
      detail::mbar_arrive_expect_tx(bar, row_bytes);
      const uint16_t* const src = row_stride >= 0 ? p.x + row * row_stride : row_ptr(p, row);
      detail::bulk_load(ring + static_cast<int64_t>(s) * V, src, row_bytes, bar);
    };
    if (counter != nullptr) {
      if (tid == 0) stream_produce_grabbed(p.rows, grab, slots, groups, full, empty, full_barriers, slot_row, counter,
                                          issue);
    } else if (tid < producer_lanes) {
      stream_produce(p.rows, slots, full, empty, full_barriers, issue, producer_lanes);
    }
    return;
  }
  const int c = tid / 32 - 1, i = tid % 32;
  if (p.has_w) {  // the consumers copy the weight row while the producer's first copies fly
    for (int t = tid - 32; t < V; t += 32 * groups) cp_async(wsm + t, p.w + 4 * t, false);
    cp_async_wait_all();
    asm volatile("bar.sync 15, %0;" ::"r"(32 * groups) : "memory");
  }
  const int64_t stride = gridDim.x;
  int s = c % slots;
  uint32_t use = static_cast<uint32_t>(c / slots);
  for (int64_t row = blockIdx.x + c * stride; counter != nullptr || row < p.rows; row += groups * stride) {
    stream_wait_full(full, s, use, full_barriers);
    if (counter != nullptr && (row = slot_row[s]) < 0) break;  // the producer's end mark
    uint2* const sx = ring + static_cast<int64_t>(s) * V;
    float acc[A];
#pragma unroll
    for (int j = 0; j < A; ++j) acc[j] = 0.f;
    for (int k = 0; k < sweeps; ++k) {
#pragma unroll
      for (int jp = 0; jp < A; jp += 2) {  // slots jp, jp + 1: aten threads t, t + 1, vectors vi, vi + 1
        const int vi = Map::aten_thread(i, jp) + kAtenThreads * k;
        if (vi < V) {
          const uint4 w4 = *reinterpret_cast<const uint4*>(sx + vi);
          acc[jp] = rms_push_vec4(acc[jp], num::bf16_lo(w4.x), num::bf16_hi(w4.x), num::bf16_lo(w4.y),
                                  num::bf16_hi(w4.y));
          acc[jp + 1] = rms_push_vec4(acc[jp + 1], num::bf16_lo(w4.z), num::bf16_hi(w4.z), num::bf16_lo(w4.w),
                                      num::bf16_hi(w4.w));
        }
      }
    }
    rms_map_tree<Map>(acc);
    float roots[4];  // aten threads 0, 32, 64, 96
    roots[0] = __shfl_sync(0xffffffffu, acc[0], 0);
    roots[1] = __shfl_sync(0xffffffffu, acc[0], 16);
    roots[2] = __shfl_sync(0xffffffffu, acc[2], 0);
    roots[3] = __shfl_sync(0xffffffffu, acc[2], 16);
    const float rstd = rms_finalize_roots(roots, p.n, p.eps, p.inv_n_pow2);
    uint4* const orow = reinterpret_cast<uint4*>(p.out + row * p.n);
    for (int k = 0; k < sweeps; ++k) {
#pragma unroll
      for (int jp = 0; jp < A; jp += 2) {
        const int vi = Map::aten_thread(i, jp) + kAtenThreads * k;
        if (vi < V) {
          const uint4 w4 = *reinterpret_cast<const uint4*>(sx + vi);
          const uint4 ww = p.has_w ? *reinterpret_cast<const uint4*>(wsm + vi) : make_uint4(0, 0, 0, 0);
          const uint4 o = make_uint4(rms_norm_pair(w4.x, rstd, p.has_w, ww.x), rms_norm_pair(w4.y, rstd, p.has_w, ww.y),
                                     rms_norm_pair(w4.z, rstd, p.has_w, ww.z), rms_norm_pair(w4.w, rstd, p.has_w, ww.w));
          if constexpr (BULK_OUT)
            *reinterpret_cast<uint4*>(sx + vi) = o;  // over the vector this lane just read
          else
            orow[vi / 2] = o;
        }
      }
    }
    if constexpr (BULK_OUT) {
      detail::fence_proxy_async_smem();  // this lane's writes of the slot before the copy engine reads them
      __syncwarp();
      if (i == 0) {
        detail::bulk_store(p.out + row * p.n, sx, row_bytes);
        detail::bulk_commit();
        detail::bulk_wait_reads();  // the slot read out before it is released
      }
      __syncwarp();
      stream_release(empty, s, use, groups, slots, false);  // fenced above; the copy engine's reads are done
    } else {
      stream_release(empty, s, use, groups, slots, read_fence);  // the slot was only read
    }
  }
}

// Launches rms_norm_streamed with `knob` consumer warps (1: kRmsStreamDefaultWarps; at most kRmsStreamMaxWarps and
// the ring's slots); false (nothing launched) where the ring would hold fewer than two rows.
bool launch_streamed(const Params& p, int knob, int device, cudaStream_t stream) {
  static const bool bulk_out = detail::positive_env_knob("DIFUSE_RMS_STREAMED_BULK_OUT") == 1;
  auto kernel = bulk_out ? rms_norm_streamed<true> : rms_norm_streamed<false>;
  static std::atomic<int> budgets[detail::kMaxDevices];
  static std::atomic<uint64_t> opted_in{0}, carveout_set{0};
  const int budget = stream_smem_budget(kernel, device, budgets);
  const int64_t slot_bytes = int64_t{2} * p.n;
  const int64_t w_bytes = p.has_w ? slot_bytes : 0;
  static const int max_blocks = detail::positive_env_knob("DIFUSE_RMS_STREAMED_BLOCKS");
  const StreamWarpLaunch l = stream_warp_launch(budget, w_bytes, slot_bytes, kRmsStreamMaxSlots, knob,
                                                kRmsStreamDefaultWarps, kRmsStreamMaxWarps, p.rows, device, max_blocks);
  if (!l.ok()) return false;
  opt_in_shared_memory(kernel, device, budget, opted_in);
  prefer_max_shared_carveout(kernel, device, carveout_set);
  const StreamGrab grab = stream_grab_knob();
  StreamGrabCounter* const counter = grab.first > 0 ? detail::grab_counter(device, stream) : nullptr;
  kernel<<<static_cast<unsigned>(l.blocks), l.threads(), static_cast<size_t>(l.slots * slot_bytes + w_bytes), stream>>>(
      p, l.slots, stream_read_fence_knob(), counter, grab,
      stream_producer_lanes(stream_producer_lanes_knob(kRmsStreamDefaultLanes), l.slots, l.warps),
      stream_full_barriers_for(l.slots, l.warps), p.rows_of.uniform_stride(p.rows));
  return true;
}

template <int G, bool PAIRED>
void launch_rows(const Params& p, int device, cudaStream_t stream) {
  constexpr int ROWS = rows_per_block(G);
  auto kernel = rms_norm_rows<G, PAIRED>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, device, 64 * 1024, opted_in);
  const int64_t blocks = (p.rows + ROWS - 1) / ROWS;
  const size_t smem = static_cast<size_t>(ROWS) * p.v * sizeof(uint2);  // <= 48 KB by the thresholds below
  kernel<<<static_cast<unsigned>(blocks), G * ROWS, smem, stream>>>(p);
}

using detail::rows_aligned;

}  // namespace

detail::Support can_use_rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                 const difuse_tensor_view& weight, double eps) {
  (void)eps;
  detail::Support s;
  if (!detail::require_bf16_row_view(s, x, "x")) return s;
  const int64_t N = x.sizes[x.rank - 1];
  const int64_t rows = detail::numel(x) / (N ? N : 1);
  const bool empty = detail::numel(x) == 0;
  DIFUSE_REQUIRE(s, N % 4 == 0, "the normalized width must be a multiple of 4 (aten's vectorized RMSNorm), got " +
                                    std::to_string(N));
  DIFUSE_REQUIRE(s, N <= (int64_t{1} << 24), "the normalized width must be at most 2^24, got " + std::to_string(N));
  DIFUSE_REQUIRE(s, rows <= int64_t{2147483647}, "at most 2^31 - 1 rows (aten's grid limit), got " + std::to_string(rows));
  if (!empty) {
    if (detail::is_contiguous(x))
      DIFUSE_REQUIRE(s, detail::aligned(x.data, 8),
                     "a contiguous x must be 8-byte aligned (a misaligned x takes aten's two-kernel RMSNorm, which "
                     "rounds differently)");
    else
      DIFUSE_REQUIRE(s, rows_aligned(x, 8),
                     "a strided x needs 8-byte aligned rows (data pointer and leading strides multiples of 4 "
                     "elements), got " + detail::describe(x));
  }
  if (weight.data != nullptr || weight.rank != 0) {
    DIFUSE_REQUIRE(s, weight.dtype == DIFUSE_BF16,
                   std::string("weight must be bf16 like x (another dtype takes aten's composite RMSNorm), got ") +
                       difuse_dtype_name(weight.dtype));
    DIFUSE_REQUIRE(s, weight.rank == 1 && weight.sizes[0] == N && (weight.strides[0] == 1 || N <= 1),
                   "weight must be a contiguous [" + std::to_string(N) + "], got " + detail::describe(weight));
    DIFUSE_REQUIRE(s, weight.device == x.device, "weight must be on the device of x, got " + detail::describe(weight));
    if (!empty)
      DIFUSE_REQUIRE(s, weight.data != nullptr && detail::aligned(weight.data, 8),
                     "weight must be 8-byte aligned (aten vectorizes only then)");
  }
  if (!empty) DIFUSE_REQUIRE(s, x.data != nullptr, "x has a null data pointer");
  detail::require_bf16_output(s, out, x, "x", {&x, &weight});
  return s;
}

namespace {
int staged_rows_knob() {
  static const int v = detail::positive_env_knob("DIFUSE_RMS_STAGED_ROWS");
  return v;
}
// DIFUSE_RMS_STREAMED: G > 0 the streamed rows with G warps wherever they can run, 0 never, unset (-1) the default
// (STREAMED_DEFAULT).
int streamed_knob() {
  static const int v = detail::env_knob_or("DIFUSE_RMS_STREAMED", -1);
  return v;
}
}  // namespace

bool rms_norm_streamed_by_default(int64_t n, int64_t rows, int knob, double dram_bytes_per_sm_cycle) {
  if (knob >= 0) return knob > 0;
  return n > 128 && n <= kRmsStreamDefaultMaxWidth && rows >= kRmsStreamDefaultMinRows &&
         detail::dram_outpaces_sms(dram_bytes_per_sm_cycle);
}

void rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight, double eps,
              cudaStream_t stream) {
  const detail::Support s = can_use_rms_norm(out, x, weight, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm"));
  if (detail::numel(x) == 0) return;
  Params p{};
  static_cast<detail::BF16RowsIO&>(p) = detail::bf16_rows_io(out, x, weight);
  p.v = p.n / 4;
  p.eps = static_cast<float>(eps);
  const detail::DeviceGuard device_guard(x.device);
  const int64_t sweeps = (p.v + kAtenThreads - 1) / kAtenThreads;
  const bool paired = p.n % 8 == 0 && rows_aligned(x, 16) && detail::aligned(out.data, 16);
  if (p.v <= 32) {
    static const int knob = detail::positive_env_knob("DIFUSE_RMS_ROWS_PER_WARP");
    static const int lanes = detail::positive_env_knob("DIFUSE_RMS_LANES_PER_ROW");
    // Default: half a warp per row, 4 slots of two rows per warp (DIFUSE_RMS_ROWS_PER_WARP=2: 2 slots). H200,
    // 1x4608x24x128 weight at 5fa0c2a (knob-sweeps/): 16 lanes 4 slots 18.7 us, 2 slots 19.0, full warp 4 rows
    // 20.2; at 6408223 full warp 2 rows 19.7, 8 rows 19.2. DIFUSE_RMS_LANES_PER_ROW=32 (for measurement): a warp
    // per row, DIFUSE_RMS_ROWS_PER_WARP rows (default 4).
    static const int staged_heads = detail::positive_env_knob("DIFUSE_RMS_STAGED_HEADS");
    if (staged_heads == 1 && lanes != 32 && knob == 0 && (p.n == 64 || p.n == 128) && rows_aligned(x, 16))
      p.n == 128 ? launch_staged_heads<16>(p, x.device, stream) : launch_staged_heads<8>(p, x.device, stream);
    else if (lanes != 32)
      knob == 2 ? launch_small_rows<16, 2, 1>(p, stream) : launch_small_rows<16, 4, 1>(p, stream);
    else if (knob >= 8)
      launch_small_rows<32, 8, 3>(p, stream);
    else if (knob == 2)
      launch_small_rows<32, 2, 1>(p, stream);
    else
      launch_small_rows<32, 4, 1>(p, stream);
  } else if (rms_norm_streamed_by_default(p.n, p.rows, streamed_knob(), detail::dram_bytes_per_sm_cycle(x.device)) &&
             p.n % 8 == 0 && rows_aligned(x, 16) &&
             detail::aligned(out.data, 16) &&
             launch_streamed(p, std::max(streamed_knob(), 1), x.device, stream)) {
    // The streamed rows (rms_norm_streamed) by default at STREAMED_DEFAULT's shapes, or wherever they can run under
    // DIFUSE_RMS_STREAMED=G
  } else if (staged_rows_knob() != 1 || sweeps > 48) {
    // aten's own two-pass layout at every width above 128 (the default). H200 at 5fa0c2a (knob-sweeps/):
    // 1x32760x5120 177.8 us vs 259.6 for the staged kernels (eager 204.5), 1x32760x1536 62.5 vs 80.3 (eager 64.1).
    // DIFUSE_RMS_STAGED_ROWS=1 (for measurement) keeps the staged register-resident kernels below 48 sweeps.
    // The batched output pass (BATCHED above) for rows of >= 4096 elements, the default since the twelfth session.
    // H200 at 94cceb5 (knob-sweeps/94cceb5/, DIFUSE_RMS_STREAM_BATCH=1 against ops.json of the same run):
    // 1x32760x5120 174.7 us vs 178.1 (predicted ~170), but 1x32760x1536 70.0 vs 62.6 (predicted ~58): 38 registers
    // instead of 28 cost a quarter of the resident blocks, which a 3-vector row's one round trip saved does not buy
    // back. As the default at edec152: 173.3 vs 181.8 through =0 (knob-sweeps/edec152/); 179.1 at c14c296. The gain
    // (3-8 us, 2-5 %) is about the run-to-run spread. Exact at 94cceb5 and edec152 (test_batched_stream_variant[0|1]).
    // DIFUSE_RMS_STREAM_BATCH=1 (for measurement) batches every width, =0 none.
    static const int batched_knob = detail::env_knob_or("DIFUSE_RMS_STREAM_BATCH", -1);
    const bool batched = batched_knob == 1 || (batched_knob != 0 && p.n >= kStreamBatchMinWidth);
    if (batched)
      rms_norm_stream<true><<<static_cast<unsigned>(p.rows), 128, 0, stream>>>(p);
    else
      rms_norm_stream<<<static_cast<unsigned>(p.rows), 128, 0, stream>>>(p);
  } else if (sweeps <= 12) {
    paired ? launch_rows<64, true>(p, x.device, stream) : launch_rows<64, false>(p, x.device, stream);
  } else {
    launch_rows<128, false>(p, x.device, stream);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::norm
