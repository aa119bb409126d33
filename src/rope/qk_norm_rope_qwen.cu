// qk_norm_rope_qwen — Qwen-Image's attention prologue in one launch, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 QwenDoubleStreamAttnProcessor2_0, what it hands to
// dispatch_attention_fn), bf16, per stream (image: to_q/to_k/to_v, text: add_q_proj/add_k_proj/add_v_proj, each
// unflattened to [B, S, heads, head_dim]):
//     img_query = attn.norm_q(img_query)       diffusers RMSNorm(head_dim), bf16 weight:
//                                                var = x.to(float32).pow(2).mean(-1, keepdim=True)
//                                                y = (x * torch.rsqrt(var + eps)).to(bf16) * weight   (two roundings)
//     img_key = attn.norm_k(img_key); txt_query = attn.norm_added_q(txt_query); txt_key = attn.norm_added_k(...)
//     img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)    (and img_key; text q, k with
//                                                txt_freqs): view_as_complex(x.float() pairs) * freqs[:, None],
//                                                view_as_real, flatten, type_as(x): numerics/rope.h
//                                                complex_mul_torch (re = fma(a, c, -b*d), im = fma(a, d, b*c))
//     joint_{query,key,value} = torch.cat([txt_*, img_*], dim=1)                 (exact copies)
// Replays: torch 2.11.0+cu130 — the mean is reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float, float,
// float>, uint32, float, vt0 = 4, input_vec_size = 4>> in its (32, 16) block (norm/diffusers_head_norm.h,
// norm/rms_modulate_schedule.h; as rms_norm_diffusers): lane l holds the float4 vector l (head_dim 128) or the
// elements l + 32 i (narrower heads), ((a0 + a1) + a2) + a3, shuffle-down tree 16..1, mean = RN(sum * factor) with
// factor = (float)rows / (float)(rows * head_dim) where rows = batch * tokens * heads OF THAT STREAM (the norm's
// input tensor; the image and text factors differ); RN(mean + (float)eps), rsqrtf, bf16(RN(x * rstd)),
// bf16(RN(y * w)). The RoPE is binary_internal::MulFunctor<c10::complex<float>> (its sm_90 SASS read from
// libtorch_cuda.so: FMUL, FMUL, FFMA, FFMA) and the .type_as copy (RNE). One block per joint token (its 3H head
// rows: q, k normalised and rotated, v copied). 128-element heads: half a warp per row, lane u holding aten's
// vectors u and u + 16 (norm::head_rstd_half_warp), one slot of two rows per warp at a time; other heads: a warp
// per row, 2 rows at a time, a lane holding 4 consecutive elements (2 for heads of <= 64) and the matching complex
// freqs. Outputs are contiguous [B, S_txt + S_img, H, D], exactly
// the tensors torch.cat makes.
//
// Guards (can_use_qk_norm_rope_qwen; every violation is reported): q, k, v and q_txt, k_txt, v_txt bf16
// [B, S, H, D] views on one CUDA device (text and image share B, H, D), last dim contiguous, non-negative strides,
// rows aligned to a lane's run (8 bytes above head_dim 64, else 4); 32 <= D <= 128, D even, D % 4 == 0 above 64
// (aten's mean: one warp per row from 32 elements, vectorized exactly at 128); each stream's B * S * H is at least
// 16 (fewer rows change aten's mean block) and B * S * H * D <= 2^29; weights absent or bf16 [D] contiguous;
// freqs and freqs_txt both absent (no RoPE) or both fp32 [S_img, D] / [S_txt, D] (the complex64 [S, D/2] tables
// viewed as (re, im) pairs) with a contiguous last dim, an even row stride, 8-byte aligned; B * (S_txt + S_img)
// < 2^31, 1 <= H <= 4096; outputs contiguous bf16 [B, S_txt + S_img, H, D], 8-byte aligned, overlapping no input
// nor each other.
//
// Verification status: bit-exact on the H200 at 66f5a3b (torch 2.11.0+cu130, sm_90; first at c8d8874):
// tests/gpu/test_qk_norm_rope_qwen.py (256 cases, incl. the real QwenDoubleStreamAttnProcessor2_0, the half-warp
// default for 128-element heads with 1 and 2 slots, the full-warp 2- and 4-row variants), 0 failed, 0 skipped
// (bench/results/h200/tests.json).
// The staged variant ran there at 66f5a3b behind DIFUSE_QK_STAGED=1 (test_staged_rows_variant passed, now
// test_unstaged_rows_variant; bench 0 mismatches, knob-sweeps/); it became the default after that run, and this
// file's tests passed with it at bc88af7 (tests-defaults-bc88af7.json). All of this file's tests passed again at
// 5f8295d (258 cases, tests.json), after the kernel split into stage_token / run_token (the other kernels' PTX the same
// instructions in a different order
// at the start; the staged one's per-token index code reordered, +11 PTX instructions per block:
// scripts/ptx-diff.sh bc88af7 src/rope/qk_norm_rope_qwen.cu) and the
// pipelined variant (DIFUSE_QK_PIPELINED=1, staged_token_rows.cuh's pipelined_tokens), and the v-copy variant
// (DIFUSE_QK_VCOPY=1). Timed there (knob-sweeps/ at 5f8295d), both lost to the staged default: 1x4608x24x128
// txt512 62.8 us pipelined, 61.6 with v copies, 54.1 staged.
// At 1765206 (after e383706), fewer instructions in the staged kernels, which ncu found issue-bound: the staging copies
// walk each role's heads by fixed steps (staged_token_rows.cuh; ~6 instructions per 16-byte copy, were ~30), and the
// row loop has head_dim 128 as a constant, the output base as one indexed constant load, the weights' and freqs'
// presence as a bit mask, and the mean's first pushes without their +0 additions (norm::mean_first_push_vec4, the same
// bits for every input: tests/cpu/test_rms_norm_modulate.cpp). SASS of the staged default's row loop: 244 -> 199
// instructions per slot. Index arithmetic only. On the H200 at 1765206: bench 0 mismatches at the site shapes,
// 1x4608x24x128 txt512 54.1 -> 49.8 us (predicted ~47; ops-prologues-1765206.json); this file's GPU tests did not run
// at 1765206 (the call's time ran out first). After 1765206: the token's batch and position
// by a FastDivU32 made on the host (token_place.h, CPU-tested): the staged default 524 -> 490 SASS instructions in
// all (scripts/sass-loops.sh). And the norm's two roundings two elements at a time (norm::diffusers_rms_pair: one
// pack-convert per pair
// where each element was converted alone and widened back; the same bits, CPU-tested against the element chain): row
// loop 198 -> 178 SASS instructions (244 before 1765206). Predicted txt512 49.8 -> ~47 us. And with an even number of
// slot rows (24 heads) the EVEN kernel drops the bounds test and zero fill: row loop 178 -> 163
// (scripts/sass-loops.sh); predicted ~46 us, measured at 132f46f 48.8 (ops.json; target 50: met); this file's 258 tests
// passed there (tests.json).
// Tried in the fourteenth session (479c108, removed): the v rows copied out of shared memory by the whole block
// (copy_staged_rows_out, as qk_norm_sd35's default) instead of through the slots, so 2H rows go through them (24
// slots per 24-head token instead of 36). Exact on the H200 (this file's 259 tests), no faster: txt512 49.5 vs 49.4
// us, fused 48.9 vs 48.9, batch 2 89.5 vs 89.7 (knob-sweeps/479c108/; predicted ~47). Fewer instructions do not
// speed this kernel up any more.
// Tried in the sixteenth session (DIFUSE_QK_BULK=1|2, kept for measurement): the token's rows staged by the bulk copy
// engine (one copy per role on an mbarrier), and with =2 the outputs written back in place and stored by one bulk
// copy per role. Exact on the H200 at 951f281 (this file's tests incl. test_bulk_copy_variant, gpu-tests-951f281.json;
// memcheck and racecheck clean at 546c39e), slower: txt512 50.8 (=1) and 52.3 (=2) vs 49.4 us, fused 50.6 / 52.1 vs
// 48.8 (knob-sweeps/951f281/). Predicted: no better than the 16-byte copies, which the probe's bulk variants
// confirmed as plain copies (ops.json at 951f281).
// Default since the twenty-sixth session (DIFUSE_QK_BULK=2 where its conditions hold; =0 keeps the staged kernel):
// with the staged rows 128-byte aligned (9c40a0c; they followed the mbarrier 16 B past a line, so every bulk copy
// straddled lines) the bulk kernel with bulk stores became the fastest at every site shape, H200 at 17e5cc6
// (knob-sweeps/17e5cc6/, two runs each): txt512 47.4 / 47.6 us vs 49.5 / 49.6 staged, fused 47.5 / 47.6 vs 49.4 /
// 49.5, txt34 42.8 / 42.9 vs 44.2 / 44.3, batch 2 88.6 / 88.8 vs 90.4 / 90.2 (=1: 48.7, 48.9, 44.5, 89.1). Same
// arithmetic per row (run_token); bench 0 mismatches there. At bb10c7e (the bulk default) this file's tests and
// test_patch_qwen.py passed, 266, 0 failed, 0 skipped (gpu-tests-bb10c7e.json; test_bulk_copy_variant with =0, the
// staged kernel, too), memcheck and racecheck of the smoke test clean with the defaults and with DIFUSE_QK_BULK=0
// (sanitizer-knobs-bb10c7e-*.log), txt512 47.6 us, fused 47.1, txt34 43.3, batch 2 88.2 (ops.json; bound 48.8: met).
#include "rope/qk_norm_rope_qwen.h"
#include "rope/rows_per_warp_knob.h"
#include "rope/staged_token_rows.cuh"
#include "rope/token_rows.cuh"

#include <cuda_runtime.h>

#include <atomic>

#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "norm/diffusers_head_norm.h"
#include "norm/rms_norm_diffusers.h"
#include "rope/head_views.h"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "qk_norm_rope_qwen", "cuda", "bit_exact",
    "Qwen-Image attention prologue: diffusers RMSNorm(q), RMSNorm(k) per head per stream, apply_rotary_emb_qwen "
    "(complex64 freqs per stream), cat([text, image]) of q, k, v",
    "verified bit-exact on H200 at bb10c7e (torch 2.11.0+cu130, sm_90)", 90, 90,
    "per-head diffusers QK RMSNorm + complex RoPE per stream + joint concat in one launch"}};

constexpr int kWarps = 8;

struct Stream : StreamViews {  // [B, S, H, D] views
  const float* freqs = nullptr;               // (re, im) pairs, row stride freqs_rs floats
  int64_t freqs_rs = 0;
  int64_t S = 0;
  float factor = 0.f;  // aten's mean factor for this stream's norms
};

struct Params {
  Stream txt, img;
  uint16_t* out[3] = {nullptr, nullptr, nullptr};
  int64_t S = 0;  // joint tokens
  int H = 0, D = 0, V = 0;  // V: lanes holding elements
  float eps = 1e-6f;
  detail::FastDivU32 heads;  // row -> (role, head) without a division instruction
  detail::FastDivU32 seq;    // token -> (batch, joint position)
};

// One block per joint token (b, sj): its 3H head rows, warp w taking rows w, w + 8, ... R at a time (all R loads
// before any reduction, the R shuffle trees interleaved; rows past the end carry zeros and are not stored). What
// depends only on the token (TokenRows, the freqs, the weights, the output base) is computed once per block.
//
// STAGED (the default where it applies; half-warp 128-element rows 16-byte aligned, the token's rows within
// 48 KB): the block first copies its token's 3H rows, its stream's freqs row and the q and k weights into shared
// memory with cp.async, all in flight at once, then runs the same arithmetic reading them from there (as
// qk_norm_rope.cu's staged kernel). Row r sits at vector 32 r; then the freqs (64 complex), q weight (32
// vectors), k weight (32).

// The copies of a token's tables (its stream's freqs row at position s: 64 complex; the q and k weights: 32 vectors
// each) into tab, by the block's first 128 threads (cp.async, 8 bytes each). The caller waits and synchronises.
__device__ __forceinline__ void stage_tables(const Stream& st, int64_t s, uint2* tab) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < 64) {  // one complex (8 bytes) per copy
    if (st.freqs != nullptr) norm::cp_async(tab + t, st.freqs + s * st.freqs_rs + 2 * t, false);
  } else if (t < 128 && st.w[(t - 64) / 32] != nullptr) {  // 8 bytes per copy
    const int r = (t - 64) / 32, v = t % 32;
    norm::cp_async(tab + 64 + 32 * r + v, st.w[r] + 4 * v, false);
  }
}

// STAGED layout: issues the copies of token `token`'s 3H rows (row r at 8-byte vector 32 r), then its stream's
// freqs row (64 complex) and q and k weights (32 vectors each) into dst. The caller commits or waits (cp.async)
// and synchronises the block. VCOPY: only the q and k rows (2H) are staged; the v rows are copied to the output
// here (copy_v_rows).
template <bool VCOPY = false>
__device__ __forceinline__ void stage_token(const Params& p, unsigned token, uint4* dst) {
  const TokenPlace tp = token_place(token, p.seq, p.txt.S);
  const Stream& st = tp.in_first ? p.txt : p.img;
  const TokenRows tr(st.t[0], st.t[1], st.t[2], tp.b, tp.s);
  const int rows = (VCOPY ? 2 : 3) * p.H;
  stage_token_rows<16, kWarps * 32>(dst, tr, p.H, VCOPY ? 2 : 3);  // 16 copies of 16 bytes per 128-element row
  if constexpr (VCOPY)  // v out: [B, S_txt + S_img, H, D] contiguous, head stride D
    copy_v_rows<16, kWarps * 32>(tr.row(2, 0), tr.sh[2], p.out[2] + (tp.b * p.S + tp.sj) * p.H * p.D, p.D, p.H);
  stage_tables(st, tp.s, reinterpret_cast<uint2*>(dst) + rows * 32);
}

// One token's 3H rows, normalised, rotated and stored by the block's warps. STAGED: `staged` holds them
// (stage_token's layout), read where used. The staged kernels run at head_dim 128 only (the launcher's
// condition): there D and the lane runs' bounds are compile-time constants and a row's output base is p.out[role]
// (one indexed constant load instead of selects), as in qk_norm_rope.cu. Index arithmetic only.
// EVEN (R == 1, an even number of slot rows: the VCOPY kernel's 2H always, the default's 3H when H is even, as
// Qwen-Image's 24 heads): every slot is full, so a row needs no bounds test or zero fill.
// BULK (the bulk-copy kernel, DIFUSE_QK_BULK=2): all 3H rows are staged, only q and k (2H) go through the slots,
// and each normalised, rotated row is written back in place into shared memory (the same lanes read and then write
// the same 8-byte runs), for the block's bulk stores.
template <int E, int R, int SPAN, bool STAGED, bool VCOPY = false, bool EVEN = false, bool BULK = false>
__device__ __forceinline__ void run_token(const Params& p, unsigned token, const uint2* staged) {
  static_assert(!BULK || (STAGED && EVEN && R == 1), "the bulk kernel is the staged one on full slots");
  // SPAN 16 (the default for head_dim 128, only there): half a warp per row, lane u holding runs u and
  // u + 16 (norm::head_rstd_half_warp); slots of two rows, as in qk_norm_rope.cu.
  static_assert(SPAN == 32 || (SPAN == 16 && E == 4), "half-warp rows need 128-element heads");
  static_assert(!STAGED || SPAN == 16, "the staged kernel is the half-warp one");
  static_assert(!EVEN || R == 1, "full slots are only guaranteed with one slot per warp and step");
  constexpr int K = 32 / SPAN;
  constexpr int kD = STAGED ? 128 : 0;  // head_dim when fixed at compile time
  const int D = kD != 0 ? kD : p.D;
  using norm::HeadRun;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int u = lane % SPAN, seg = lane / SPAN;
  const TokenPlace tp = token_place(token, p.seq, p.txt.S);
  const int64_t b = tp.b, sj = tp.sj, s = tp.s;
  const Stream& st = tp.in_first ? p.txt : p.img;
  bool on[K];
#pragma unroll
  for (int j = 0; j < K; ++j) on[j] = kD != 0 || u + SPAN * j < p.V;  // kD: 32 runs, u + 16 j < 32

  float fc[K][E / 2], fd[K][E / 2];  // each run's E / 2 complex freqs (c + di)
  HeadRun<E> wq[K], wk[K];
#pragma unroll
  for (int j = 0; j < K && !STAGED; ++j) {  // STAGED: read from shared memory where used
    const int v = u + SPAN * j;
#pragma unroll
    for (int e = 0; e < E / 2; ++e) fc[j][e] = fd[j][e] = 0.f;
    if (st.freqs != nullptr && on[j]) {
      const float2* f = reinterpret_cast<const float2*>(st.freqs + s * st.freqs_rs) + v * (E / 2);
#pragma unroll
      for (int e = 0; e < E / 2; ++e) {
        const float2 fv = f[e];
        fc[j][e] = fv.x;
        fd[j][e] = fv.y;
      }
    }
    wq[j] = (st.w[0] != nullptr && on[j]) ? norm::load_run<E>(st.w[0], v) : norm::zero_run<E>();
    wk[j] = (st.w[1] != nullptr && on[j]) ? norm::load_run<E>(st.w[1], v) : norm::zero_run<E>();
  }

  const TokenRows tr(st.t[0], st.t[1], st.t[2], b, s);
  // bit 0: a q weight, bit 1: a k weight, bit 2: freqs (one register, tested per row and run)
  const unsigned flags = (st.w[0] != nullptr ? 1u : 0u) | (st.w[1] != nullptr ? 2u : 0u) |
                         (st.freqs != nullptr ? 4u : 0u);
  const int64_t out_token = (b * p.S + sj) * p.H * D;  // output row of head h: out_token + h * D

  const int rows = (VCOPY || BULK ? 2 : 3) * p.H;  // VCOPY: the v rows were copied by stage_token; BULK: v stays
  const uint2* s_tab = staged + (BULK ? 3 * p.H : rows) * 32;  // STAGED: freqs (64 complex), q weight (32), k (32)
  const int slots = (rows + K - 1) / K;
  for (int base = warp; base < slots; base += kWarps * R) {
    HeadRun<E> x[R][K];
    uint32_t role_of[R], head_of[R];
    int row_of[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int r = (base + q * kWarps) * K + seg;
      row_of[q] = r;
      role_of[q] = EVEN ? p.heads.divmod(static_cast<uint32_t>(r), head_of[q])
                        : role_and_head(p.heads, r, rows, head_of[q]);
      const uint16_t* row = STAGED ? reinterpret_cast<const uint16_t*>(staged + r * 32)
                                   : tr.row(role_of[q] < 3 ? role_of[q] : 0, head_of[q]);
#pragma unroll
      for (int j = 0; j < K; ++j)
        x[q][j] = ((EVEN || role_of[q] < 3) && on[j]) ? norm::load_run<E>(row, u + SPAN * j) : norm::zero_run<E>();
    }
    float rstd[R];
    if constexpr (SPAN == 16) {
      norm::head_rstd_half_warp<R>(x, st.factor, p.eps, rstd);
    } else {
      HeadRun<E> x0[R];
#pragma unroll
      for (int q = 0; q < R; ++q) x0[q] = x[q][0];
      norm::head_rstd<E, R>(x0, lane, p.D, st.factor, p.eps, rstd);  // lanes past D hold +0, as aten's idle ones
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const uint32_t role = role_of[q];  // 0 q, 1 k, 2 v (copied as is), 3 past the end
      if (!EVEN && role > 2) continue;  // no shuffle follows: a half warp may skip alone
      uint16_t* orow = BULK ? reinterpret_cast<uint16_t*>(const_cast<uint2*>(staged) + row_of[q] * 32)
                            : (kD != 0 ? p.out[role] : by_role(role, p.out[0], p.out[1], p.out[2])) + out_token +
                                  static_cast<int64_t>(head_of[q]) * D;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        HeadRun<E> y = x[q][j];
        if (role < 2) {
          const int v = u + SPAN * j;
          HeadRun<E> wr;
          if constexpr (STAGED) {
            const uint2 wv = s_tab[64 + (role == 0 ? 0 : 32) + v];
            wr.w[0] = wv.x;
            wr.w[1] = wv.y;
          } else {
            wr = norm::select_run<E>(role == 0, wq[j], wk[j]);
          }
          y = norm::diffusers_norm_run<E>(x[q][j], rstd[q], (flags >> role) & 1u, wr);
          if (flags & 4u) {
#pragma unroll
            for (int e = 0; e < E / 2; ++e) {
              const float2 f = STAGED ? reinterpret_cast<const float2*>(s_tab)[v * (E / 2) + e]
                                      : make_float2(fc[j][e], fd[j][e]);
              y.w[e] = num::rope_complex_bf16x2(y.w[e], f.x, f.y);
            }
          }
        }
        if (on[j]) norm::store_run<E>(orow, u + SPAN * j, y);
      }
    }
  }
}

// One block per token. VCOPY (with STAGED; DIFUSE_QK_VCOPY=1, for measurement, slower on the H200; v_out
// 16-byte aligned): the v rows are copied global to global beside the staging copies, only q and k staged.
template <int E, int R, int MIN_BLOCKS, int SPAN = 32, bool STAGED = false, bool VCOPY = false, bool EVEN = false>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) qk_norm_rope_qwen_kernel(const Params p) {
  static_assert(!VCOPY || STAGED, "the v copy rides on the staged kernel's 16-byte aligned rows");
  extern __shared__ uint4 staged16[];  // STAGED: the token's rows and tables (stage_token's layout)
  block_token<STAGED>(
      staged16, [&](unsigned token, uint4* dst) { stage_token<VCOPY>(p, token, dst); },
      [&](unsigned token, const uint4* src) {
        run_token<E, R, SPAN, STAGED, VCOPY, EVEN>(p, token, reinterpret_cast<const uint2*>(src));
      });
}

// BULK (DIFUSE_QK_BULK=1|2, for measurement; the staged kernel's conditions and each role's H head rows contiguous in
// every stream, head stride D, as in Qwen-Image's projections, separate or fused): the block's token rows are
// staged by the bulk copy engine (core/bulk_copy.cuh), one copy of H * D * 2 bytes per role issued by thread 0 and
// completing on an mbarrier, the tables by cp.async as in stage_token. BULK=1: then the staged kernel's run_token,
// unchanged. BULK=2: only the q and k rows go through the slots, written back in place, and thread 0 stores the
// token's q, k and v rows with one bulk copy per role (the joint outputs' token rows are contiguous: H * D
// elements from (b * S + sj) * H * D). The same arithmetic per row (run_token).
template <int BULK>
__global__ void __launch_bounds__(kWarps * 32, 8) qk_norm_rope_qwen_bulk(const Params p) {
  // 128-byte aligned: with the default 16 the rows followed `bar` 16 B past a line (ptxas' static smem 16 B), every
  // bulk copy straddling lines (timed so at 951f281); ptxas now counts 128 B of static smem. See kBulkStagingAlign.
  extern __shared__ __align__(128) uint4 staged16[];
  __shared__ uint64_t bar;
  const unsigned token = blockIdx.x;
  const TokenPlace tp = token_place(token, p.seq, p.txt.S);
  const Stream& st = tp.in_first ? p.txt : p.img;
  const uint32_t role_bytes = static_cast<uint32_t>(p.H) * 128 * sizeof(uint16_t);
  bulk_stage_token_rows<256>(staged16, TokenRows(st.t[0], st.t[1], st.t[2], tp.b, tp.s), p.H, 3, &bar);
  stage_tables(st, tp.s, reinterpret_cast<uint2*>(staged16) + 3 * p.H * 32);
  norm::cp_async_wait_all();
  __syncthreads();  // the tables, and the barrier's initialisation, for every thread
  detail::mbar_wait(&bar, 0);
  run_token<4, 1, 16, true, false, true, BULK == 2>(p, token, reinterpret_cast<const uint2*>(staged16));
  if constexpr (BULK == 2) {
    detail::fence_proxy_async_smem();  // this thread's rows written back, before the copy engine reads them
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t out_token = (tp.b * p.S + tp.sj) * p.H * 128;
#pragma unroll
      for (int role = 0; role < 3; ++role)
        detail::bulk_store(p.out[role] + out_token, staged16 + role * p.H * 16, role_bytes);
      detail::bulk_commit();
      detail::bulk_wait_reads();
    }
  }
}

// PIPELINED (DIFUSE_QK_PIPELINED=1, for measurement, slower on the H200; where STAGED applies and two tokens'
// buffers fit in 48 KB): a grid of at most the resident blocks (DIFUSE_QK_PIPELINED=N >= 2: at most N, for
// tests), each block staging its next token while it computes the current one (staged_token_rows.cuh's
// pipelined_tokens). The same arithmetic per row (run_token).
template <int MIN_BLOCKS>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS)
    qk_norm_rope_qwen_pipelined(const Params p, unsigned tokens) {
  extern __shared__ uint4 staged16[];
  pipelined_tokens(
      tokens, 3 * p.H * 16 + 64, staged16, [&](unsigned token, uint4* dst) { stage_token(p, token, dst); },
      [&](unsigned token, const uint4* src) {
        run_token<4, 1, 16, true>(p, token, reinterpret_cast<const uint2*>(src));
      });
}

void require_freqs(detail::Support& s, const difuse_tensor_view& f, const char* name, int64_t S, int64_t D,
                   int device) {
  const std::string n(name);
  const std::string want = "[" + std::to_string(S) + ", " + std::to_string(D / 2) + "]";
  DIFUSE_REQUIRE(s, f.dtype == DIFUSE_F32,
                 n + " must be complex64 " + want + " (fp32 (re, im) pairs in the C ABI), got " +
                     difuse_dtype_name(f.dtype));
  DIFUSE_REQUIRE(s, f.rank == 2 && f.sizes[0] == S && f.sizes[1] == D,
                 n + " must be complex64 " + want + " (as QwenEmbedRope returns it; fp32 [" + std::to_string(S) +
                     ", " + std::to_string(D) + "] pairs in the C ABI), got " + detail::describe(f));
  if (f.rank == 2) {
    DIFUSE_REQUIRE(s, (f.strides[1] == 1 || f.sizes[1] <= 1) && f.strides[0] >= 0 && f.strides[0] % 2 == 0,
                   n + " rows must be contiguous pairs with an even, non-negative row stride, got " +
                       detail::describe(f));
  }
  DIFUSE_REQUIRE(s, f.device == device, n + " must be on the device of q, got " + detail::describe(f));
  DIFUSE_REQUIRE(s, detail::numel(f) == 0 || detail::aligned(f.data, 8), n + " must be 8-byte aligned");
}

}  // namespace

detail::Support can_use_qk_norm_rope_qwen(const QkNormRopeQwenArgs& a) {
  using namespace heads;
  detail::Support s;
  const char* layout = "[B, S, heads, head_dim]";
  bool shapes = require_view(s, a.q, "q", layout);
  shapes = require_view(s, a.k, "k", layout) && shapes;
  shapes = require_view(s, a.v, "v", layout) && shapes;
  shapes = require_view(s, a.q_txt, "q_txt", layout) && shapes;
  shapes = require_view(s, a.k_txt, "k_txt", layout) && shapes;
  shapes = require_view(s, a.v_txt, "v_txt", layout) && shapes;
  DIFUSE_REQUIRE(s, present(a.freqs) == present(a.freqs_txt),
                 "freqs and freqs_txt must be given together (image_rotary_emb = (img_freqs, txt_freqs))");
  if (!shapes) return s;

  const int64_t B = a.q.sizes[0], S2 = a.q.sizes[1], H = a.q.sizes[2], D = a.q.sizes[3];
  const int64_t S1 = a.q_txt.sizes[1];
  const int dev = a.q.device;
  require_head_dim(s, D);
  const int E = norm::head_lane_elems(static_cast<int>(D));
  const int64_t img[4] = {B, S2, H, D}, txt[4] = {B, S1, H, D};
  require_stream(s, {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}}, img, dev,
                 "k and v must have q's shape and device " + detail::describe(a.q), E);
  require_stream(s, {{&a.q_txt, "q_txt"}, {&a.k_txt, "k_txt"}, {&a.v_txt, "v_txt"}}, txt, dev,
                 "q_txt, k_txt and v_txt must be [" + std::to_string(B) + ", S_txt, " + std::to_string(H) + ", " +
                     std::to_string(D) + "] alike on q's device", E);
  require_norm_rows(s, "image", B * S2 * H, D);
  require_norm_rows(s, "text", B * S1 * H, D);
  const int64_t S = S1 + S2;
  DIFUSE_REQUIRE(s, B * S <= int64_t{2147483647}, "at most 2^31 - 1 joint tokens in the batch");
  DIFUSE_REQUIRE(s, H >= 1 && H <= 4096, "heads must be in [1, 4096], got " + std::to_string(H));
  require_weight(s, a.q_weight, "q_weight", D, dev);
  require_weight(s, a.k_weight, "k_weight", D, dev);
  require_weight(s, a.q_txt_weight, "q_txt_weight", D, dev);
  require_weight(s, a.k_txt_weight, "k_txt_weight", D, dev);
  if (present(a.freqs)) require_freqs(s, a.freqs, "freqs", S2, D, dev);
  if (present(a.freqs_txt)) require_freqs(s, a.freqs_txt, "freqs_txt", S1, D, dev);
  const std::initializer_list<const difuse_tensor_view*> inputs = {
      &a.q, &a.k, &a.v, &a.q_txt, &a.k_txt, &a.v_txt, &a.q_weight, &a.k_weight, &a.q_txt_weight,
      &a.k_txt_weight, &a.freqs, &a.freqs_txt};
  const int64_t joint[4] = {B, S, H, D};
  require_joint_outputs(s, a.q_out, a.k_out, a.v_out, joint, dev, inputs);
  return s;
}

void qk_norm_rope_qwen(const QkNormRopeQwenArgs& a, cudaStream_t stream) {
  const detail::Support s = can_use_qk_norm_rope_qwen(a);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope_qwen"));
  const int64_t B = a.q.sizes[0], H = a.q.sizes[2], D = a.q.sizes[3];
  const auto stream_of = [&](const difuse_tensor_view& q, const difuse_tensor_view& k, const difuse_tensor_view& v,
                             const difuse_tensor_view& wq, const difuse_tensor_view& wk, const difuse_tensor_view& f) {
    Stream st;
    static_cast<StreamViews&>(st) = stream_views(q, k, v, wq, wk, 1, 2);
    st.S = q.sizes[1];
    st.factor = norm::diffusers_mean_factor(B * st.S * H, D);
    if (heads::present(f) && detail::numel(f) > 0) {
      st.freqs = static_cast<const float*>(f.data);
      st.freqs_rs = f.strides[0];
    }
    return st;
  };
  Params p{};
  p.img = stream_of(a.q, a.k, a.v, a.q_weight, a.k_weight, a.freqs);
  p.txt = stream_of(a.q_txt, a.k_txt, a.v_txt, a.q_txt_weight, a.k_txt_weight, a.freqs_txt);
  const bool rope = heads::present(a.freqs);
  if (!rope) p.img.freqs = p.txt.freqs = nullptr;
  p.out[0] = static_cast<uint16_t*>(a.q_out.data);
  p.out[1] = static_cast<uint16_t*>(a.k_out.data);
  p.out[2] = static_cast<uint16_t*>(a.v_out.data);
  p.S = p.txt.S + p.img.S;
  p.H = static_cast<int>(H);
  p.D = static_cast<int>(D);
  const int E = norm::head_lane_elems(p.D);
  p.V = p.D / E;
  p.eps = static_cast<float>(a.eps);
  p.heads = detail::FastDivU32(static_cast<uint32_t>(p.H));
  p.seq = detail::FastDivU32(static_cast<uint32_t>(p.S));
  const int64_t blocks = B * p.S;
  if (blocks == 0) return;
  const detail::DeviceGuard device_guard(a.q.device);
  // Rows a warp loads before reducing (DIFUSE_QK_ROWS_PER_WARP=2|4 overrides the default, for measurements). H200,
  // 1x4608x24x128 txt512 at 6408223: 2 rows 75.3 us, 4 rows 78.6.
  const bool four = rows_per_warp_knob() >= 4;
  const dim3 grid(static_cast<unsigned>(blocks)), block(kWarps * 32);
  // 128-element rows by default on half a warp, 1 slot of two rows per warp (2 with DIFUSE_QK_ROWS_PER_WARP >= 2).
  // H200 at 5fa0c2a (knob-sweeps/), 1x4608x24x128 txt512: 1 slot 60.6 us, 2 slots 67.3, full warp 2 rows 74.8
  // (fastest at all four shapes). DIFUSE_QK_LANES_PER_ROW=32 (for measurement) keeps a warp per row.
  static const int lanes_knob = detail::positive_env_knob("DIFUSE_QK_LANES_PER_ROW");
  // Default where it applies: the staged kernel (H200 at 66f5a3b, knob-sweeps/: 1x4608x24x128 txt512 54.3 us vs
  // 60.8 per-row, txt34 50.2 vs 54.9, batch 2 104.3 vs 115.9). DIFUSE_QK_UNSTAGED=1, or either knob above, keeps
  // the per-row kernels.
  static const int unstaged_knob = detail::positive_env_knob("DIFUSE_QK_UNSTAGED");
  const size_t staged_bytes = static_cast<size_t>(3) * p.H * p.D * sizeof(uint16_t) + 128 * sizeof(uint2);
  if (lanes_knob != 32 && rows_per_warp_knob() == 0 && unstaged_knob != 1 && p.D == 128 &&
      staged_bytes <= 48 * 1024 && head_rows_aligned16({&p.txt, &p.img})) {
    static const int pipelined_knob = detail::positive_env_knob("DIFUSE_QK_PIPELINED");
    static const int vcopy_knob = detail::positive_env_knob("DIFUSE_QK_VCOPY");  // (the pipelined kernel stages v)
    // The bulk-copy kernel with bulk stores (BULK=2) is the default where its conditions hold (H200 at 17e5cc6,
    // knob-sweeps/17e5cc6/, two runs each: 1x4608x24x128 txt512 47.4 / 47.6 us vs 49.5 / 49.6 staged, fused 47.5 /
    // 47.6 vs 49.4 / 49.5, txt34 42.8 / 42.9 vs 44.2 / 44.3, batch 2 88.6 / 88.8 vs 90.4 / 90.2; BULK=1 48.7).
    // DIFUSE_QK_BULK=0 keeps the staged kernel; DIFUSE_QK_PIPELINED or DIFUSE_QK_VCOPY=1 (for measurement) turn
    // the default off unless DIFUSE_QK_BULK is given too.
    static const int bulk_knob =
        detail::env_knob_or("DIFUSE_QK_BULK", pipelined_knob >= 1 || vcopy_knob == 1 ? 0 : 2);
    if (bulk_knob >= 1 && (bulk_knob >= 2 || 3 * p.H % 2 == 0) && staged_bytes + kBulkStagingAlign <= 48 * 1024 &&
        head_rows_contiguous({&p.txt, &p.img}, 128) && detail::aligned(p.out[0], 16) &&
        detail::aligned(p.out[1], 16) && detail::aligned(p.out[2], 16)) {
      // rows staged (and with =2 stored) by the bulk copy engine; 8 blocks of ~19 KB per SM as the staged kernel
      if (bulk_knob >= 2)
        norm::launch_max_shared<qk_norm_rope_qwen_bulk<2>>(p, grid, block, staged_bytes, a.q.device, stream);
      else
        norm::launch_max_shared<qk_norm_rope_qwen_bulk<1>>(p, grid, block, staged_bytes, a.q.device, stream);
    } else if (pipelined_knob >= 1 && 2 * staged_bytes <= 48 * 1024) {
      // Two buffers per block (~38 KB at 24 heads): 5 blocks per SM on a grid of the resident blocks (at most N
      // with DIFUSE_QK_PIPELINED=N >= 2, for tests), each block's next token in flight while it computes.
      static std::atomic<uint64_t> carveout_set{0};
      launch_pipelined(qk_norm_rope_qwen_pipelined<5>, p, blocks, staged_bytes, pipelined_knob, kWarps * 32,
                       a.q.device, stream, carveout_set);
    } else if (vcopy_knob == 1 && detail::aligned(p.out[2], 16)) {
      // v rows copied, 2H rows staged (even)
      norm::launch_max_shared<qk_norm_rope_qwen_kernel<4, 1, 8, 16, true, true, true>>(
          p, grid, block, staged_bytes - static_cast<size_t>(p.H) * p.D * sizeof(uint16_t), a.q.device, stream);
    } else {
      // most shared memory: 8 blocks of ~19 KB per SM; every slot full when 3H is even (Qwen-Image: 24 heads)
      if (3 * p.H % 2 == 0)
        norm::launch_max_shared<qk_norm_rope_qwen_kernel<4, 1, 8, 16, true, false, true>>(p, grid, block,
                                                                                          staged_bytes, a.q.device,
                                                                                          stream);
      else
        norm::launch_max_shared<qk_norm_rope_qwen_kernel<4, 1, 8, 16, true>>(p, grid, block, staged_bytes,
                                                                              a.q.device, stream);
    }
  } else if (lanes_knob != 32 && p.D == 128) {
    if (rows_per_warp_knob() >= 2)
      qk_norm_rope_qwen_kernel<4, 2, 3, 16><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_rope_qwen_kernel<4, 1, 4, 16><<<grid, block, 0, stream>>>(p);
  } else if (E == 4) {  // the complex freqs and weights of a 4-element run need more than 6 blocks' 40 registers
    if (four)
      qk_norm_rope_qwen_kernel<4, 4, 4><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_rope_qwen_kernel<4, 2, 5><<<grid, block, 0, stream>>>(p);
  } else {
    if (four)
      qk_norm_rope_qwen_kernel<2, 4, 5><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_rope_qwen_kernel<2, 2, 6><<<grid, block, 0, stream>>>(p);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
