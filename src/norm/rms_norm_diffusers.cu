// rms_norm_diffusers — diffusers.models.normalization.RMSNorm's forward, bit-exact against eager PyTorch.
//
// Eager chain reproduced (Qwen-Image QK norms and txt_norm, SD3.5 QK norms on BHSD views), bf16 x:
//     var = x.float().pow(2).mean(-1, keepdim=True)       copy, pow (RN(x*x)), Reduce.cuh mean
//     y   = x * torch.rsqrt(var + eps)                     RN(var + eps), rsqrtf, bf16 * fp32 -> fp32 RN
//     out = y.to(bf16) * weight     (weight bf16)          two bf16 roundings
//     out = y.to(bf16)              (no weight)
// Replays: torch 2.11.0+cu130 reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float, float, float>, ...,
// vt0 = 4, input_vec_size = 4>> (shared/reference/torch-2.11-numerics.md §3) for the configurations where
// its block is (32, 16): one warp per output row, lane x takes vectors x, x + 32, ... into four accumulators
// (N >= 128, vectorized) or elements x + 32 i in groups of four (32 <= N < 128), accumulators combined
// ((a0 + a1) + a2) + a3, a shuffle-down tree 16..1, mean = RN(sum * factor) with factor = (float)rows /
// (float)numel as aten forms it on the host (not a division by N). Our schedules: 64-element rows on half warps
// (span lane u holds elements u, u + 16, u + 32, u + 48), 128-element rows on half warps (4 per warp behind
// DIFUSE_RMSD_LANES_PER_ROW=32), other widths one warp per row; each replays the same order.
//
// Guards (can_use_rms_norm_diffusers; every violation is reported): x bf16 on a CUDA device, rank 1-4,
// last dim contiguous; rows >= 16 and 32 <= N <= 8160 (aten's block is then (32, 16) and each warp owns a row:
// ReduceConfig splits a row across the block's warps once ceil(N / 32) >= min(16 * 16, 256), i.e. N > 8160, counting
// elements, not the float4 vectors; the H200 showed 67 differing elements at N = 8184; other configurations are
// not replayed); N % 4 == 0 when N >= 128 (a vectorized
// mean over misaligned fp32 rows starts with an alignment head, not replayed); rows * N < 2^31; x rows
// 8-byte aligned when N % 4 == 0; weight (optional) bf16 [N] contiguous; out contiguous bf16 of x's shape.
//
// Verification status: bit-exact on the H200 at 66f5a3b (torch 2.11.0+cu130, sm_90), incl. the vector output pass
// (4-element loads and stores where the mean is vectorized), 64-element rows on half warps (the default; 2x24x4096x64
// 50.0 -> 24.0 us, first exact at 21fe4f5 through its knob) and the 1/2/4-rows-per-warp kernels for 128-element
// rows (1x4608x24x128: 30.9 us with one row per warp at 6408223, 22.2 with 4 at 66f5a3b):
// tests/gpu/test_rms_norm_diffusers.py (240 cases; N = 8184 failed at 1bfced1 and is now refused: see the guard), 0
// failed, 0 skipped (bench/results/h200/tests.json). The half-warp kernel for 128-element rows ran there behind
// DIFUSE_RMSD_LANES_PER_ROW=16 (test_half_warp_rows; bench 0 mismatches, knob-sweeps/: 20.7 us) and became the
// default after that run; this file's tests passed with it at bc88af7 (tests-defaults-bc88af7.json; 19.6 us).
// All 240 passed again at 5f8295d (tests.json). At 1765206 the half-warp kernels' means leave out their +0 additions
// (norm::mean_first_push_*, mean_lane_total_first_two in diffusers_head_norm.h: the same bits for every input,
// tests/cpu/test_rms_norm_modulate.cpp), 17-35 PTX instructions fewer: bench at 1765206 0 mismatches
// (ops-prologues-1765206.json: 1x4608x24x128 19.9 us, 2x24x4096x64 23.1). After 1765206: the 128-element kernels round
// two elements at a time (norm::diffusers_rms_pair, the same bits, CPU-tested), 36-144 PTX instructions fewer; and
// 64- and 128-element rows staged in shared memory 64 per block (DIFUSE_RMSD_STAGED_ROWS=1, test_staged_rows_variant).
// All of it exact on the H200 at 132f46f (this file's 241 tests, tests.json); staged rows timed there (knob-sweeps/):
// 2x24x4096x64 20.4 us vs 23.0, 1x4608x24x128 19.6 vs 18.9. Staged 64-element rows are the default since eb1307d, where
// the file's 241 tests passed with them (gpu-tests-eb1307d.json; the per-row kernels through DIFUSE_RMSD_STAGED_ROWS=0
// in test_half_warp_rows) and compute-sanitizer was clean (sanitizer.log); 20.7 vs 23.5 us in one run there
// (knob-sweeps/eb1307d/). Issue target 16 us at 1x4608x24x128: not met (18.9-19.2; 19.2 at f1e1d95, ops.json).
// DIFUSE_RMSD_OUT_SMEM=1 (the staged 64-element rows written back to shared memory and copied out in 16-byte
// vectors; test_staged_rows_written_back_variant): exact on the H200 at 5d35cbc, no faster (2x24x4096x64 21.3 us vs
// 20.0 default, knob-sweeps/5d35cbc/); kept for measurement only. Wide rows (other widths than 64 and 128) staged in
// shared memory first (rms_norm_diffusers_wide_staged) are the default since 2cecf55: 1x512x3584 (Qwen-Image's
// txt_norm) 8.1 us against 16.8 for the per-row kernel in the same run (DIFUSE_RMSD_WIDE_STAGED=0,
// knob-sweeps/2cecf55/; 17.3 vs 8.3 through the knob at 5d35cbc), about a copy of the same bytes (8.4); target
// floor + 4 = 5.7: not met. Exact at 2cecf55 (test_wide_rows_staged_and_per_row, both kernels; this file's tests,
// gpu-tests-2cecf55.json), the native smoke test's 3584 and 8160 rows compute-sanitizer clean (sanitizer-2cecf55.txt).
// The per-row kernel runs diffusers_row<false>, the same arithmetic instruction for instruction as before (PTX 468
// -> 467: addressing).
#include "norm/rms_norm_diffusers.h"

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/registry.h"
#include "core/rows.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "norm/diffusers_head_norm.h"
#include "norm/row_staging.cuh"

namespace difuse::norm {

namespace {

const detail::KernelRegistration kRegistration{{
    "rms_norm_diffusers", "cuda", "bit_exact",
    "diffusers RMSNorm: bf16(bf16(x * rsqrt(mean(f32(x)^2) + eps)) * w)  (two roundings)",
    "verified bit-exact on H200 at eb1307d (torch 2.11.0+cu130, sm_90)", 90, 90,
    "the diffusers RMSNorm class chain, replaying aten's mean reduction order"}};

constexpr int kRowsPerBlock = 8;  // one warp per row

struct Params : detail::BF16RowsIO {
  float eps, factor;
  bool vectorized;
  bool vec_out;  // vectorized, and out (and the weight) 8-byte aligned: the output pass runs on 4-element vectors
};

__device__ __forceinline__ const uint16_t* row_ptr(const Params& p, int64_t r) { return p.x + p.rows_of.offset(r); }

__device__ __forceinline__ float sq(uint16_t b) {
  const float v = num::bf16_to_float(b);
  return num::mul_rn(v, v);  // .pow(2) in fp32
}

// One row on one warp in aten's order (the mean, then the output pass), its elements and the weight read from
// global memory (rms_norm_diffusers_kernel) or, STAGED, from the block's copies in shared memory at sx and sw
// (rms_norm_diffusers_wide_staged).
template <bool STAGED>
__device__ __forceinline__ void diffusers_row(const Params& p, int64_t row, int lane, const uint16_t* sx = nullptr,
                                              const uint16_t* sw = nullptr) {
  const uint16_t* xr = STAGED ? sx : row_ptr(p, row);
  const uint16_t* wr = STAGED ? sw : p.w;
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  uint2 first = make_uint2(0, 0);  // this lane's first vector, kept for the output pass
  if (p.vectorized) {  // input_vectorized_thread_reduce_impl: vl[k] += s[4v + k], v = lane, lane + 32, ...
    for (int v = lane; 4 * v + 3 < p.n; v += 32) {
      const uint2 w = reinterpret_cast<const uint2*>(xr)[v];
      if (v == lane) first = w;
      a[0] = num::add_rn(a[0], sq(static_cast<uint16_t>(w.x)));
      a[1] = num::add_rn(a[1], sq(static_cast<uint16_t>(w.x >> 16)));
      a[2] = num::add_rn(a[2], sq(static_cast<uint16_t>(w.y)));
      a[3] = num::add_rn(a[3], sq(static_cast<uint16_t>(w.y >> 16)));
    }
  } else {  // thread_reduce_impl, vt0 = 4: accumulator i takes idx + 32 i, in groups of 128, then the tail
    int idx = lane;
    for (; idx + 3 * 32 < p.n; idx += 4 * 32) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = num::add_rn(a[i], sq(xr[idx + 32 * i]));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (idx + 32 * i < p.n) a[i] = num::add_rn(a[i], sq(xr[idx + 32 * i]));
  }
  float s = num::add_rn(num::add_rn(num::add_rn(a[0], a[1]), a[2]), a[3]);
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) s = num::add_rn(s, __shfl_down_sync(0xffffffffu, s, o));
  const float mean = num::mul_rn(__shfl_sync(0xffffffffu, s, 0), p.factor);
  const float r = num::rsqrt_cuda(num::add_rn(mean, p.eps));
  uint16_t* orow = p.out + row * p.n;
  if (p.vec_out) {  // the same per-element arithmetic on whole vectors: 8-byte loads and stores
    for (int v = lane; 4 * v + 3 < p.n; v += 32) {
      const uint2 xv = v == lane ? first : reinterpret_cast<const uint2*>(xr)[v];
      const uint2 wv = p.has_w ? reinterpret_cast<const uint2*>(wr)[v] : make_uint2(0, 0);
      const HeadRun<4> y = diffusers_norm_run<4>(HeadRun<4>{{xv.x, xv.y}}, r, p.has_w, HeadRun<4>{{wv.x, wv.y}});
      reinterpret_cast<uint2*>(orow)[v] = make_uint2(y.w[0], y.w[1]);
    }
    return;
  }
  for (int c = lane; c < p.n; c += 32) {
    const float yb = num::round_bf16(num::mul_rn(num::bf16_to_float(xr[c]), r));  // bf16 * fp32 -> fp32, .to(bf16)
    orow[c] = num::float_to_bf16_rne(p.has_w ? num::mul_rn(yb, num::bf16_to_float(wr[c])) : yb);
  }
}

__global__ void __launch_bounds__(256) rms_norm_diffusers_kernel(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;  // whole warp
  diffusers_row<false>(p, row, lane);
}

// WIDE STAGED (the default since 2cecf55, DIFUSE_RMSD_WIDE_STAGED=0 keeps the per-row kernel; vectorized rows with the vector output pass, N >= 128,
// outside the 64- and 128-element kernels: Qwen-Image's txt_norm at 3584): rms_norm_diffusers_kernel's arithmetic
// (diffusers_row) on rows first copied into shared memory, each lane copying the 8-byte vectors it reduces (v =
// lane, lane + 32, ...) and the block the weight, every copy in flight at once. Why: the per-row kernel's loop
// issues 4 loads per iteration (SASS: 4 LDG.E.64, then the adds that wait on them), so a 3584-element row (28
// vectors per lane) takes 7 DRAM round trips in a row and its output pass 7 more to L1/L2 for x and the weight;
// 1x512x3584 runs 17.9 us (f1e1d95, ops.json) against a floor of 1.7. Staged: one round trip, then shared memory.
// kWideRowsPerBlock rows (warps) per block: 512 rows fill 128 blocks; 10 N bytes of shared memory (81.6 KB at N =
// 8160, opted in).
constexpr int kWideRowsPerBlock = 4;

__global__ void __launch_bounds__(32 * kWideRowsPerBlock) rms_norm_diffusers_wide_staged(const Params p) {
  extern __shared__ uint2 wide_rows[];  // the weight's V vectors, then row rb's at V * (1 + rb)
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int rb = static_cast<int>(threadIdx.x) / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWideRowsPerBlock + rb;
  const int V = p.n / 4;
  if (p.has_w) {
#pragma unroll 1
    for (int v = static_cast<int>(threadIdx.x); v < V; v += 32 * kWideRowsPerBlock)
      cp_async(wide_rows + v, reinterpret_cast<const uint2*>(p.w) + v, false);
  }
  uint2* sx = wide_rows + static_cast<int64_t>(V) * (1 + rb);
  if (row < p.rows) {
    const uint2* gx = reinterpret_cast<const uint2*>(row_ptr(p, row));
#pragma unroll 1
    for (int v = lane; v < V; v += 32) cp_async(sx + v, gx + v, false);
  }
  cp_async_wait_all();
  __syncthreads();  // the weight's vectors come from the whole block
  if (row >= p.rows) return;  // whole warp
  diffusers_row<true>(p, row, lane, reinterpret_cast<const uint16_t*>(sx),
                      reinterpret_cast<const uint16_t*>(wide_rows));
}

void launch_wide_staged(const Params& p, int device, cudaStream_t stream) {
  constexpr int kMaxBytes = static_cast<int>(sizeof(uint16_t)) * 8160 * (1 + kWideRowsPerBlock);
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(rms_norm_diffusers_wide_staged, device, kMaxBytes, opted_in);
  const int64_t blocks = (p.rows + kWideRowsPerBlock - 1) / kWideRowsPerBlock;
  launch_max_shared<rms_norm_diffusers_wide_staged>(p, static_cast<unsigned>(blocks), 32 * kWideRowsPerBlock,
                                                    sizeof(uint16_t) * p.n * (1 + kWideRowsPerBlock), device, stream);
}

// Rows of exactly 128 elements (per-head norms) with the vector output pass, R rows per warp (all R loads before
// any reduction, the R trees interleaved): the same per-row arithmetic as rms_norm_diffusers_kernel's vectorized
// path for one vector per lane, through norm/diffusers_head_norm.h (head_rstd, diffusers_norm_run), which the
// attention prologues run on the same rows. Default 4 rows per warp; DIFUSE_RMSD_ROWS_PER_WARP=2 (for
// measurement), or 1 for the kernel above.
template <int R>
__global__ void __launch_bounds__(256) rms_norm_diffusers_heads(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32) * R;
  if (r0 >= p.rows) return;  // whole warp
  HeadRun<4> x[R];
#pragma unroll
  for (int q = 0; q < R; ++q)
    x[q] = r0 + q < p.rows ? load_run<4>(row_ptr(p, r0 + q), lane) : zero_run<4>();
  float rstd[R];
  head_rstd<4, R>(x, lane, 128, p.factor, p.eps, rstd);
  const HeadRun<4> w = p.has_w ? load_run<4>(p.w, lane) : zero_run<4>();
#pragma unroll
  for (int q = 0; q < R; ++q)
    if (r0 + q < p.rows) store_run<4>(p.out + (r0 + q) * p.n, lane, diffusers_norm_run<4>(x[q], rstd[q], p.has_w, w));
}

// Rows of exactly 64 elements (SD3.5's heads) on half a warp (the default; DIFUSE_RMSD_LANES_PER_ROW=32 for the
// full-warp kernel): R
// slots of two rows per warp (row 2 slot + seg), span lane u holding elements u, u + 16, u + 32, u + 48 (2-byte
// loads and stores), aten's lanes u and u + 16 folded (norm::head64_span_lane_sum, head64_rstd_half_warp): no
// gather shuffles and a 4-level tree where rms_norm_diffusers_kernel spends a 5-level tree on 2 elements a lane.
// An absent weight is applied as 1 (diffusers_rms_bits: the same bits).
template <int R>
__global__ void __launch_bounds__(256) rms_norm_diffusers_half_warp64(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % 16, seg = lane / 16;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32) * 2 * R;
  if (r0 >= p.rows) return;  // whole warp
  float x[R][4];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + 2 * q + seg;
    const uint16_t* xr = r < p.rows ? row_ptr(p, r) + u : nullptr;
#pragma unroll
    for (int j = 0; j < 4; ++j) x[q][j] = xr != nullptr ? num::bf16_to_float(xr[16 * j]) : 0.f;
  }
  float rstd[R];
  head64_rstd_half_warp<R>(x, p.factor, p.eps, rstd);
  float w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = p.has_w ? num::bf16_to_float(p.w[u + 16 * j]) : 1.f;
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + 2 * q + seg;
    if (r >= p.rows) continue;  // no shuffle follows
    uint16_t* o = p.out + r * 64 + u;
#pragma unroll
    for (int j = 0; j < 4; ++j) o[16 * j] = diffusers_rms_bits(x[q][j], rstd[q], w[j]);
  }
}

// Rows of exactly 128 elements on half a warp (the default where the output pass is vectorized;
// DIFUSE_RMSD_LANES_PER_ROW=32 for the 4-rows-per-warp kernel): R slots of two rows per warp (row 2 slot + seg), span
// lane u holding aten's float4 vectors u and u + 16
// (norm::head_rstd_half_warp, the Qwen-Image prologue's tree), as the FLUX and Qwen prologues gained from it.
template <int R>
__global__ void __launch_bounds__(256) rms_norm_diffusers_half_warp128(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % 16, seg = lane / 16;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32) * 2 * R;
  if (r0 >= p.rows) return;  // whole warp
  HeadRun<4> x[R][2];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + 2 * q + seg;
#pragma unroll
    for (int j = 0; j < 2; ++j) x[q][j] = r < p.rows ? load_run<4>(row_ptr(p, r), u + 16 * j) : zero_run<4>();
  }
  float rstd[R];
  head_rstd_half_warp<R>(x, p.factor, p.eps, rstd);
  HeadRun<4> w[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) w[j] = p.has_w ? load_run<4>(p.w, u + 16 * j) : zero_run<4>();
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int64_t r = r0 + 2 * q + seg;
    if (r >= p.rows) continue;  // no shuffle follows
#pragma unroll
    for (int j = 0; j < 2; ++j)
      store_run<4>(p.out + r * 128, u + 16 * j, diffusers_norm_run<4>(x[q][j], rstd[q], p.has_w, w[j]));
  }
}

// STAGED rows of 64 or 128 elements (the default for 64-element rows since 132f46f's sweep, DIFUSE_RMSD_STAGED_ROWS=1
// stages 128-element rows too and =0 neither; rows 16-byte aligned, and at 128 the vectorized output pass): the block first copies its 64 rows into shared memory
// with cp.async, every copy in flight at once, then runs the half-warp kernels' arithmetic (head64_rstd_half_warp
// at 64, head_rstd_half_warp at 128; slots of two rows, one slot at a time) reading them from there: the same bits
// per row. 32 registers, 8 blocks per SM: more of the rows' bytes in flight per SM than the per-row kernels hold
// (2x24x4096x64: 23.1 us, 51 % of its floor; 1x4608x24x128: 19.9 us, 67 %).
// OSMEM (64-element rows, out 16-byte aligned; DIFUSE_RMSD_OUT_SMEM=1, for measurement): each normalised element
// written back over its staged input (the same lane, the same half-word) instead of to global memory, then after a
// second barrier the block's rows, one contiguous run of out, copied out in 16-byte vectors: a half warp's 2-byte
// stores reach L2 as 32-byte pieces of two rows per instruction, the copy as whole lines (qk_norm_sd35's
// DIFUSE_QK_SD35_OUT_SMEM=1 tests the same on the SD3.5 prologue). The same bits (stores only).
constexpr int kStagedRows = 64;

template <int N, bool OSMEM = false>
__global__ void __launch_bounds__(256, 8) rms_norm_diffusers_staged(const Params p) {
  static_assert(N == 64 || N == 128, "the half-warp row layouts");
  static_assert(!OSMEM || N == 64, "the write-back variant is for 64-element rows");
  constexpr int CHUNKS = N / 8;      // 16-byte copies per row
  extern __shared__ uint4 rows16[];  // row rr of the block at chunk CHUNKS * rr
  const int64_t r_first = static_cast<int64_t>(blockIdx.x) * kStagedRows;
  const int nrows = static_cast<int>(p.rows - r_first < kStagedRows ? p.rows - r_first : kStagedRows);
  stage_block_rows<CHUNKS, 256>(rows16, nrows, [&](int rr) { return row_ptr(p, r_first + rr); });
  cp_async_wait_all();
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int u = lane % 16, seg = lane / 16;
  const int r0 = static_cast<int>(threadIdx.x / 32) * 8;  // 8 warps x 4 slots x 2 rows: the block's 64 rows
  if (!OSMEM && r0 >= nrows) return;                      // whole warp (no barrier follows; OSMEM: one does)
  if constexpr (N == 64) {
    float w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = p.has_w ? num::bf16_to_float(p.w[u + 16 * j]) : 1.f;
#pragma unroll 1
    for (int q = 0; q < (OSMEM && r0 >= nrows ? 0 : 4); ++q) {  // OSMEM: a warp past the rows goes to the barrier
      const int rr = r0 + 2 * q + seg;
      const uint16_t* xr = reinterpret_cast<const uint16_t*>(rows16 + CHUNKS * (rr < nrows ? rr : 0)) + u;
      float x[1][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) x[0][j] = rr < nrows ? num::bf16_to_float(xr[16 * j]) : 0.f;
      float rstd[1];
      head64_rstd_half_warp<1>(x, p.factor, p.eps, rstd);  // every lane of the warp takes part
      if (rr >= nrows) continue;
      uint16_t* o = OSMEM ? reinterpret_cast<uint16_t*>(rows16 + CHUNKS * rr) + u : p.out + (r_first + rr) * 64 + u;
#pragma unroll
      for (int j = 0; j < 4; ++j) o[16 * j] = diffusers_rms_bits(x[0][j], rstd[0], w[j]);
    }
    if constexpr (OSMEM) {  // the block's rows are one contiguous run of out: nrows * 8 vectors
      __syncthreads();
      uint4* dst = reinterpret_cast<uint4*>(p.out + r_first * 64);
#pragma unroll 1
      for (int c = static_cast<int>(threadIdx.x); c < nrows * CHUNKS; c += 256) dst[c] = rows16[c];
    }
  } else {
    HeadRun<4> w[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) w[j] = p.has_w ? load_run<4>(p.w, u + 16 * j) : zero_run<4>();
#pragma unroll 1
    for (int q = 0; q < 4; ++q) {
      const int rr = r0 + 2 * q + seg;
      const uint16_t* xr = reinterpret_cast<const uint16_t*>(rows16 + CHUNKS * (rr < nrows ? rr : 0));
      HeadRun<4> x[1][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) x[0][j] = rr < nrows ? load_run<4>(xr, u + 16 * j) : zero_run<4>();
      float rstd[1];
      head_rstd_half_warp<1>(x, p.factor, p.eps, rstd);
      if (rr >= nrows) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        store_run<4>(p.out + (r_first + rr) * 128, u + 16 * j, diffusers_norm_run<4>(x[0][j], rstd[0], p.has_w, w[j]));
    }
  }
}

template <int N, bool OSMEM = false>
void launch_staged(const Params& p, int device, cudaStream_t stream) {
  const int64_t blocks = (p.rows + kStagedRows - 1) / kStagedRows;  // 8 blocks of 8 or 16 KB per SM
  launch_max_shared<rms_norm_diffusers_staged<N, OSMEM>>(p, static_cast<unsigned>(blocks), 256,
                                                         sizeof(uint4) * (N / 8) * kStagedRows, device, stream);
}

}  // namespace

float diffusers_mean_factor(int64_t rows, int64_t n) {
  return static_cast<float>(rows) / static_cast<float>(rows * n);
}

detail::Support can_use_rms_norm_diffusers(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                           const difuse_tensor_view& weight, double eps) {
  (void)eps;
  detail::Support s;
  if (!detail::require_bf16_row_view(s, x, "x")) return s;
  const int64_t N = x.sizes[x.rank - 1];
  const int64_t rows = N ? detail::numel(x) / N : 0;
  DIFUSE_REQUIRE(s, N >= 32 && N <= 8160,
                 "the normalized width must be in [32, 8160] (aten's mean then runs one warp per row), got " +
                     std::to_string(N));
  DIFUSE_REQUIRE(s, rows >= 16,
                 "at least 16 rows are needed (fewer change aten's mean block shape, which is not replayed), got " +
                     std::to_string(rows));
  DIFUSE_REQUIRE(s, N < 128 || N % 4 == 0,
                 "a width of 128 or more must be a multiple of 4 (aten's vectorized mean over misaligned rows is not "
                 "replayed), got " + std::to_string(N));
  DIFUSE_REQUIRE(s, rows * N <= int64_t{2147483647}, "at most 2^31 - 1 elements (aten splits larger reductions)");
  if (N % 4 == 0 && detail::numel(x) > 0) {
    bool aligned = detail::aligned(x.data, 8);
    for (int d = 0; d + 1 < x.rank; ++d) aligned = aligned && (x.sizes[d] <= 1 || x.strides[d] % 4 == 0);
    DIFUSE_REQUIRE(s, aligned, "x rows must be 8-byte aligned, got " + detail::describe(x));
  }
  if (weight.data != nullptr || weight.rank != 0) {
    DIFUSE_REQUIRE(s, weight.dtype == DIFUSE_BF16,
                   std::string("weight must be bf16 (an fp32 weight multiplies in fp32: another chain), got ") +
                       difuse_dtype_name(weight.dtype));
    DIFUSE_REQUIRE(s, weight.rank == 1 && weight.sizes[0] == N && weight.strides[0] == 1,
                   "weight must be a contiguous [" + std::to_string(N) + "], got " + detail::describe(weight));
    DIFUSE_REQUIRE(s, weight.device == x.device, "weight must be on the device of x, got " + detail::describe(weight));
  }
  detail::require_bf16_output(s, out, x, "x", {&x, &weight});
  return s;
}

void rms_norm_diffusers(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                        double eps, cudaStream_t stream) {
  const detail::Support s = can_use_rms_norm_diffusers(out, x, weight, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_diffusers"));
  if (detail::numel(x) == 0) return;
  Params p{};
  static_cast<detail::BF16RowsIO&>(p) = detail::bf16_rows_io(out, x, weight);
  p.eps = static_cast<float>(eps);
  p.factor = diffusers_mean_factor(p.rows, p.n);
  p.vectorized = p.n >= 128;
  p.vec_out = p.vectorized && detail::aligned(out.data, 8) && (!p.has_w || detail::aligned(weight.data, 8));
  const detail::DeviceGuard device_guard(x.device);
  static const int rows_per_warp = detail::positive_env_knob("DIFUSE_RMSD_ROWS_PER_WARP");
  // Default 4 rows per warp for 128-element rows (DIFUSE_RMSD_ROWS_PER_WARP=1|2 for measurement). H200,
  // 1x4608x24x128 at 5fa0c2a (knob-sweeps/): 4 rows 22.2 us, 2 rows 23.5, 1 row 31.1.
  const int R = rows_per_warp == 0 || rows_per_warp >= 4 ? 4 : rows_per_warp >= 2 ? 2 : 1;
  const unsigned blocks = static_cast<unsigned>((p.rows + kRowsPerBlock * R - 1) / (kRowsPerBlock * R));
  static const int lanes = detail::positive_env_knob("DIFUSE_RMSD_LANES_PER_ROW");
  // 64-element rows by default on half a warp, 2 slots of two rows per warp (4 with DIFUSE_RMSD_ROWS_PER_WARP >= 4).
  // H200 at daa91f6 (knob-sweeps/): 2x24x4096x64 24.0 us vs 50.0 for one row per warp. DIFUSE_RMSD_LANES_PER_ROW=32
  // (for measurement) keeps the full-warp kernel.
  // Staged rows: the default for 64-element rows (H200 at 132f46f, knob-sweeps/: 2x24x4096x64 20.4 us vs 23.0 on the
  // per-row half-warp kernel); not for 128-element rows, where they lost (1x4608x24x128 19.6 vs 18.9).
  // DIFUSE_RMSD_STAGED_ROWS=1 (for measurement) stages 128-element rows too, =0 neither.
  static const int staged = detail::env_knob_or("DIFUSE_RMSD_STAGED_ROWS", -1);
  // The rows the per-row kernel takes (other widths than 64 and 128), vectorized with the vector output pass, are
  // staged in shared memory first by default (rms_norm_diffusers_wide_staged). H200 at 5d35cbc (knob-sweeps/5d35cbc/,
  // DIFUSE_RMSD_WIDE_STAGED=1 against ops.json of the same run): 1x512x3584 8.3 us vs 17.3 (predicted ~6; the copy
  // of the same bytes in that harness: 8.9). DIFUSE_RMSD_WIDE_STAGED=0 (for measurement) keeps the per-row kernel.
  static const int wide_staged = detail::env_knob_or("DIFUSE_RMSD_WIDE_STAGED", -1);
  const bool stage_rows = staged == 1 ? (p.n == 64 || (p.n == 128 && p.vec_out)) : staged != 0 && p.n == 64;
  if (stage_rows && lanes != 32 && rows_per_warp == 0 && detail::rows_aligned(x, 16)) {
    // DIFUSE_RMSD_OUT_SMEM=1 (for measurement; 64-element rows, out 16-byte aligned): the rows written back to shared
    // memory and copied out in 16-byte vectors (OSMEM above). Predicted 2x24x4096x64 20.7 -> ~17 us if the 2-byte
    // stores' 32-byte pieces are what holds it at 57 % of its floor (the 128-element rows, 8 bytes per lane, run
    // the same bytes in 17.5), unchanged if not.
    static const int osmem = detail::positive_env_knob("DIFUSE_RMSD_OUT_SMEM");
    if (p.n == 64 && osmem == 1 && detail::aligned(out.data, 16))
      launch_staged<64, true>(p, x.device, stream);
    else
      p.n == 64 ? launch_staged<64>(p, x.device, stream) : launch_staged<128>(p, x.device, stream);
  } else if (lanes != 32 && p.n == 64) {
    const int slots = rows_per_warp >= 4 ? 4 : 2;
    const unsigned b64 = static_cast<unsigned>((p.rows + kRowsPerBlock * 2 * slots - 1) / (kRowsPerBlock * 2 * slots));
    slots == 4 ? rms_norm_diffusers_half_warp64<4><<<b64, 32 * kRowsPerBlock, 0, stream>>>(p)
               : rms_norm_diffusers_half_warp64<2><<<b64, 32 * kRowsPerBlock, 0, stream>>>(p);
  } else if (lanes != 32 && p.n == 128 && p.vec_out) {
    // 128-element rows by default on half a warp, 2 slots of two rows per warp (4 with ROWS_PER_WARP >= 4). H200 at
    // 66f5a3b (knob-sweeps/): 1x4608x24x128 20.7 us vs 22.2 for 4 rows per warp, 1x4096x24x128 18.7 vs 20.4 (4 slots
    // the same). DIFUSE_RMSD_LANES_PER_ROW=32 keeps a warp per row (DIFUSE_RMSD_ROWS_PER_WARP rows, default 4).
    const int slots = rows_per_warp >= 4 ? 4 : 2;
    const unsigned b128 = static_cast<unsigned>((p.rows + kRowsPerBlock * 2 * slots - 1) / (kRowsPerBlock * 2 * slots));
    slots == 4 ? rms_norm_diffusers_half_warp128<4><<<b128, 32 * kRowsPerBlock, 0, stream>>>(p)
               : rms_norm_diffusers_half_warp128<2><<<b128, 32 * kRowsPerBlock, 0, stream>>>(p);
  } else if (R > 1 && p.n == 128 && p.vec_out)
    R == 4 ? rms_norm_diffusers_heads<4><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(p)
           : rms_norm_diffusers_heads<2><<<blocks, 32 * kRowsPerBlock, 0, stream>>>(p);
  else if (wide_staged != 0 && p.vec_out)
    launch_wide_staged(p, x.device, stream);
  else
    rms_norm_diffusers_kernel<<<static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock),
                                32 * kRowsPerBlock, 0, stream>>>(p);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::norm
