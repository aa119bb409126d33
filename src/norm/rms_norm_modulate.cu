// rms_norm_modulate, gated_residual_rms_norm_modulate — RMSNorm-based adaLN in one pass, bit-exact against the
// eager chains of diffusers 0.42's ERNIE-Image and LTX-2 transformers.
//
// Both models normalise with diffusers.models.normalization.RMSNorm (the class, not torch.nn.RMSNorm):
//     variance = x.to(float32).pow(2).mean(-1, keepdim=True)     (1) RN(v * v), aten's generic mean (RN adds)
//     y = x * torch.rsqrt(variance + eps)                        (2) RN(var + eps), rsqrtf, RN(x * rstd) fp32
//     n = y.to(bf16) * weight   (bf16 weight: ERNIE)             (3) bf16 rounding, then bf16(RN(y * w))
//     n = y.to(bf16)            (elementwise_affine=False: LTX-2) (3') one bf16 rounding
// then modulate, differently:
//   ERNIE-Image (ErnieImageSharedAdaLNBlock.forward; fp32_modulate = 1):
//     out = (n.float() * (1 + scale.float()) + shift.float()).to(n.dtype)
//         = bf16(RN(RN(n * RN(scale + 1)) + shift))             three fp32 kernels, no fma, one bf16 rounding
//     adaLN_sa_ln / adaLN_mlp_ln = RMSNorm(3072, eps=1e-6) with a bf16 weight, no bias; x is [S, B, H]
//     (sequence first), scale/shift the [B, H] chunks of adaLN_modulation(c) expanded to [S, B, H] and made
//     contiguous (passing the [B, H] chunks themselves broadcasts to the same values);
//   LTX-2 (LTX2VideoTransformerBlock.forward, norm1/norm2/norm3 and the audio and a2v/v2a norms;
//   fp32_modulate = 0):
//     out = n * (1 + scale) + shift                              three bf16 kernels, a bf16 rounding after each:
//         = bf16(RN(bf16(RN(n * bf16(RN(scale + 1)))) + shift))
//     RMSNorm(D, eps=1e-6, elementwise_affine=False): D = 4096 (video), 2048 (audio); x [B, L, D]; scale/shift
//     the [B, T, D] unbind(dim=2) views of scale_shift_table[None, None] + temb.reshape(B, T, k, D), T = 1 or L
//     (strides (T k D, k D, 1)).
// The residual form (the site before the next norm) rounds identically in both models:
//     ERNIE: h1 = h + (gate.float() * a.float()).to(bf16)      LTX-2: h1 = h + a * gate  (or gate * a)
//          = bf16(RN(h + bf16(RN(gate * a))))                   both outputs (h1, out) are returned.
// Modulation (and gate) views broadcast against x with torch's rules (right-aligned: [B, H] against an ERNIE
// [S, B, H] x, [B, 1, D] or [B, L, D] against an LTX-2 [B, L, D] x).
//
// Replays: torch 2.11.0+cu130 reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float, float, float>,
// uint32, float, vt0 = 4, input_vec_size = 4>> in its (32, 16) block configuration, as rms_norm_diffusers does
// (rms_modulate_schedule.h): one warp per row, lane x holds the float4 vectors x, x + 32, ... (N >= 128) or the
// elements x + 32 i (N < 128) in four accumulators, ((a0 + a1) + a2) + a3, shuffle-down tree 16..1,
// mean = RN(sum * factor), factor = (float)rows / (float)(rows * N); then CUDAFunctorOnSelf_add (1 + scale),
// the broadcast mul and add (fp32 opmath; a bf16 store each, or fp32 stores and one .to(bf16)), and for the
// residual binary_internal::MulFunctor<float> + CUDAFunctor_add<bf16> (shared/reference/torch-2.11-numerics.md
// §3, §4). Packed bf16x2 add/mul are used only where they equal the fp32 op + bf16 rounding (numerics/modulate.h).
//
// Guards (can_use_rms_norm_modulate / can_use_gated_residual_rms_norm_modulate; every violation is reported):
// x (h) bf16 contiguous on a CUDA device, rank 1-4; 32 <= N <= 8160 and rows >= 16 (or no rows at all): only
// then is aten's mean block (32, 16) with one warp per row (narrower rows or fewer rows change the block
// shape, N > 8160 splits a row across warps; not replayed); N % 4 == 0 when N >= 128 (misaligned fp32 rows start
// with an alignment head, not replayed) and x 8-byte aligned then; rows * N < 2^31; weight absent or a
// contiguous bf16 [N]; scale, shift (gate) bf16, broadcastable to x with N as their contiguous last dim and
// non-negative strides; fp32_modulate 0 or 1; out (and residual) contiguous bf16 of x's shape, 8-byte aligned,
// overlapping no input (residual may be h itself). The residual form's a: bf16 of h's shape whose rows may lie at
// any non-negative strides (ERNIE-Image's attention output [B, S, H] permuted to [S, B, H]: row s B + b at
// s H + b S H), each row contiguous and, when N >= 128, 8-byte aligned (the streamed kernels bulk-copy it only
// where every row is 16-byte aligned); the kernels place row r at a + a_rows.offset(r) (thirty-first session:
// before, the ERNIE site copied a to contiguous rows first, 47 copies of ~71 MB per H100 step at e281a31).
//
// Schedule: one warp per row, 4 rows per 128-thread block; N >= 128: two passes over the row (the mean, then the
// epilogue from L1/L2), 32-48 registers; with DIFUSE_RMSMOD_ONE_PASS=1 each lane keeps its vectors (up to 64 for
// N = 8160) in registers instead: one read of x; with DIFUSE_RMSMOD_ROWS_PER_WARP=N >= 2 (for measurement; slower
// on the H200 at 5f8295d, knob-sweeps/: 1x4096x3072 30.8 us at N = 2, 40.4 at 4, vs 24.4) the two-pass kernel on
// a grid N times smaller, each warp taking every grid-th row; staged (the default up to N = 3072 since eb1307d;
// DIFUSE_RMSMOD_STAGED=1 at every width, =0 never) each warp first copies its row into shared memory, all 16-byte
// copies in flight, and runs the two passes from there (rms_norm_modulate_staged): exact through its knob at 132f46f
// (tests.json) and as the default at eb1307d (this file's 379 tests, the two-pass kernel through
// DIFUSE_RMSMOD_STAGED=0; gpu-tests-eb1307d.json), compute-sanitizer clean there; 1x4096x3072 23.0 us vs 24.5 two-pass,
// 4352x2x3072 47.1 vs 53.6 (bench-partial-eb1307d.log, knob-sweeps/eb1307d/; target 15: not met; 23.1 at f1e1d95);
// DIFUSE_RMSMOD_PIPELINED=1 runs the staged rows on a grid of the resident blocks with two buffers per warp, the
// next row's copies in flight during the current row's passes: exact at 5d35cbc and slower (1x4096x3072 29.3 vs
// 22.4 us, knob-sweeps/5d35cbc/); kept for measurement only. STAGE_ALL rows (fifty-second session; the default for at
// most 1024 rows whose one-warp blocks all fit the device at once, rms_stage_all_by_default; DIFUSE_RMSMOD_STAGE_ALL=1
// everywhere it can run, =0 never): one warp per block stages its x (h) row and every other row it reads (a, gate,
// weight, scale, shift) in one burst (rms_norm_modulate_staged_all), for few rows whose time is their chain of round
// trips. Exact through the knob on an H100 at a4fd151 (test_staged_all_rows_variant, gpu-tests.json in
// bench/results/h100/stage-all-a4fd151/); at 94 SMs 2x126x2048 ltx2 6.6 us vs 8.0, the residual form's ltx2_tokens 9.5
// vs 12.8, and slower with more rows (1x4096x3072 30.5 vs 24.0). The default rule has not run on a GPU. Streamed rows (eighteenth session; the default for
// the plain form at N > 3072 and >= 4096 rows, and since the fiftieth session for both forms from 4096 rows where
// the full-width kernel at N = 3072 runs, below; DIFUSE_RMSMOD_STREAMED=G everywhere, =0 never): the same rows on the
// streamed schedule (norm/stream_rows.cuh: a producer warp bulk-copies each row into a ring of slots, G consumer
// warps compute; rms_norm_modulate_streamed): exact through its knob at e831f9c (gpu-tests-e831f9c.json: this file's
// tests) and as the default at a140ba1 (gpu-tests-a140ba1.json; the default-choice and knob-off tests at 83f6b5f,
// gpu-tests-83f6b5f.json), memcheck and racecheck clean (sanitizer-streamed-a140ba1.txt), 2x6144x4096 69.8 us vs 75.2 two-pass, 1x6144x4096 per-token 55.8 vs 65.4 (knob-sweeps/e831f9c/).
// Since the nineteenth session the streamed rows stage the block's weight and its at most two distinct scale, shift
// and gate rows in shared memory (SMOD, wherever stream_mod_rows allows it; DIFUSE_RMSMOD_STREAM_SMOD=0 keeps them in
// global memory), the residual form's slots hold a beside h, and both forms take the streamed rows by default from
// 8192 rows with staged modulation rows (rms_streamed_by_default): exact through the knobs at e7993bf
// (gpu-tests-e7993bf.json; memcheck and racecheck clean, sanitizer-streamed-knobs-e7993bf.txt) and as the default in
// the whole suite at 79a9492 (tests.json at 79a9492) and this file's default-choice tests at 5fc3ade
// (gpu-tests-5fc3ade.json); 4352x2x3072 37.0 us vs 40.6 staged, 2x6144x4096 63.9 vs 69.0, the residual form 66.6 vs
// 69.5 and 116.9 vs 122.9 (knob-sweeps/e7993bf/).
// Batched loads (0385466): the epilogue issues 4 vectors' x, weight, scale and shift loads before their stores, and
// the residual pass half a batch's a and gate loads before theirs. Before, SASS showed each vector's loads waiting
// on the previous vector's store (24 L2 round trips in turn per 3072-element row). H200 at 0385466 (ops.json
// against 2cecf55's): 1x4096x3072 18.9 us vs 22.3 (predicted 18-19; a same-bytes copy 19.2; target 15: not met),
// 2x6144x4096 75.4 vs 87.1, the residual form 31.8 vs 39.0 and 124.0 vs 150.5, but 4352x1x3072 per-token residual
// 59.6 vs 56.8 (64 registers instead of 48). Exact there: test_rms_norm_modulate.py (gpu-tests-0385466.json),
// smoke memcheck / initcheck / racecheck clean (sanitizer-0385466.txt). Modulation rows are read as 8-byte words
// when every row start is 8-byte aligned, else as bf16. N < 128: scalar elements.
// Quarter batches (twelfth session): the residual form's staged rows with a per-token gate load a and the gate 2
// vectors at a time and batch the epilogue by 2 (54 registers, 9 blocks per SM instead of 8) where that saves a
// wave (residual_quarter_batches). 4352x1x3072 ernie_tokens 53.5-53.7 us vs 59.0-59.9 (bound 55.2: met). Exact at
// edec152 through DIFUSE_RMSMOD_RESIDUAL_HALF=2 and at c14c296 as the default for every per-token gate
// (gpu-tests-edec152.json, gpu-tests-c14c296.json), sanitizer clean at c14c296 (sanitizer.log, with the smoke test's
// per-token gate case). c14c296's rule also took them at 2x126x2048 ltx2_tokens, where they lost (16.2 us vs 11.7);
// the wave condition (8b4d75d, host dispatch only: every kernel's PTX is c14c296's) ran on the H200 at 9c75d86:
// 2x126x2048 ltx2_tokens 12.3 us (16.2 at c14c296), ernie_tokens 53.3, exact (gpu-tests-9c75d86.json, this file's
// and LayerNorm's tests, 729 passed) and in the whole suite at 5ee73e2 (tests.json).
//
// Full width (forty-sixth session): the streamed rows with staged rows at N = 3072 run kernels compiled for V = 768
// (rms_norm_modulate_streamed<true, RESIDUAL, true, CHAIN, 768>, full_width_for): two_pass_row's mean and epilogue
// loops run constant trip counts without per-vector tests; the same operations in the same order per lane, and the
// kernels with VN = 0 compile to the same SASS as before (`SASS_OPS_TEXT=1 SASS_OPS_RENAME='ELi0EEEv=EEEv'
// scripts/sass-ops-diff.sh bf8a09f src/norm/rms_norm_modulate.cu`: 65 same, 8 only now; tests/python/
// test_sass_ops_diff.py checks it). scripts/sass-loops.sh on ERNIE's plain row (chain 4): the mean loop 175 -> 111
// instructions per batch of 8 vectors, the epilogue loop 274 -> 233 per batch of 4; estimated from these, ~440 fewer a
// row of ~2,300 (3 and 6 batches); the residual form's residual-and-mean loop 453 -> 274 per batch. Predicted on the H200:
// 4352x2x3072 ernie 33.7 -> ~31.5 us (bound 31.4), the residual form 63.9 -> ~60 (62.8). DIFUSE_RMSMOD_FULL_WIDTH=0
// keeps the VN = 0 kernels (test_run_time_width_variant). First run in the forty-seventh session, on an H100 at 94 SMs
// (bench/results/h100/full-sweeps-e945489/, against DIFUSE_RMSMOD_FULL_WIDTH=0 in the same build): the residual form
// 4352x2x3072 92.2 -> 86.9 us (-5.7 %; two calls on one machine, each beside b591df4: 92.9 and 93.8), the plain form
// 47.9 -> 47.1 (within noise); exact there (this file's GPU tests
// at e945489). Not yet on an H200. The plain form's staged rows at V = 768 (e945489: fewer than 8192 rows at 3072) ran
// exact but slower there (4096x1x3072 ernie 29.8 -> 30.8 us, 1x4096x3072 ltx2 26.9 -> 27.1) and were reverted; the
// residual form's staged kernels at V = 768 took 72-80 registers against 54-64 (one block fewer per SM) and spilled
// when held to those by __launch_bounds__, so they were not tried unrolled (rolled: below).
// Since the forty-seventh session the residual form's streamed rows with staged rows at N = 4096 (LTX-2's video rows,
// 2x6144x4096) take VN = 1024 too (rms_norm_modulate_streamed<true, true, true, CHAIN, 1024>, full_width_for; 4
// kernels, 56 registers, no spill; the other 73 kernels' SASS unchanged, `SASS_OPS_TEXT=1 scripts/sass-ops-diff.sh
// e2f7c82 src/norm/rms_norm_modulate.cu`: 73 same, 4 only now). scripts/sass-loops.sh, chain 4: the residual-and-mean
// loop 453 -> 274 instructions per batch of 8 vectors (4 batches a row), the epilogue 272 -> 233 per batch of 4 (8);
// estimated ~1,000 fewer a row of ~4,600 (~22 %). Predicted on the H200 from the H100's -7 % at 3072: GRRMS
// 2x6144x4096 ltx2 113.2 -> ~106 us. Not the plain form (no faster at 3072 on the H100). Exact on a whole H100 at
// c477bdb (test_streamed_by_default at (2, 6144, 4096) ltx2 residual requires VN = 1024; test_run_time_width_variant;
// bench/results/h100/full-sweeps-5120-4096-c477bdb/). Timed in the forty-eighth session on an H100 at 94 SMs against
// 9e37db8 (bench/results/h100/full-sweeps-5120-4096-4e080ff/, two alternated rounds): 160.8 -> 152.2 us (-5.3 %).
// And since the forty-seventh session the residual form's staged rows at N = 3072 (fewer than 8192 rows: LTX-2's
// 1x4096x3072, ERNIE's per-token 4352x1x3072) run rms_norm_modulate_staged<true, true, HALF, CHAIN, 768>: no vector
// tested against V, but V and the trip counts from p, so the loops stay rolled as at VN = 0 (two_pass_row's VN without
// SMEM_MOD; unrolled, these kernels took 72-80 registers and spilled when bounded). 48 registers against 64 (HALF = 4)
// and 54 (HALF = 2), no spill; the 77 kernels before it compile to the same SASS (`SASS_OPS_TEXT=1
// SASS_OPS_RENAME='ELi0EEEv=EEEv' scripts/sass-ops-diff.sh c477bdb src/norm/rms_norm_modulate.cu`: 77 same, 8 only
// now). scripts/sass-loops.sh, chain 1: the residual-and-mean loop 427 -> 279 instructions per batch of 8 vectors (3
// a row), the epilogue 137 -> 106 per batch of 4 (6); estimated ~630 fewer a row of ~2,200. The occupancy query of the
// wave rule (staged_resident) asks the kernel that runs: at 48 registers HALF = 4 also fits 9 blocks per SM, so
// ERNIE's per-token rows now take HALF = 4 (residual_quarter_batches: no wave saved). Predicted on the H200: GRRMS
// 1x4096x3072 ltx2 30.6 -> ~29 us (bound 29.5); the plain form's V = 768 staged kernel (unrolled) ran slower on an
// H100, so this one is the first thing to measure. Measured in the forty-eighth session on an H100 at 94 SMs against
// 9e37db8 (bench/results/h100/full-sweeps-5120-4096-4e080ff/): 1x4096x3072 ltx2 45.0 -> 44.8 us, 4352x1x3072 ernie
// 72.9 -> 72.7: within noise, not the predicted -5 % (~630 fewer instructions a row bought nothing: a guess, not
// measured, is that these staged rows wait on memory, not on issue; ncu would say). Kept: no slower, fewer registers.
// Exact there (test_staged_width_by_default, test_run_time_width_variant among the 1,360 norm tests passed at 4e080ff;
// DIFUSE_RMSMOD_FULL_WIDTH=0 keeps the VN = 0 kernels).
// Fiftieth session: the full-width streamed kernels at N = 3072 (VN = 768) by default from 4096 rows
// (kRmsStreamFullWidthMinRows, rms_streamed_by_default's full_width_v), where 8192 rows were needed before. On an H100 at 94 SMs at 2b64b30
// (bench/results/h100/knob-sweeps-2b64b30/, DIFUSE_RMSMOD_STREAMED=1 against the default of the same build, alternated
// twice) the streamed rows beat the staged ones wherever the full-width kernel runs: rms_norm_modulate 1x4096x3072 ltx2
// 26.8 -> 23.8 us (-11 %), 4096x1x3072 ernie 29.9 -> 24.7 (-18 %), the residual form 1x4096x3072 ltx2 44.9 -> 42.4
// (-6 %); without it they lost (per-token rows, 252 rows) and those keep their kernels. Host dispatch only: no kernel's
// code changed. This file's 405 GPU tests passed with every call on the streamed rows (DIFUSE_RMSMOD_STREAMED=1; the 11
// failures were the default-choice tests, which name the kernel the knob replaces: gpu-tests-rmsmod-streamed-knob.json).
// Predicted on the H200 from the ratios: GRRMS 1x4096x3072 30.6 -> ~28.9 us (bound 29.5), rms_norm_modulate
// 1x4096x3072 19.1 -> ~17 (15.0), 4096x1x3072 22.2 -> ~18.3 (15.8). As the default on an H100 at c941232
// (bench/results/h100/default-check-c941232/): this file's 419 GPU tests and the whole suite passed; at 94 SMs against
// DIFUSE_RMSMOD_STREAMED=0 in the same build 24.0 vs 26.8 us, 24.8 vs 29.6 and 42.7 vs 44.9. Not yet run on an H200.
//
// Verification status: bit-exact on the H200 at 5f8295d (torch 2.11.0+cu130, sm_90; its RowIndexers take the
// 32-bit FastDivU32 path):
// tests/gpu/test_rms_norm_modulate.py (377 cases, incl. the diffusers ERNIE-Image and LTX-2 blocks' own forward,
// the register-resident variant through DIFUSE_RMSMOD_ONE_PASS=1 and the strided one through
// DIFUSE_RMSMOD_ROWS_PER_WARP), 0 failed, 0 skipped
// (bench/results/h200/tests.json). The two-pass default (32-48 registers instead of 120 at N = 3072 per
// scripts/kernel-resources.sh, so 4096 rows fit one wave): 1x4096x3072 32.4 us register-resident (6408223) ->
// 24.4 (3e989f7; target 15).
#include "norm/rms_norm_modulate.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/registry.h"
#include "core/rows.h"
#include "core/tensor.h"
#include "modulate/gated_residual_pair.h"
#include "norm/rms_modulate_schedule.h"
#include "norm/rms_norm_diffusers.h"
#include "norm/row_staging.cuh"
#include "norm/stream_rows.cuh"

namespace difuse::norm {

namespace {

const detail::KernelRegistration kRegistration{{
    "rms_norm_modulate", "cuda", "bit_exact",
    "diffusers RMSNorm(x, w, eps) * (1 + scale) + shift  (bf16 chain: LTX-2; fp32 modulate: ERNIE-Image)",
    "verified bit-exact on H200 at eb1307d, the defaults since then on H100 at c941232, the STAGE_ALL few rows "
    "through their knob on H100 at a4fd151 (torch 2.11.0+cu130, sm_90)",
    90, 90,
    "RMSNorm-based adaLN in one pass, replaying aten's mean reduction order (rows >= 16, 32 <= N <= 8160)"}};

const detail::KernelRegistration kResidualRegistration{{
    "gated_residual_rms_norm_modulate", "cuda", "bit_exact",
    "h1 = h + gate * a;  diffusers RMSNorm(h1, w, eps) * (1 + scale) + shift  (LTX-2 bf16 / ERNIE-Image fp32)",
    "verified bit-exact on H200 at eb1307d, the defaults since then on H100 at c941232, the STAGE_ALL few rows "
    "through their knob on H100 at a4fd151 (torch 2.11.0+cu130, sm_90)",
    90, 90,
    "gated residual, then RMSNorm-based adaLN of the new residual, one pass"}};

constexpr int kRowsPerBlock = 4;  // one warp per row
constexpr int kThreads = 32 * kRowsPerBlock;
constexpr int kMaxWidth = 8160;   // ceil(N / 32) < 256: aten keeps a row in one warp

struct Params {
  const uint16_t* x;  // the rows normalised (h for the residual variant); not restrict: residual may be h
  uint16_t* out;
  const uint16_t* w;  // nullptr: no weight
  const uint16_t* scale;
  const uint16_t* shift;
  const uint16_t* a;      // residual variant only
  const uint16_t* gate;
  uint16_t* residual;
  detail::RowIndexer scale_rows, shift_rows, gate_rows;  // row r's modulation starts at scale + scale_rows.offset(r)
  detail::RowIndexer a_rows;  // row r of a starts at a + a_rows.offset(r) (any row strides: ERNIE's permuted view)
  int64_t rows;
  int n, v;  // width, width / 4
  float eps, factor;
  bool has_w, fp32_mod;
  bool a_rows16;  // every row of a starts 16-byte aligned (the streamed kernels bulk-copy it)
};

// Four bf16 of a row as two words: one 8-byte load when the caller knows the address is 8-byte aligned.
template <bool VEC>
__device__ __forceinline__ uint2 load4(const uint16_t* s) {
  if constexpr (VEC) {
    return *reinterpret_cast<const uint2*>(s);
  } else {
    return make_uint2(s[0] | (uint32_t{s[1]} << 16), s[2] | (uint32_t{s[3]} << 16));
  }
}

// Rows of N >= 128 (N % 4 == 0): lane x holds aten lane x's vectors x + 32 k (k < K) in registers.
template <int K, bool VEC, bool RESIDUAL>
__global__ void __launch_bounds__(kThreads) rms_norm_modulate_rows(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;  // whole warp
  const int V = p.v;
  const uint2* xr = reinterpret_cast<const uint2*>(p.x + row * p.n);
  uint2 xv[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int vi = lane + 32 * k;
    xv[k] = vi < V ? xr[vi] : make_uint2(0, 0);
  }
  if constexpr (RESIDUAL) {  // h1 = h + gate * a, rounded as eager, written out and normalised from here on
    const uint16_t* grow = p.gate + p.gate_rows.offset(row);
    const uint2* ar = reinterpret_cast<const uint2*>(p.a + p.a_rows.offset(row));
    uint2* rr = reinterpret_cast<uint2*>(p.residual + row * p.n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int vi = lane + 32 * k;
      if (vi < V) {
        xv[k] = modulate::gated_residual_vec4(xv[k], ar[vi], load4<VEC>(grow + 4 * vi));
        rr[vi] = xv[k];
      }
    }
  }
  MeanLane acc;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (lane + 32 * k < V)
      mean_push_vec4(acc, num::bf16_lo(xv[k].x), num::bf16_hi(xv[k].x), num::bf16_lo(xv[k].y), num::bf16_hi(xv[k].y));
  }
  float s = mean_lane_total(acc);
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) s = mean_tree_step(s, __shfl_down_sync(0xffffffffu, s, o));
  const float rstd = diffusers_rstd(__shfl_sync(0xffffffffu, s, 0), p.factor, p.eps);

  const uint16_t* srow = p.scale + p.scale_rows.offset(row);
  const uint16_t* hrow = p.shift + p.shift_rows.offset(row);
  uint2* orow = reinterpret_cast<uint2*>(p.out + row * p.n);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int vi = lane + 32 * k;
    if (vi < V) {
      const uint2 ww = p.has_w ? load4<VEC>(p.w + 4 * vi) : make_uint2(0, 0);
      const uint2 sc = load4<VEC>(srow + 4 * vi), sh = load4<VEC>(hrow + 4 * vi);
      orow[vi] = make_uint2(rms_modulate_pair(xv[k].x, rstd, p.has_w, ww.x, sc.x, sh.x, p.fp32_mod),
                            rms_modulate_pair(xv[k].y, rstd, p.has_w, ww.y, sc.y, sh.y, p.fp32_mod));
    }
  }
}

// Rows of 32 <= N < 128: lane x holds elements x + 32 i (i < 4), accumulator i.
template <bool RESIDUAL>
__global__ void __launch_bounds__(kThreads) rms_norm_modulate_narrow(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= p.rows) return;  // whole warp
  const uint16_t* xr = p.x + row * p.n;
  float xv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = lane + 32 * i;
    xv[i] = c < p.n ? num::bf16_to_float(xr[c]) : 0.f;
  }
  if constexpr (RESIDUAL) {
    const uint16_t* grow = p.gate + p.gate_rows.offset(row);
    const uint16_t* ar = p.a + p.a_rows.offset(row);
    uint16_t* rr = p.residual + row * p.n;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = lane + 32 * i;
      if (c < p.n) {
        const float t = num::round_bf16(num::mul_rn(num::bf16_to_float(grow[c]), num::bf16_to_float(ar[c])));
        const uint16_t h1 = num::float_to_bf16_rne(num::add_rn(xv[i], t));
        rr[c] = h1;
        xv[i] = num::bf16_to_float(h1);
      }
    }
  }
  MeanLane acc;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (lane + 32 * i < p.n) mean_push_scalar(acc, i, xv[i]);
  float s = mean_lane_total(acc);
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) s = mean_tree_step(s, __shfl_down_sync(0xffffffffu, s, o));
  const float rstd = diffusers_rstd(__shfl_sync(0xffffffffu, s, 0), p.factor, p.eps);
  const uint16_t* srow = p.scale + p.scale_rows.offset(row);
  const uint16_t* hrow = p.shift + p.shift_rows.offset(row);
  uint16_t* orow = p.out + row * p.n;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = lane + 32 * i;
    if (c < p.n) {
      const float w = p.has_w ? num::bf16_to_float(p.w[c]) : 0.f;
      orow[c] = num::float_to_bf16_rne(rms_modulate_value(xv[i], rstd, p.has_w, w, num::bf16_to_float(srow[c]),
                                                          num::bf16_to_float(hrow[c]), p.fp32_mod));
    }
  }
}

// Rows of N >= 128 in two passes over global memory, the same arithmetic as rms_norm_modulate_rows (lane x pushes
// aten lane x's vectors x + 32 k in increasing k, then the same tree and epilogue) without holding the row in
// registers: pass 1 streams the vectors in batches of 8 into the mean (the residual variant writes h1 = h + gate
// * a as it goes), pass 2 reads them again (L1/L2: the row was just read or written by this lane) for the
// epilogue. 32-48 registers instead of 120 at N = 3072 (scripts/kernel-resources.sh), so an SM holds 31+ rows:
// FLUX's 4096 rows in one wave.
// The default for N >= 128 (DIFUSE_RMSMOD_ONE_PASS=1, for measurement, keeps the rows in registers).
// STAGED: the row (h for the residual form) is already in shared memory at sx, copied by its warp; pass 1 reads it
// from there, the residual form writes h1 back over it (as well as out to global), and pass 2 reads it from there
// (each lane reads back only the vectors it wrote: no barrier).
// SMEM_A / SMEM_MOD (the streamed kernel's slots and staged rows): the residual form's a row, and the weight, scale,
// shift and gate rows, read from shared memory at sm's pointers (V 8-byte words each) instead of global memory; the
// same words, the same arithmetic.
struct SmemRows {
  const uint2* a = nullptr;
  const uint2* w = nullptr;
  const uint2* scale = nullptr;
  const uint2* shift = nullptr;
  const uint2* gate = nullptr;
};

// CHAIN: 0 reads the chain from p (has_w, fp32_mod) at run time;
// 1 + has_w + 2 fp32_mod fixes it at compile time (the streamed kernels with staged rows, the staged kernels with
// 8-byte rows), so the epilogue holds one chain and no branches between them.
// VN > 0 (the full-width kernels, with_full_width): V = VN vectors, a multiple of 32 kBatch and of 32 kOutBatch, so
// every vector a lane's batches name exists: no vector is tested against V. With SMEM_MOD (the streamed kernels) the
// loops also run constant trip counts; without it (the staged residual kernels) V and the trip counts stay p's.
template <bool VEC, bool RESIDUAL, bool STAGED = false, int HALF = 4, bool SMEM_A = false, bool SMEM_MOD = false,
          int CHAIN = 0, int VN = 0>
__device__ __forceinline__ void two_pass_row(const Params& p, int64_t row, int lane, uint2* sx = nullptr,
                                             const SmemRows& sm = SmemRows{}) {
  constexpr int kBatch = 8;
  // VN with SMEM_MOD (the streamed kernels): V and the trip counts constant, loops unrolled; VN without it (the staged
  // residual kernels, forty-seventh session): no vector tested, but V and the trip counts from p, loops rolled as at
  // VN = 0 (unrolled, those kernels needed more registers than their occupancy allows).
  const int V = VN > 0 && SMEM_MOD ? VN : p.v;
  const uint2* xr = STAGED ? sx : reinterpret_cast<const uint2*>(p.x + row * p.n);
  uint2* rr = RESIDUAL ? reinterpret_cast<uint2*>(p.residual + row * p.n) : nullptr;
  const uint16_t* grow = RESIDUAL && !SMEM_MOD ? p.gate + p.gate_rows.offset(row) : nullptr;
  const uint2* ar = !RESIDUAL ? nullptr : SMEM_A ? sm.a : reinterpret_cast<const uint2*>(p.a + p.a_rows.offset(row));
  MeanLane acc;
  for (int kb = 0; 32 * kb < V; kb += kBatch) {
    uint2 xv[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int vi = lane + 32 * (kb + j);
      xv[j] = (VN > 0 || vi < V) ? xr[vi] : make_uint2(0, 0);
    }
    if constexpr (RESIDUAL) {
      // The a and gate loads of half a batch before its stores (as in the epilogue below: a load after a store
      // that may alias it is not moved above it, so one loop would wait on L2 once per vector). Halves, not the
      // whole batch: 8 vectors' a and gate took 72 registers (7 blocks per SM, 3584 rows per wave; 4 keep 56).
      // HALF = 2 (the residual form's staged rows with a per-token gate, half_batches in launch): quarters, and
      // an epilogue batch of 2: 50-54 registers instead of 62-64 (9 blocks per SM instead of 8); HALF = 2 alone
      // gave 60, the same 8 blocks.
      static_assert(HALF == 2 || HALF == 4, "a residual batch of 2 or 4 vectors");
      constexpr int kHalf = HALF;
#pragma unroll
      for (int j0 = 0; j0 < kBatch; j0 += kHalf) {
        uint2 aw[kHalf], gw[kHalf];
#pragma unroll
        for (int j = 0; j < kHalf; ++j) {
          const int vi = lane + 32 * (kb + j0 + j);
          aw[j] = (VN > 0 || vi < V) ? ar[vi] : make_uint2(0, 0);
          if constexpr (SMEM_MOD)
            gw[j] = (VN > 0 || vi < V) ? sm.gate[vi] : make_uint2(0, 0);
          else
            gw[j] = (VN > 0 || vi < V) ? load4<VEC>(grow + 4 * vi) : make_uint2(0, 0);
        }
#pragma unroll
        for (int j = 0; j < kHalf; ++j) {
          const int vi = lane + 32 * (kb + j0 + j);
          if (VN > 0 || vi < V) {
            xv[j0 + j] = modulate::gated_residual_vec4(xv[j0 + j], aw[j], gw[j]);
            rr[vi] = xv[j0 + j];
            if constexpr (STAGED) sx[vi] = xv[j0 + j];
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (VN > 0 || lane + 32 * (kb + j) < V)
        mean_push_vec4(acc, num::bf16_lo(xv[j].x), num::bf16_hi(xv[j].x), num::bf16_lo(xv[j].y),
                       num::bf16_hi(xv[j].y));
  }
  float s = mean_lane_total(acc);
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) s = mean_tree_step(s, __shfl_down_sync(0xffffffffu, s, o));
  const float rstd = diffusers_rstd(__shfl_sync(0xffffffffu, s, 0), p.factor, p.eps);

  const uint2* src = STAGED ? sx : RESIDUAL ? rr : xr;  // this lane's own vectors: its writes are visible to its reads
  const uint16_t* srow = SMEM_MOD ? nullptr : p.scale + p.scale_rows.offset(row);
  const uint16_t* hrow = SMEM_MOD ? nullptr : p.shift + p.shift_rows.offset(row);
  uint2* orow = reinterpret_cast<uint2*>(p.out + row * p.n);
  // The epilogue in batches of kOutBatch vectors per lane: every load of a batch (x, the weight, scale and shift)
  // before any of its stores. Before (a loop unrolled by 4 with each vector's loads, math and store in turn), the
  // SASS issued each vector's LDGs only after the previous vector's STG (the compiler cannot move a load above a
  // store that may alias it): V / 32 = 24 round trips to L2 per 3072-element row, one after the other. The
  // arithmetic per element is unchanged.
  constexpr int kOutBatch = HALF == 2 ? 2 : 4;  // HALF = 2: see the residual pass above
  static_assert(VN % (32 * kBatch) == 0 && VN % (32 * kOutBatch) == 0, "full-width rows come in whole batches");
  for (int vb = lane; VN > 0 && SMEM_MOD ? vb - lane < VN : vb < V; vb += 32 * kOutBatch) {
    uint2 xw[kOutBatch], ww[kOutBatch], sc[kOutBatch], sh[kOutBatch];
#pragma unroll
    for (int j = 0; j < kOutBatch; ++j) {
      const int vi = vb + 32 * j;
      const bool in = VN > 0 || vi < V;
      xw[j] = in ? src[vi] : make_uint2(0, 0);
      if constexpr (SMEM_MOD) {
        ww[j] = in && (CHAIN ? (CHAIN - 1) & 1 : p.has_w) ? sm.w[vi] : make_uint2(0, 0);
        sc[j] = in ? sm.scale[vi] : make_uint2(0, 0);
        sh[j] = in ? sm.shift[vi] : make_uint2(0, 0);
      } else {
        ww[j] = in && p.has_w ? load4<VEC>(p.w + 4 * vi) : make_uint2(0, 0);
        sc[j] = in ? load4<VEC>(srow + 4 * vi) : make_uint2(0, 0);
        sh[j] = in ? load4<VEC>(hrow + 4 * vi) : make_uint2(0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < kOutBatch; ++j) {
      const int vi = vb + 32 * j;
      if (VN > 0 || vi < V) {
        if constexpr (CHAIN == 0) {
          orow[vi] = make_uint2(rms_modulate_pair(xw[j].x, rstd, p.has_w, ww[j].x, sc[j].x, sh[j].x, p.fp32_mod),
                                rms_modulate_pair(xw[j].y, rstd, p.has_w, ww[j].y, sc[j].y, sh[j].y, p.fp32_mod));
        } else {
          constexpr bool kHasW = (CHAIN - 1) & 1, kFp32Mod = (CHAIN - 1) >> 1;
          orow[vi] = make_uint2(rms_modulate_pair(xw[j].x, rstd, kHasW, ww[j].x, sc[j].x, sh[j].x, kFp32Mod),
                                rms_modulate_pair(xw[j].y, rstd, kHasW, ww[j].y, sc[j].y, sh[j].y, kFp32Mod));
        }
      }
    }
  }
}

// One row per warp (the default), or with STRIDE (DIFUSE_RMSMOD_ROWS_PER_WARP=N >= 2, for measurement; slower on
// the H200, see the header) a grid N times smaller whose warps take rows row, row + 4 gridDim.x, ...: the same
// arithmetic per
// row (two_pass_row), but warps that finish a row start reading the next while others still write, where one
// wave of single-row warps reads together, computes together and writes together.
template <bool VEC, bool RESIDUAL, bool STRIDE = false>
__global__ void __launch_bounds__(kThreads) rms_norm_modulate_two_pass(const Params p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if constexpr (STRIDE) {
    for (int64_t r = row; r < p.rows; r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock)
      two_pass_row<VEC, RESIDUAL>(p, r, lane);
  } else {
    if (row >= p.rows) return;  // whole warp
    two_pass_row<VEC, RESIDUAL>(p, row, lane);
  }
}

// STAGED rows (the default for N <= 3072 since 132f46f's sweep; DIFUSE_RMSMOD_STAGED=1 at every width, =0 never;
// N % 8 == 0, x 16-byte aligned):
// each warp first copies its whole row (h for the residual form) into shared memory with cp.async, every 16-byte
// copy in flight at once, then runs two_pass_row's arithmetic from there. The default kernel reads a row in
// batches of 8 vectors per lane, each batch's loads returning before the next is issued, and re-reads it from
// L1/L2 in pass 2 (ncu at e383706: 0.48 waves, 65 % of cycles with no eligible warp, DRAM 30 %: latency-bound);
// here a row costs one DRAM round trip. 4 rows per block: 24 KB at N = 3072, 9 blocks per SM.
// VN > 0 (with_full_width; the residual form with 8-byte rows and its chain fixed, forty-seventh session): two_pass_row
// tests no vector against V but keeps its loops rolled (V from p), as at VN = 0.
template <bool VEC, bool RESIDUAL, int HALF = 4, int CHAIN = 0, int VN = 0>
__global__ void __launch_bounds__(kThreads) rms_norm_modulate_staged(const Params p) {
  extern __shared__ uint4 staged_rows[];  // kRowsPerBlock rows of V 8-byte vectors
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int wib = static_cast<int>(threadIdx.x) / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + wib;
  if (row >= p.rows) return;  // whole warp (no block barrier follows)
  uint2* sx = reinterpret_cast<uint2*>(staged_rows) + static_cast<int64_t>(wib) * p.v;
  const uint4* gx = reinterpret_cast<const uint4*>(p.x + row * p.n);
  for (int c = lane; c < p.v / 2; c += 32) cp_async(reinterpret_cast<uint4*>(sx) + c, gx + c, true);
  cp_async_wait_all();
  __syncwarp();  // every lane's copies of the row have landed
  two_pass_row<VEC, RESIDUAL, true, HALF, false, false, CHAIN, VN>(p, row, lane, sx);
}

// STAGE_ALL rows (fifty-second session; by default for few rows, rms_stage_all_by_default; 8-byte modulation rows,
// N % 8 == 0, x 16-byte aligned): one warp per block, which copies into shared memory, in one burst of cp.async copies, its x
// (h) row and every other row its arithmetic reads: the residual form's a row and gate row, the weight, the scale and
// the shift rows (V 8-byte words each, in that order after x), then runs two_pass_row's arithmetic with SMEM_A and
// SMEM_MOD from there, as the streamed kernels do with their slots and staged rows. Why: where the rows fit the SMs
// many times over (LTX-2's audio rows, 2x126x2048: 252 rows, 63 blocks of the staged kernel on 132 SMs) each row's
// time is its chain of round trips, not bytes: the staged kernel copies x in one burst but then waits on global
// memory once per batch for the epilogue's scale and shift words (4 batches at N = 2048) and, in the residual form,
// once per half batch for a and the gate (4 more, from DRAM: a is read once). Here a row waits on one burst. The same
// words, the same operations in the same order per lane (two_pass_row). Predicted on the H200: rms_norm_modulate
// 2x126x2048 ltx2 8.0 -> ~6.5 us, the residual form 2x126x2048 ltx2_tokens 11.7 -> ~8.5 (-19 %, -27 %). Measured on an
// H100 at 94 SMs (bench/results/h100/stage-all-a4fd151/): 8.0 -> 6.6-6.7 and 12.7-13.0 -> 9.4-9.6 (-17 %, -26 %).
template <bool RESIDUAL, int CHAIN>
__global__ void __launch_bounds__(32) rms_norm_modulate_staged_all(const Params p) {
  extern __shared__ uint4 staged_rows[];  // x (h), then a, gate (residual form), weight (if any), scale, shift
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const int V = p.v;
  static_assert(CHAIN >= 1 && CHAIN <= 4, "the chain is fixed at compile time (with_chain)");
  constexpr bool kHasW = ((CHAIN - 1) & 1) != 0;  // 1 + has_w + 2 fp32_mod
  uint2* const sx = reinterpret_cast<uint2*>(staged_rows);
  const uint4* gx = reinterpret_cast<const uint4*>(p.x + row * p.n);
  for (int c = lane; c < V / 2; c += 32) cp_async(reinterpret_cast<uint4*>(sx) + c, gx + c, true);
  SmemRows sm;
  uint2* next = sx + V;
  auto stage = [&](const uint16_t* src) {  // one row of V 8-byte words (8-byte aligned: vec, a's rows)
    for (int vi = lane; vi < V; vi += 32) cp_async(next + vi, src + 4 * vi, false);
    const uint2* at = next;
    next += V;
    return at;
  };
  if constexpr (RESIDUAL) {
    sm.a = stage(p.a + p.a_rows.offset(row));
    sm.gate = stage(p.gate + p.gate_rows.offset(row));
  }
  if (kHasW && p.has_w) sm.w = stage(p.w);
  sm.scale = stage(p.scale + p.scale_rows.offset(row));
  sm.shift = stage(p.shift + p.shift_rows.offset(row));
  cp_async_wait_all();
  __syncwarp();  // every lane's copies have landed
  two_pass_row<true, RESIDUAL, true, 4, RESIDUAL, true, CHAIN>(p, row, lane, sx, sm);
}

// PIPELINED staged rows (DIFUSE_RMSMOD_PIPELINED=1, for measurement; where the staged kernel runs): a grid of the
// resident blocks, each warp taking rows row, row + G, ... (G = the grid's warps) with two shared-memory buffers: the
// next row's cp.async copies are issued before the current row's two passes, so they are in flight while it
// computes and stores. The staged kernel's single wave (4096 rows fit the SMs at once) loads every row, then
// computes every row, then stores every row, and DRAM idles in the middle; here one row's compute overlaps the next
// row's loads and the previous row's stores. two_pass_row's arithmetic per row, unchanged. 2 x 4 rows of N elements
// per block (48 KB at N = 3072, 4 blocks and 16 warps per SM).
template <bool VEC, bool RESIDUAL>
__global__ void __launch_bounds__(kThreads) rms_norm_modulate_staged_pipelined(const Params p) {
  extern __shared__ uint4 staged_rows[];  // per warp: two buffers of V 8-byte vectors
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int wib = static_cast<int>(threadIdx.x) / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + wib;
  if (row >= p.rows) return;  // whole warp (no block barrier follows)
  uint2* const buf0 = reinterpret_cast<uint2*>(staged_rows) + static_cast<int64_t>(2 * wib) * p.v;
  uint2* const buf1 = buf0 + p.v;
  const int chunks = p.v / 2;  // 16-byte copies per row
  auto issue = [&](int64_t r, uint2* dst) {
    const uint4* gx = reinterpret_cast<const uint4*>(p.x + r * p.n);
    for (int c = lane; c < chunks; c += 32) cp_async(reinterpret_cast<uint4*>(dst) + c, gx + c, true);
  };
  issue(row, buf0);
  cp_async_commit();
  for (int k = 0; row < p.rows; row += stride, k ^= 1) {
    uint2* const cur = k ? buf1 : buf0;
    if (row + stride < p.rows) issue(row + stride, k ? buf0 : buf1);  // the buffer the previous row used
    cp_async_commit();                                                // (an empty group past the last row)
    cp_async_wait_group<1>();                                         // this row's copies have landed
    __syncwarp();                                                     // every lane's
    two_pass_row<VEC, RESIDUAL, true>(p, row, lane, cur);
    __syncwarp();  // every lane is done with cur before the next iteration refills it
  }
}

template <bool VEC, bool RESIDUAL>
void launch_staged_pipelined(const Params& p, int max_blocks, int device, cudaStream_t stream) {
  auto kernel = rms_norm_modulate_staged_pipelined<VEC, RESIDUAL>;
  const size_t bytes = sizeof(uint16_t) * static_cast<size_t>(2 * kRowsPerBlock) * p.n;  // <= 128 KB (N <= 8160)
  static std::atomic<uint64_t> opted_in{0}, carveout_set{0};
  opt_in_shared_memory(kernel, device, static_cast<int>(sizeof(uint16_t) * 2 * kRowsPerBlock * kMaxWidth), opted_in);
  prefer_max_shared_carveout(kernel, device, carveout_set);
  const int64_t needed = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  int64_t blocks = std::min(needed, resident_blocks(kernel, kThreads, bytes, device));
  if (max_blocks > 1) blocks = std::min<int64_t>(blocks, max_blocks);  // tests: many rows per warp
  kernel<<<static_cast<unsigned>(blocks), kThreads, bytes, stream>>>(p);
}

// STREAMED rows (the plain form's default at N > 3072 and >= 4096 rows, both forms' with staged modulation rows from
// 8192 rows, or from 4096 at N = 3072 (the full-width kernel); DIFUSE_RMSMOD_STREAMED=G, see launch):
// GRLN's streamed schedule (norm/stream_rows.cuh) for these rows. One block per SM;
// warp 0's lane 0 bulk-copies each row's x (h for the residual form) into a ring slot; G consumer warps run
// two_pass_row's staged arithmetic from the slot, one row at a time, unchanged (the residual form's a and gate, and
// the epilogue's weight and modulation, from global memory as in the staged kernel). Why: the staged kernel's rows
// are in phase like GRLN's were (at 4096 rows one wave: every row loads, then computes, then stores) and GRLN's
// streamed kernel went from 1.41x to 1.22x the streaming ceiling; rms_norm_modulate 2x6144x4096 runs 74.6 us
// against 50.5 (ops.json at faab412; site bound 59.0), 4352x2x3072 41.3 against 29.0 (31.4), the residual form
// 2x6144x4096 123.3 against 96.6 (118.1). Predicted ~60-65, ~34-36 and ~110-115 us if the consumers keep up (their
// modulation loads come from L1/L2 per row: GRLN's first version lost for that reason; the sweep tries 8, 16 and 24
// consumer warps). Measured at e831f9c (knob-sweeps/e831f9c/): 69.8 us on 24 warps (75.2 two-pass), 42.8 (40.8
// staged), the residual form 139.7 on 16 (123.6): it wins only where the staged rows do not run, and only without
// the residual pass, whose a and gate loads each consumer still waits on.
constexpr int kRmsStreamMaxWarps = 28;  // consumers; 32 + 32 x 28 = 928 threads
constexpr int kRmsStreamMaxSlots = 48;
// 24 consumer warps: H200 at e831f9c (knob-sweeps/e831f9c/) 2x6144x4096 69.8 us on 24, 79.1 on 16, 95.7 on 8;
// 1x6144x4096 ltx2_tokens 55.8, 57.6, 74.6.
constexpr int kRmsStreamDefaultWarps = 24;
constexpr int64_t kRmsStreamMinRows = 4096;
// With staged weight and modulation rows (SMOD) the streamed rows win from 8192 rows at any width, the residual form
// too: H200 at e7993bf (knob-sweeps/e7993bf/, DIFUSE_RMSMOD_STREAMED=1 with DIFUSE_RMSMOD_STREAM_SMOD=1 against the
// default of the same run) 4352x2x3072 ernie 37.0 us vs 40.6 staged, 2x6144x4096 ltx2 63.9 vs 69.0 streamed without
// them; the residual form 4352x2x3072 66.6 vs 69.5, 2x6144x4096 116.9 vs 122.9. At 4096 rows they lose (1x4096x3072
// 19.4 vs 18.9 staged, the residual form 33.6 vs 32.4): the threshold lies between 4096 and 8704 measured rows.
constexpr int64_t kRmsStreamSmodMinRows = 8192;
// Fiftieth session: where the streamed kernel with staged rows is compiled for N = 3072 (full_width_for's VN = 768,
// both forms; forty-sixth session), it wins from 4096 rows too (numbers in the file's contract above; H100 at 94 SMs,
// bench/results/h100/knob-sweeps-2b64b30/). The e7993bf loss at 4096 rows (above) was the run-time-width kernel.
// Only VN = 768 was timed there: the residual form's VN = 1024 (N = 4096) keeps the 8192-row rule until it is timed
// between 4096 and 8191 rows (no site shape falls there: LTX-2's video rows are 2x6144).
constexpr int64_t kRmsStreamFullWidthMinRows = 4096;

// SMOD (eighteenth session; the default since the nineteenth wherever stream_mod_rows allows it): the block's weight
// row and its at most two distinct scale, shift (and gate) rows are copied into shared memory once, behind the ring
// (StreamModRows: how many of each; a row reads the second where its offset is the second's), so a consumer's
// epilogue reads no global memory but x's slot; the residual form's a row is bulk-copied into the slot beside h
// (always, SMOD or not: its per-row a loads from global memory were what the residual form waited on at e831f9c).
// Why: GRLN's streamed kernel went from 44.2 to 34.2 us at 1x4096x3072 when its gate and modulation rows were staged
// per block instead of loaded per row. Predicted the plain form 69.1 -> ~60 us at 2x6144x4096 and 42.8 -> ~34 at
// 4352x2x3072, the residual form 139.7 -> ~110 at 2x6144x4096; measured at e7993bf (knob-sweeps/e7993bf/) 63.9, 37.0
// and 116.9: the consumers no longer wait on L2 for modulation rows, but a 50.5 us ceiling at 2x6144x4096 is still
// 13 us away. DIFUSE_RMSMOD_STREAM_SMOD=0 (read once; for measurement) keeps them in global memory, =1 is the default.
struct StreamModRows {
  int nw = 0, ns = 0, nh = 0, ng = 0;  // staged rows per role: weight 0 or 1; scale, shift, gate 1 or 2
  int64_t s1 = 0, h1 = 0, g1 = 0;      // the second staged row's offset (elements) per role, where there are two
  bool read_fence = true;              // the plain form's proxy fence before each release (stream_read_fence_knob)
  int producer_lanes = 1;              // stream_produce's lanes (DIFUSE_STREAM_PRODUCER_LANES, stream_producer_lanes)
  int full_barriers = 2;               // `full` mbarriers per slot (stream_full_barriers_for)
};

// Twenty-first session (846df26): the streamed kernels' ring has two `full` mbarriers per slot (norm/stream_rows.cuh:
// one let a consumer read a slot early where the slots are not a multiple of the groups, e.g. 24 warps and a ring
// of 37 slots, and the probe's ring of that shape hung); their arithmetic is unchanged, and they ran exact with it
// in the whole suite at 97817d7 (tests.json: 3,384 passed, 0 failed, 0 skipped); one per slot where the slots are a
// multiple of the warps only under DIFUSE_STREAM_FULL_BARRIERS=1 (twenty-fourth session; GPU tests pass at 5d3eadf).
// DIFUSE_STREAM_PRODUCER_LANES (knob) since fc63727 (racecheck clean with 4 lanes at 45a2975; not timed on this op).
template <bool VEC, bool RESIDUAL, bool SMOD = false, int CHAIN = 0, int VN = 0>
__global__ void __launch_bounds__(32 + 32 * kRmsStreamMaxWarps, 1)
    rms_norm_modulate_streamed(const Params p, int slots, const StreamModRows m) {
  // slot s: V 8-byte vectors of x (h) at s SV, the residual form's a row after them; the staged rows after the ring
  extern __shared__ uint4 staged_rows[];
  __shared__ uint64_t full[2 * kRmsStreamMaxSlots], empty[kRmsStreamMaxSlots];
  const int tid = static_cast<int>(threadIdx.x);
  const int V = VN > 0 ? VN : p.v;  // VN: the launcher's p.v, as a constant
  const int SV = RESIDUAL ? 2 * V : V;
  const uint32_t row_bytes = static_cast<uint32_t>(p.n) * 2u;
  uint2* const ring = reinterpret_cast<uint2*>(staged_rows);
  stream_init_barriers(full, empty, slots, 32);  // the only block barrier
  if (tid < 32) {  // the producer warp: its first m.producer_lanes lanes (1 by default)
    if (tid < m.producer_lanes)
      stream_produce(
          p.rows, slots, full, empty, m.full_barriers,
          [&](int64_t row, int s, uint64_t* bar) {
            detail::mbar_arrive_expect_tx(bar, RESIDUAL ? 2 * row_bytes : row_bytes);
            detail::bulk_load(ring + static_cast<int64_t>(s) * SV, p.x + row * p.n, row_bytes, bar);
            if constexpr (RESIDUAL)
              detail::bulk_load(ring + static_cast<int64_t>(s) * SV + V, p.a + p.a_rows.offset(row), row_bytes, bar);
          },
          m.producer_lanes);
    return;
  }
  const int c = tid / 32 - 1, lane = tid % 32;
  const int groups = static_cast<int>(blockDim.x) / 32 - 1;
  uint2* const mod = ring + static_cast<int64_t>(slots) * SV;
  if constexpr (SMOD) {  // the consumers copy the staged rows (8-byte words) while the producer's first copies fly
    const int ng = RESIDUAL ? m.ng : 0, n = (m.nw + m.ns + m.nh + ng) * V;
    for (int t = tid - 32; t < n; t += 32 * groups) {
      const int k = t / V, vi = t - k * V;
      const uint16_t* src = k < m.nw                 ? p.w
                            : k < m.nw + m.ns        ? p.scale + (k - m.nw) * m.s1
                            : k < m.nw + m.ns + m.nh ? p.shift + (k - m.nw - m.ns) * m.h1
                                                     : p.gate + (k - m.nw - m.ns - m.nh) * m.g1;
      cp_async(mod + t, src + 4 * vi, false);
    }
    cp_async_wait_all();
    asm volatile("bar.sync 15, %0;" ::"r"(32 * groups) : "memory");  // every consumer's copies have landed
  }
  const int64_t stride = gridDim.x;
  int s = c % slots;
  uint32_t use = static_cast<uint32_t>(c / slots);
  for (int64_t row = blockIdx.x + c * stride; row < p.rows; row += groups * stride) {
    stream_wait_full(full, s, use, m.full_barriers);
    uint2* const sx = ring + static_cast<int64_t>(s) * SV;
    SmemRows sm;
    sm.a = RESIDUAL ? sx + V : nullptr;
    if constexpr (SMOD) {
      const int si = m.ns == 2 && p.scale_rows.offset(row) == m.s1 ? 1 : 0;
      const int hi = m.nh == 2 && p.shift_rows.offset(row) == m.h1 ? 1 : 0;
      sm.w = mod;
      sm.scale = mod + static_cast<int64_t>(m.nw + si) * V;
      sm.shift = mod + static_cast<int64_t>(m.nw + m.ns + hi) * V;
      if constexpr (RESIDUAL) {
        const int gi = m.ng == 2 && p.gate_rows.offset(row) == m.g1 ? 1 : 0;
        sm.gate = mod + static_cast<int64_t>(m.nw + m.ns + m.nh + gi) * V;
      }
    }
    two_pass_row<VEC, RESIDUAL, true, 4, RESIDUAL, SMOD, CHAIN, VN>(p, row, lane, sx, sm);
    stream_release(empty, s, use, groups, slots, RESIDUAL || m.read_fence);  // the residual form wrote h1 there
  }
}

// DIFUSE_RMSMOD_STREAMED=G (read once): G consumer warps (1: kRmsStreamDefaultWarps; at most kRmsStreamMaxWarps and
// the ring's slots); DIFUSE_RMSMOD_STREAMED_BLOCKS=N caps the grid (tests: many rows per block). With m's staged rows
// (SMOD) the ring takes what they leave. False (nothing launched) where the ring would hold fewer than two rows.
StreamModRows with_knobs(StreamModRows m, int slots, int warps) {
  m.read_fence = stream_read_fence_knob();
  m.producer_lanes = stream_producer_lanes(stream_producer_lanes_knob(), slots, warps);
  m.full_barriers = stream_full_barriers_for(slots, warps);
  return m;
}

template <bool VEC, bool RESIDUAL, bool SMOD, int CHAIN = 0, int VN = 0>
bool launch_streamed(const Params& p, const StreamModRows& m, int knob, int device, cudaStream_t stream) {
  auto kernel = rms_norm_modulate_streamed<VEC, RESIDUAL, SMOD, CHAIN, VN>;
  static std::atomic<int> budgets[detail::kMaxDevices];
  static std::atomic<uint64_t> opted_in{0}, carveout_set{0};
  const int budget = stream_smem_budget(kernel, device, budgets);
  const int64_t slot_bytes = int64_t{RESIDUAL ? 4 : 2} * p.n;
  const int64_t mod_bytes = SMOD ? int64_t{m.nw + m.ns + m.nh + (RESIDUAL ? m.ng : 0)} * 2 * p.n : 0;
  static const int max_blocks = detail::positive_env_knob("DIFUSE_RMSMOD_STREAMED_BLOCKS");
  const StreamWarpLaunch l = stream_warp_launch(budget, mod_bytes, slot_bytes, kRmsStreamMaxSlots, knob,
                                                kRmsStreamDefaultWarps, kRmsStreamMaxWarps, p.rows, device, max_blocks);
  if (!l.ok()) return false;
  opt_in_shared_memory(kernel, device, budget, opted_in);
  prefer_max_shared_carveout(kernel, device, carveout_set);
  kernel<<<static_cast<unsigned>(l.blocks), l.threads(), static_cast<size_t>(l.slots * slot_bytes + mod_bytes),
           stream>>>(p, l.slots, with_knobs(m, l.slots, l.warps));
  return true;
}

// Full width at compile time (forty-sixth session): the streamed kernels with staged rows at N = 3072 (V = 768 vectors
// of 4, a lane's 24 in three mean batches of 8 and six epilogue batches of 4: ERNIE-Image's 3072 and LTX-2's audio-free
// 3072 sites) are instantiated with VN = 768, so two_pass_row's loops run constant trip counts and no vector is tested
// against V. The same operations in the same order per lane. Why: at 4352x2x3072 (ERNIE) each row's mean loop ran 175
// SASS instructions per batch of 8 vectors, 80 of them the pushes and their unpacking, the rest the per-vector tests
// (ISETP, BSSY / BSYNC), zero fills (CS2R) and index arithmetic; the epilogue 274 per 4 vectors with the same. The
// kernels with VN = 0 compile to the same SASS as before. DIFUSE_RMSMOD_FULL_WIDTH=0 (read once; for measurement)
// keeps the run-time kernels.
// Since the forty-seventh session the residual form's at N = 4096 too (V = 1024: LTX-2's video rows, 2x6144x4096), where
// the H100 (94 SMs) had the residual form 7 % faster at 3072 (86.9 vs 92.2 us at 4352x2x3072) and the plain form no
// faster (47.1 vs 47.9): 4 kernels, residual only.
constexpr int kFullWidthV = 768;
constexpr int kFullWidthResidualV = 1024;
int full_width_for(const Params& p, bool residual) {
  static const int knob = detail::env_knob_or("DIFUSE_RMSMOD_FULL_WIDTH", 1);
  if (knob == 0) return 0;
  return p.v == kFullWidthV ? kFullWidthV : residual && p.v == kFullWidthResidualV ? kFullWidthResidualV : 0;
}

// f(std::integral_constant<int, VN>{}) with the full-width VN of the kernel for these rows (0: the run-time width):
// the streamed kernels with staged rows take 768 (both forms) and 1024 (the residual form); the staged kernels with
// 8-byte rows only the residual form's 768 (STAGED; the plain form's ran slower on an H100, forty-seventh session).
template <bool RESIDUAL, bool STAGED, class F>
decltype(auto) with_full_width(const Params& p, F&& f) {
  const int vn = full_width_for(p, RESIDUAL);
  if constexpr (RESIDUAL || !STAGED) {
    if (vn == kFullWidthV) return f(std::integral_constant<int, kFullWidthV>{});
  }
  if constexpr (RESIDUAL && !STAGED) {
    if (vn == kFullWidthResidualV) return f(std::integral_constant<int, kFullWidthResidualV>{});
  }
  return f(std::integral_constant<int, 0>{});
}

// The staged rows of SMOD where every role has at most two distinct rows and the weight and modulation rows are
// 8-byte words (vec); false (per-token rows, B > 2, unaligned rows): the streamed kernel reads them from global memory.
bool stream_mod_rows(const Params& p, bool vec, StreamModRows& m) {
  if (!vec) return false;
  int64_t o[2];
  m.nw = p.has_w ? 1 : 0;
  m.ns = staged_row_offsets(p.scale_rows, p.rows, o);
  m.s1 = o[1];
  m.nh = staged_row_offsets(p.shift_rows, p.rows, o);
  m.h1 = o[1];
  m.ng = p.gate == nullptr ? 0 : staged_row_offsets(p.gate_rows, p.rows, o);  // the plain form has no gate
  m.g1 = p.gate == nullptr ? 0 : o[1];
  return m.ns > 0 && m.nh > 0 && (p.gate == nullptr || m.ng > 0);
}

// The staged kernel, its shared-memory opt-in and carveout set (once per device), and its dynamic shared memory
// for this row width: what a launch and an occupancy query of it both need.
template <bool VEC, bool RESIDUAL, int HALF, int CHAIN = 0, int VN = 0>
auto prepared_staged(const Params& p, int device, size_t& bytes) {
  auto kernel = rms_norm_modulate_staged<VEC, RESIDUAL, HALF, CHAIN, VN>;
  bytes = sizeof(uint16_t) * static_cast<size_t>(kRowsPerBlock) * p.n;  // <= 64 KB (N <= 8160)
  static std::atomic<uint64_t> opted_in{0}, carveout_set{0};
  opt_in_shared_memory(kernel, device, static_cast<int>(sizeof(uint16_t) * kRowsPerBlock * kMaxWidth), opted_in);
  prefer_max_shared_carveout(kernel, device, carveout_set);
  return kernel;
}

template <bool VEC, bool RESIDUAL, int HALF = 4, int CHAIN = 0, int VN = 0>
void launch_staged(const Params& p, unsigned blocks, int device, cudaStream_t stream) {
  size_t bytes = 0;
  auto kernel = prepared_staged<VEC, RESIDUAL, HALF, CHAIN, VN>(p, device, bytes);
  kernel<<<blocks, kThreads, bytes, stream>>>(p);
}

// f(std::integral_constant<int, CHAIN>{}) with two_pass_row's CHAIN for these parameters (1 + has_w + 2 fp32_mod):
// the one place the run-time chain becomes a kernel's template argument.
template <class F>
decltype(auto) with_chain(const Params& p, F&& f) {
  switch (1 + (p.has_w ? 1 : 0) + (p.fp32_mod ? 2 : 0)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// The staged kernel with 8-byte rows (VEC) and its chain fixed at compile time; the residual form's at N = 3072 with
// its width too (with_full_width).
template <bool RESIDUAL, int HALF = 4>
void launch_staged_chain(const Params& p, unsigned blocks, int device, cudaStream_t stream) {
  with_chain(p, [&](auto chain) {
    with_full_width<RESIDUAL, true>(p, [&](auto vn) {
      launch_staged<true, RESIDUAL, HALF, decltype(chain)::value, decltype(vn)::value>(p, blocks, device, stream);
    });
  });
}

// The STAGE_ALL kernel for p's chain (vec rows only), its shared-memory opt-in and carveout set (once per device), and
// its dynamic shared memory: the rows it stages (x, a and gate for the residual form, the weight where there is one,
// scale and shift: <= 96 KB at N = 8160). f(kernel, bytes): what a launch and an occupancy query both need.
template <bool RESIDUAL, class F>
decltype(auto) with_staged_all(const Params& p, int device, F&& f) {
  const size_t bytes = sizeof(uint16_t) * static_cast<size_t>(p.n) * (3 + (RESIDUAL ? 2 : 0) + (p.has_w ? 1 : 0));
  return with_chain(p, [&](auto chain) {
    auto kernel = rms_norm_modulate_staged_all<RESIDUAL, decltype(chain)::value>;
    static std::atomic<uint64_t> opted_in{0}, carveout_set{0};
    opt_in_shared_memory(kernel, device, static_cast<int>(sizeof(uint16_t) * 6 * kMaxWidth), opted_in);
    prefer_max_shared_carveout(kernel, device, carveout_set);
    return f(kernel, bytes);
  });
}

// One block of one warp per row.
template <bool RESIDUAL>
void launch_staged_all(const Params& p, int device, cudaStream_t stream) {
  with_staged_all<RESIDUAL>(p, device, [&](auto kernel, size_t bytes) {
    kernel<<<static_cast<unsigned>(p.rows), 32, bytes, stream>>>(p);
  });
}

// The STAGE_ALL kernel's one-warp blocks resident on the device at once, at this row width's shared memory.
template <bool RESIDUAL>
int64_t staged_all_resident(const Params& p, int device) {
  return with_staged_all<RESIDUAL>(p, device,
                                   [&](auto kernel, size_t bytes) { return resident_blocks(kernel, 32, bytes, device); });
}

// Blocks of the residual staged kernel (HALF) resident at once on the device, at this row width's shared memory
// (VEC: the kernel of p's chain and width, the one launch_staged_chain runs).
template <bool VEC, int HALF>
int64_t staged_resident(const Params& p, int device) {
  size_t bytes = 0;
  if constexpr (VEC) {
    return with_chain(p, [&](auto chain) {
      return with_full_width<true, true>(p, [&](auto vn) {
        return resident_blocks(prepared_staged<true, true, HALF, decltype(chain)::value, decltype(vn)::value>(
                                   p, device, bytes),
                               kThreads, bytes, device);
      });
    });
  } else {
    auto kernel = prepared_staged<false, true, HALF>(p, device, bytes);
    return resident_blocks(kernel, kThreads, bytes, device);
  }
}

template <int K, bool RESIDUAL>
void launch_k(const Params& p, bool vec, unsigned blocks, cudaStream_t stream) {
  if (vec)
    rms_norm_modulate_rows<K, true, RESIDUAL><<<blocks, kThreads, 0, stream>>>(p);
  else
    rms_norm_modulate_rows<K, false, RESIDUAL><<<blocks, kThreads, 0, stream>>>(p);
}

template <bool RESIDUAL>
void launch(const Params& p, bool vec, int device, cudaStream_t stream) {
  const detail::DeviceGuard device_guard(device);
  const unsigned blocks = static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  // Rows of N >= 128 in two passes over global memory by default (32-48 registers instead of 120). H200 at
  // 5fa0c2a (knob-sweeps/): 1x4096x3072 ltx2 24.7 us vs 32.9 register-resident, 1x6144x4096 ltx2_tokens 65.4 vs
  // 82.4, the residual form 1x4096x3072 45.0 vs 62.4 (no shape slower by more than noise).
  // DIFUSE_RMSMOD_ONE_PASS=1 (for measurement) keeps the register-resident kernels.
  static const int one_pass = detail::positive_env_knob("DIFUSE_RMSMOD_ONE_PASS");
  static const int rows_per_warp = detail::positive_env_knob("DIFUSE_RMSMOD_ROWS_PER_WARP");
  // Staged rows: the default up to N = 3072 (H200 at 132f46f, knob-sweeps/: 1x4096x3072 ltx2 22.9 us vs 24.1 two-pass,
  // 4352x2x3072 ernie 46.8 vs 53.1, the residual form 38.9 vs 44.4), not above (2x6144x4096 94.5 vs 86.6, the
  // residual form 169.9 vs 150.3: 32 KB per block there, 7 blocks per SM). DIFUSE_RMSMOD_STAGED=1 (for measurement)
  // stages every width it can, =0 none.
  static const int staged = detail::env_knob_or("DIFUSE_RMSMOD_STAGED", -1);
  const bool stage_rows = staged == 1 || (staged != 0 && p.n <= 3072);
  // DIFUSE_RMSMOD_PIPELINED=1 (for measurement): the staged rows on a grid of the resident blocks, two buffers per
  // warp, the next row's copies in flight while the current one computes and stores (rms_norm_modulate_staged_pipelined);
  // =N >= 2 caps the grid at N blocks (tests, the sanitizer: many rows per warp at small shapes).
  // Predicted 1x4096x3072 22.7 -> ~19 us: ~6 us of the staged kernel's time is its one wave computing with DRAM idle.
  static const int pipelined = detail::positive_env_knob("DIFUSE_RMSMOD_PIPELINED");
  // The residual form's staged rows with a per-token gate (a gate row per row: ERNIE-Image's ernie_tokens, LTX-2's
  // per-token views) load a and the gate 2 vectors at a time and batch their epilogue by 2 (HALF = 2 above; 54
  // registers instead of 64: 9 blocks per SM instead of 8) where that saves a wave (residual_quarter_batches), the
  // default since the twelfth session. H200 (DIFUSE_RMSMOD_RESIDUAL_HALF=2|4 against ops.json of the same runs,
  // knob-sweeps/edec152/ and c14c296/): 4352x1x3072 ernie_tokens 53.7 us vs 59.0-59.9 (predicted ~57: 4,352 rows in
  // one wave of 4,752 instead of 4,224 + 128); in one wave either way it loses: 2x126x2048 ltx2_tokens 16.2 vs 11.7,
  // 1x4096x3072 ltx2 35.1 vs 31.8; and with [B, H] gates even where it saves a wave: 4352x2x3072 ernie 71.6 vs
  // 70.2. DIFUSE_RMSMOD_RESIDUAL_HALF=2 (for measurement) takes HALF = 2 for every staged residual row, =4 never.
  static const int residual_half = detail::env_knob_or("DIFUSE_RMSMOD_RESIDUAL_HALF", -1);
  auto half_batches = [&](bool v) {
    if (!RESIDUAL || residual_half == 4) return false;
    if (residual_half == 2) return true;
    if (!p.gate_rows.every_row_distinct(p.rows)) return false;  // [B, H] gates keep 4
    const int64_t full = v ? staged_resident<true, 4>(p, device) : staged_resident<false, 4>(p, device);
    if (blocks <= full) return false;  // one wave already: no occupancy query of the other kernel
    const int64_t quarter = v ? staged_resident<true, 2>(p, device) : staged_resident<false, 2>(p, device);
    return residual_quarter_batches(true, blocks, quarter, full);
  };
  // Streamed rows by default (rms_streamed_by_default) where no measurement knob forces another kernel
  // (DIFUSE_RMSMOD_STAGED, _PIPELINED, _ONE_PASS, _ROWS_PER_WARP, _RESIDUAL_HALF): the plain form for at least
  // kRmsStreamMinRows rows wider than 3072, since the eighteenth session (H200 at e831f9c, knob-sweeps/e831f9c/, against
  // the default of the same run: 1x6144x4096 ltx2_tokens 55.8 us on 24 warps vs 65.4 two-pass, 2x6144x4096 ltx2 69.8
  // vs 75.2; without staged modulation rows it lost where the staged rows run, 1x4096x3072 22.5 vs 18.9, 4352x2x3072
  // 42.8 vs 40.8, and so did the residual form everywhere, 2x6144x4096 139.7 vs 123.6 on 16 warps), and both forms for
  // at least kRmsStreamSmodMinRows rows with staged modulation rows (SMOD), since the nineteenth, and from
  // kRmsStreamFullWidthMinRows such rows where the full-width kernel at N = 3072 runs (full_width_for), since the fiftieth. DIFUSE_RMSMOD_STREAMED=G
  // everywhere it can run (G consumer warps; 1: kRmsStreamDefaultWarps), =0 nowhere.
  static const int streamed_knob = detail::env_knob_or("DIFUSE_RMSMOD_STREAMED", -1);
  static const int stream_smod = detail::env_knob_or("DIFUSE_RMSMOD_STREAM_SMOD", -1);
  StreamModRows m;
  const bool smod = stream_smod != 0 && stream_mod_rows(p, vec, m);
  const bool other_kernel_knob = staged >= 0 || pipelined != 0 || one_pass == 1 || rows_per_warp >= 2 ||
                                 (RESIDUAL && residual_half >= 0);
  // STAGE_ALL rows by default (fifty-second session; rms_stage_all_by_default: at most kRmsStageAllMaxRows rows whose
  // one-warp blocks are all resident at once) where no measurement knob forces another kernel (the ones above and
  // DIFUSE_RMSMOD_STREAMED); H100 at 94 SMs (bench/results/h100/stage-all-a4fd151/, DIFUSE_RMSMOD_STAGE_ALL=1 against
  // the default of the same build, alternated twice): 2x126x2048 ltx2 6.6-6.7 us vs 8.0, the residual form's
  // ltx2_tokens 9.4-9.6 vs 12.7-13.0; with more rows than fit at once it lost (1x4096x3072 30.5 vs 24.0, 4352x1x3072
  // ernie_tokens 47.7 vs 43.7; the residual form 55.2 vs 42.5 and 80.4 vs 72.8). DIFUSE_RMSMOD_STAGE_ALL=1 (read once;
  // for measurement) everywhere it can run (8-byte modulation rows, N % 8 == 0, x 16-byte aligned), =0 nowhere.
  // The row bound is tested before the rule so that more rows make no occupancy query.
  static const int stage_all = detail::env_knob_or("DIFUSE_RMSMOD_STAGE_ALL", -1);
  if (stage_all != 0 && vec && rms_norm_modulate_lane_vectors(p.n) != 0 && p.n % 8 == 0 && detail::aligned(p.x, 16) &&
      (stage_all == 1 || (!other_kernel_knob && streamed_knob < 0 && p.rows <= kRmsStageAllMaxRows &&
                          rms_stage_all_by_default(p.rows, staged_all_resident<RESIDUAL>(p, device))))) {
    launch_staged_all<RESIDUAL>(p, device, stream);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int streamed = streamed_knob >= 0                                                       ? streamed_knob
                       : !other_kernel_knob &&
                               rms_streamed_by_default(RESIDUAL, p.n, p.rows, smod, full_width_for(p, RESIDUAL))
                           ? 1
                           : 0;
  if (streamed > 0 && one_pass != 1 && rows_per_warp < 2 && rms_norm_modulate_lane_vectors(p.n) != 0 &&
      p.n % 8 == 0 && detail::aligned(p.x, 16) && (!RESIDUAL || p.a_rows16)) {  // whole rows bulk-copied
    if (smod ? with_chain(p, [&](auto chain) {
                 return with_full_width<RESIDUAL, false>(p, [&](auto vn) {
                   return launch_streamed<true, RESIDUAL, true, decltype(chain)::value, decltype(vn)::value>(
                       p, m, streamed, device, stream);
                 });
               })
             : vec ? launch_streamed<true, RESIDUAL, false>(p, m, streamed, device, stream)
                   : launch_streamed<false, RESIDUAL, false>(p, m, streamed, device, stream)) {
      DIFUSE_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  if (stage_rows && one_pass != 1 && rows_per_warp < 2 && rms_norm_modulate_lane_vectors(p.n) != 0 &&
      p.n % 8 == 0 && detail::aligned(p.x, 16)) {  // N >= 128, rows copied in 16-byte pieces
    if (pipelined >= 1 && vec)
      launch_staged_pipelined<true, RESIDUAL>(p, pipelined, device, stream);
    else if (pipelined >= 1)
      launch_staged_pipelined<false, RESIDUAL>(p, pipelined, device, stream);
    else if (half_batches(vec))
      vec ? launch_staged_chain<true, 2>(p, blocks, device, stream)
          : launch_staged<false, true, 2>(p, blocks, device, stream);
    else if (vec)
      launch_staged_chain<RESIDUAL>(p, blocks, device, stream);
    else
      launch_staged<false, RESIDUAL>(p, blocks, device, stream);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (one_pass != 1 && rms_norm_modulate_lane_vectors(p.n) != 0 && rows_per_warp >= 2) {  // N >= 128, strided
    const unsigned strided = static_cast<unsigned>(
        (p.rows + int64_t{kRowsPerBlock} * rows_per_warp - 1) / (int64_t{kRowsPerBlock} * rows_per_warp));
    if (vec)
      rms_norm_modulate_two_pass<true, RESIDUAL, true><<<strided, kThreads, 0, stream>>>(p);
    else
      rms_norm_modulate_two_pass<false, RESIDUAL, true><<<strided, kThreads, 0, stream>>>(p);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (one_pass != 1 && rms_norm_modulate_lane_vectors(p.n) != 0) {  // N >= 128
    if (vec)
      rms_norm_modulate_two_pass<true, RESIDUAL><<<blocks, kThreads, 0, stream>>>(p);
    else
      rms_norm_modulate_two_pass<false, RESIDUAL><<<blocks, kThreads, 0, stream>>>(p);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  switch (rms_norm_modulate_lane_vectors(p.n)) {
    case 0: rms_norm_modulate_narrow<RESIDUAL><<<blocks, kThreads, 0, stream>>>(p); break;
    case 8: launch_k<8, RESIDUAL>(p, vec, blocks, stream); break;
    case 16: launch_k<16, RESIDUAL>(p, vec, blocks, stream); break;
    case 24: launch_k<24, RESIDUAL>(p, vec, blocks, stream); break;
    case 32: launch_k<32, RESIDUAL>(p, vec, blocks, stream); break;
    case 48: launch_k<48, RESIDUAL>(p, vec, blocks, stream); break;
    case 64: launch_k<64, RESIDUAL>(p, vec, blocks, stream); break;
    default: throw detail::Failure(DIFUSE_ERR_INTERNAL, "rms_norm_modulate: no kernel for N = " + std::to_string(p.n));
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool rms_streamed_by_default(bool residual, int64_t n, int64_t rows, bool staged_mod_rows, int full_width_v) {
  const int64_t smod_min_rows = full_width_v == kFullWidthV ? kRmsStreamFullWidthMinRows : kRmsStreamSmodMinRows;
  if (staged_mod_rows && rows >= smod_min_rows) return true;
  return !residual && n > 3072 && rows >= kRmsStreamMinRows;
}

bool rms_stage_all_by_default(int64_t rows, int64_t resident) {
  return rows > 0 && rows <= kRmsStageAllMaxRows && resident > 0 && rows <= resident;
}

bool residual_quarter_batches(bool per_token_gate, int64_t blocks, int64_t resident_quarter, int64_t resident_default) {
  if (!per_token_gate || blocks <= 0 || resident_quarter <= 0 || resident_default <= 0) return false;
  const int64_t waves_quarter = (blocks + resident_quarter - 1) / resident_quarter;
  const int64_t waves_default = (blocks + resident_default - 1) / resident_default;
  return waves_quarter < waves_default;
}

detail::RowIndexer broadcast_row_indexer(const difuse_tensor_view& m, const difuse_tensor_view& x) {
  int64_t sz[3] = {1, 1, 1}, st[3] = {0, 0, 0};
  for (int d = x.rank - 2, k = 2; d >= 0 && k >= 0; --d, --k) {
    const int md = d - (x.rank - m.rank);
    sz[k] = x.sizes[d];
    st[k] = (md >= 0 && m.sizes[md] != 1) ? m.strides[md] : 0;
  }
  detail::RowIndexer r;
  r.d1 = sz[1];
  r.d2 = sz[2];
  r.s0 = st[0];
  r.s1 = st[1];
  r.s2 = st[2];
  return r;
}

int staged_row_offsets(const detail::RowIndexer& r, int64_t rows, int64_t offsets[2]) {
  offsets[0] = 0;
  offsets[1] = 0;
  if (rows <= 0 || r.d1 <= 0 || r.d2 <= 0) return 0;
  const int64_t sizes[3] = {(rows + r.d1 * r.d2 - 1) / (r.d1 * r.d2), r.d1, r.d2};
  const int64_t strides[3] = {r.s0, r.s1, r.s2};
  int count = 1;
  for (int d = 0; d < 3; ++d) {
    if (sizes[d] <= 1 || strides[d] == 0) continue;  // a dim that does not move the row
    if (count > 1 || sizes[d] > 2) return 0;
    count = 2;
    offsets[1] = strides[d];
  }
  return count;
}

namespace {

// Every row of m starts 8-byte aligned (the data pointer and each stride that moves).
bool rows_aligned8(const difuse_tensor_view& m) { return detail::rows_aligned(m, 8); }

bool present(const difuse_tensor_view& v) { return v.data != nullptr || v.rank != 0; }

// A bf16 view that broadcasts to x under torch's rules with N as its contiguous last dim.
void require_broadcast_rows(detail::Support& s, const difuse_tensor_view& m, const difuse_tensor_view& x,
                            const char* name, bool empty) {
  const std::string n(name);
  DIFUSE_REQUIRE(s, m.dtype == DIFUSE_BF16,
                 n + " must be bf16 (an fp32 " + n + " is another chain), got " + difuse_dtype_name(m.dtype));
  DIFUSE_REQUIRE(s, m.device == x.device, n + " must be on the device of x, got " + detail::describe(m));
  bool shape_ok = m.rank >= 1 && m.rank <= x.rank;
  for (int d = 0; shape_ok && d < m.rank; ++d) {
    const int64_t xs = x.sizes[x.rank - m.rank + d];
    shape_ok = m.sizes[d] == xs || (m.sizes[d] == 1 && d + 1 < m.rank);
  }
  std::string xshape;
  for (int d = 0; d < x.rank; ++d) xshape += (d ? ", " : "") + std::to_string(x.sizes[d]);
  DIFUSE_REQUIRE(s, shape_ok, n + " must broadcast to x's shape [" + xshape +
                                  "] (torch's rules, right-aligned, the last dim equal), got " + detail::describe(m));
  if (m.rank >= 1) {
    DIFUSE_REQUIRE(s, m.strides[m.rank - 1] == 1 || m.sizes[m.rank - 1] <= 1,
                   n + " must have a contiguous last dim (stride 1), got " + detail::describe(m));
    bool nonneg = true;
    for (int d = 0; d < m.rank; ++d) nonneg = nonneg && m.strides[d] >= 0;
    DIFUSE_REQUIRE(s, nonneg, n + " must have non-negative strides, got " + detail::describe(m));
  }
  if (!empty) DIFUSE_REQUIRE(s, m.data != nullptr, n + " has a null data pointer");
}

// The checks on x (or h) and the width/row configuration; false when x's rank is unusable.
bool require_rows(detail::Support& s, const difuse_tensor_view& x, const char* name) {
  const std::string nm(name);
  if (!detail::require_bf16_row_view(s, x, name)) return false;
  const int64_t N = x.sizes[x.rank - 1];
  const int64_t total = detail::numel(x);
  const int64_t rows = N ? total / N : 0;
  DIFUSE_REQUIRE(s, detail::is_contiguous(x), nm + " must be contiguous, got " + detail::describe(x));
  DIFUSE_REQUIRE(s, N >= 32 && N <= kMaxWidth,
                 "the normalized width must be in [32, 8160] (aten's mean then runs one warp per row), got " +
                     std::to_string(N));
  DIFUSE_REQUIRE(s, rows >= 16 || total == 0,
                 "at least 16 rows are needed (fewer change aten's mean block shape, which is not replayed), got " +
                     std::to_string(rows));
  DIFUSE_REQUIRE(s, N < 128 || N % 4 == 0,
                 "a width of 128 or more must be a multiple of 4 (aten's vectorized mean over misaligned rows is not "
                 "replayed), got " + std::to_string(N));
  DIFUSE_REQUIRE(s, total <= int64_t{2147483647}, "at most 2^31 - 1 elements (aten splits larger reductions)");
  if (total > 0) {
    DIFUSE_REQUIRE(s, x.data != nullptr, nm + " has a null data pointer");
    if (N >= 128 && N % 4 == 0)
      DIFUSE_REQUIRE(s, detail::aligned(x.data, 8), nm + " must be 8-byte aligned, got " + detail::describe(x));
  }
  return true;
}

void require_weight(detail::Support& s, const difuse_tensor_view& weight, const difuse_tensor_view& x) {
  if (!present(weight)) return;
  const int64_t N = x.sizes[x.rank - 1];
  DIFUSE_REQUIRE(s, weight.dtype == DIFUSE_BF16,
                 std::string("weight must be bf16 (an fp32 weight multiplies in fp32: another chain), got ") +
                     difuse_dtype_name(weight.dtype));
  DIFUSE_REQUIRE(s, weight.rank == 1 && weight.sizes[0] == N && weight.strides[0] == 1,
                 "weight must be a contiguous [" + std::to_string(N) + "], got " + detail::describe(weight));
  DIFUSE_REQUIRE(s, weight.device == x.device, "weight must be on the device of x, got " + detail::describe(weight));
  if (detail::numel(x) > 0) DIFUSE_REQUIRE(s, weight.data != nullptr, "weight has a null data pointer");
}

Params make_params(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                   const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps, int fp32_modulate) {
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.has_w = present(weight);
  p.w = p.has_w ? static_cast<const uint16_t*>(weight.data) : nullptr;
  p.scale = static_cast<const uint16_t*>(scale.data);
  p.shift = static_cast<const uint16_t*>(shift.data);
  p.n = static_cast<int>(x.sizes[x.rank - 1]);
  p.v = p.n / 4;
  p.rows = detail::numel(x) / p.n;
  p.scale_rows = broadcast_row_indexer(scale, x).prepare(p.rows);
  p.shift_rows = broadcast_row_indexer(shift, x).prepare(p.rows);
  p.eps = static_cast<float>(eps);
  p.factor = diffusers_mean_factor(p.rows, p.n);
  p.fp32_mod = fp32_modulate != 0;
  return p;
}

}  // namespace

int rms_norm_modulate_lane_vectors(int64_t n) {
  if (n < 128) return 0;
  const int64_t per_lane = (n / 4 + 31) / 32;
  for (int k : {8, 16, 24, 32, 48, 64})
    if (per_lane <= k) return k;
  return -1;
}

detail::Support can_use_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                          const difuse_tensor_view& weight, const difuse_tensor_view& scale,
                                          const difuse_tensor_view& shift, double eps, int fp32_modulate) {
  (void)eps;
  detail::Support s;
  DIFUSE_REQUIRE(s, fp32_modulate == 0 || fp32_modulate == 1,
                 "fp32_modulate must be 0 (bf16 chain, LTX-2) or 1 (fp32 chain, ERNIE-Image), got " +
                     std::to_string(fp32_modulate));
  if (!require_rows(s, x, "x")) return s;
  const bool empty = detail::numel(x) == 0;
  require_weight(s, weight, x);
  require_broadcast_rows(s, scale, x, "scale", empty);
  require_broadcast_rows(s, shift, x, "shift", empty);
  detail::require_bf16_output(s, out, x, "x", {&x, &weight, &scale, &shift});
  return s;
}

void rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                       const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps, int fp32_modulate,
                       cudaStream_t stream) {
  const detail::Support s = can_use_rms_norm_modulate(out, x, weight, scale, shift, eps, fp32_modulate);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_modulate"));
  if (detail::numel(x) == 0) return;
  const Params p = make_params(out, x, weight, scale, shift, eps, fp32_modulate);
  const bool vec = (!p.has_w || rows_aligned8(weight)) && rows_aligned8(scale) && rows_aligned8(shift);
  launch<false>(p, vec, x.device, stream);
}

detail::Support can_use_gated_residual_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                                         const difuse_tensor_view& h, const difuse_tensor_view& a,
                                                         const difuse_tensor_view& gate, const difuse_tensor_view& weight,
                                                         const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                                         double eps, int fp32_modulate) {
  (void)eps;
  detail::Support s;
  DIFUSE_REQUIRE(s, fp32_modulate == 0 || fp32_modulate == 1,
                 "fp32_modulate must be 0 (bf16 chain, LTX-2) or 1 (fp32 chain, ERNIE-Image), got " +
                     std::to_string(fp32_modulate));
  if (!require_rows(s, h, "h")) return s;
  const int64_t N = h.sizes[h.rank - 1];
  const bool empty = detail::numel(h) == 0;
  require_weight(s, weight, h);
  require_broadcast_rows(s, gate, h, "gate", empty);
  require_broadcast_rows(s, scale, h, "scale", empty);
  require_broadcast_rows(s, shift, h, "shift", empty);
  for (const auto* t : {&a, &residual}) {
    const std::string name = t == &a ? "a" : "residual";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, name + " must be bf16, got " + difuse_dtype_name(t->dtype));
    DIFUSE_REQUIRE(s, t->device == h.device, name + " must be on the device of h, got " + detail::describe(*t));
    bool same = t->rank == h.rank;
    for (int d = 0; same && d < h.rank; ++d) same = t->sizes[d] == h.sizes[d];
    DIFUSE_REQUIRE(s, same, name + " must have the shape of h, got " + detail::describe(*t));
    if (t == &a) {  // rows at any strides (ERNIE-Image's attention output permuted to [S, B, H]), each contiguous
      bool rows_ok = same && t->rank >= 1 && (t->strides[t->rank - 1] == 1 || t->sizes[t->rank - 1] <= 1);
      for (int d = 0; rows_ok && d < t->rank; ++d) rows_ok = t->strides[d] >= 0;
      DIFUSE_REQUIRE(s, rows_ok, "a must have a contiguous last dim and non-negative strides, got " +
                                     detail::describe(*t));
    } else {
      DIFUSE_REQUIRE(s, detail::is_contiguous(*t), name + " must be contiguous, got " + detail::describe(*t));
    }
    if (!empty) {
      DIFUSE_REQUIRE(s, t->data != nullptr, name + " has a null data pointer");
      if (N >= 128 && N % 4 == 0)
        DIFUSE_REQUIRE(s, detail::rows_aligned(*t, 8),
                       name + " must have 8-byte aligned rows, got " + detail::describe(*t));
    }
  }
  detail::require_bf16_output(s, out, h, "h", {&h, &a, &gate, &weight, &scale, &shift});
  if (!empty) {
    DIFUSE_REQUIRE(s, residual.data == h.data || !detail::overlaps(residual, h),
                   "residual must be h itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, !detail::overlaps(residual, a) && !detail::overlaps(residual, gate) &&
                          !detail::overlaps(residual, weight) && !detail::overlaps(residual, scale) &&
                          !detail::overlaps(residual, shift) && !detail::overlaps(residual, out),
                   "residual must not overlap a, gate, weight, scale, shift or out");
  }
  return s;
}

void gated_residual_rms_norm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                      const difuse_tensor_view& h, const difuse_tensor_view& a,
                                      const difuse_tensor_view& gate, const difuse_tensor_view& weight,
                                      const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps,
                                      int fp32_modulate, cudaStream_t stream) {
  const detail::Support s =
      can_use_gated_residual_rms_norm_modulate(out, residual, h, a, gate, weight, scale, shift, eps, fp32_modulate);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_rms_norm_modulate"));
  if (detail::numel(h) == 0) return;
  Params p = make_params(out, h, weight, scale, shift, eps, fp32_modulate);
  p.a = static_cast<const uint16_t*>(a.data);
  p.gate = static_cast<const uint16_t*>(gate.data);
  p.residual = static_cast<uint16_t*>(residual.data);
  p.gate_rows = broadcast_row_indexer(gate, h).prepare(p.rows);
  p.a_rows = broadcast_row_indexer(a, h).prepare(p.rows);  // a has h's shape: its own strides place its rows
  p.a_rows16 = detail::rows_aligned(a, 16);
  const bool vec =
      (!p.has_w || rows_aligned8(weight)) && rows_aligned8(scale) && rows_aligned8(shift) && rows_aligned8(gate);
  launch<true>(p, vec, h.device, stream);
}

}  // namespace difuse::norm
