// qk_norm_sd35 — SD3.5's joint-attention QK path in one launch, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 JointAttnProcessor2_0, what it hands to
// F.scaled_dot_product_attention; JointTransformerBlock(qk_norm="rms_norm")), bf16:
//     query = attn.to_q(hidden_states).view(B, -1, heads, head_dim).transpose(1, 2)     [B, H, S, D] views (key,
//                                                value alike; the context stream from add_q/k/v_proj)
//     query = attn.norm_q(query); key = attn.norm_k(key)         diffusers RMSNorm(head_dim), bf16 weight, on the
//     ctx_q = attn.norm_added_q(ctx_q); ctx_k = attn.norm_added_k(ctx_k)     BHSD views:
//                                                var = x.to(float32).pow(2).mean(-1, keepdim=True)
//                                                y = (x * torch.rsqrt(var + eps)).to(bf16) * weight (two roundings)
//     query = torch.cat([query, ctx_q], dim=2)   (key, value alike: [image, context] along the sequence in BHSD;
//                                                the result is a contiguous [B, H, S_img + S_ctx, D])
// No RoPE (SD3 adds a 2-D sin-cos position embedding in PatchEmbed).
// Replays: torch 2.11.0+cu130 — the mean is reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float, float,
// float>, uint32, float, vt0 = 4, input_vec_size = 4>> in its (32, 16) block (norm/diffusers_head_norm.h; as
// rms_norm_diffusers, verified there on BHSD views): at head_dim 64 lane l owns elements l and l + 32
// (accumulators 0 and 1), ((a0 + a1) + a2) + a3, shuffle-down tree 16..1, mean = RN(sum * factor),
// factor = (float)rows / (float)(rows * head_dim) with rows = B * H * S OF THAT STREAM (image and context factors
// differ); RN(mean + (float)eps), rsqrtf, bf16(RN(x * rstd)), bf16(RN(y * w)); the cat is an exact copy. One
// block per joint token (b, s): its 3H head rows (q, k normalised, v copied); each output row lands at
// ((b H + h) S_total + s) D. head_dim 64 (SD3.5's): rows on half warps, span lane u holding elements u, u + 16,
// u + 32, u + 48 (aten's lanes u and u + 16 folded: qk_norm_sd35_half_warp64). Other head sizes: a warp per row,
// 2 rows at a time (4 or 8 with DIFUSE_QK_ROWS_PER_WARP, for measurement), a lane holding 2 consecutive elements
// (4 above head_dim 64) and gathering aten's by shuffles.
//
// Guards (can_use_qk_norm_sd35; every violation is reported): q, k, v and q_ctx, k_ctx, v_ctx bf16 [B, H, S, D]
// views on one CUDA device (the streams share B, H, D), last dim contiguous, non-negative strides, rows aligned to
// a lane's run (4 bytes, 8 above head_dim 64); 32 <= D <= 128, D even, D % 4 == 0 above 64; each stream's
// B * H * S is at least 16 (fewer rows change aten's mean block) and B * H * S * D <= 2^29; weights absent or bf16
// [D] contiguous; B * (S_img + S_ctx) < 2^31, 1 <= H <= 4096; outputs contiguous bf16 [B, H, S_img + S_ctx, D],
// 8-byte aligned, overlapping no input nor each other.
//
// Verification status: bit-exact on the H200 at 66f5a3b (torch 2.11.0+cu130, sm_90): tests/gpu/test_qk_norm_sd35.py
// (255 cases, incl. the real JointAttnProcessor2_0, the half-warp head_dim-64 kernel as the default (first exact
// at daa91f6 through its knob), the 4- and 8-row variants and the full-warp kernels through the knobs, the staged
// kernel behind the then DIFUSE_QK_STAGED=1), 0 failed, 0 skipped (bench/results/h200/tests.json). The staged
// kernel became the default after that run; this file's tests passed with it at bc88af7
// (tests-defaults-bc88af7.json). The v-copy variant passed its tests at 5f8295d through DIFUSE_QK_VCOPY=1
// (256 cases, tests.json) and became the default after; the file's 256 tests passed with it at e383706
// (tests-defaults-e383706.json; v staged through DIFUSE_QK_VCOPY=0).
// At 1765206 (after e383706), fewer instructions in the staged kernels, which ncu found issue-bound: the staging copies
// walk each role's heads by fixed steps (staged_token_rows.cuh; ~6 instructions per 16-byte copy, were ~30), and the
// row loop keeps the raw bits in 32-bit registers (no byte permutes), takes the output base as one indexed constant
// load, and leaves out the mean's +0 additions (norm::head64_span_lane_sum: mean_first_push_scalar,
// mean_lane_total_first_two, the same bits for every input). SASS of the staged default's row loop: 124 -> 106
// instructions per slot. Index arithmetic only. On the H200 at 1765206: this file's 256 tests passed
// (gpu-tests-partial-1765206.log), bench 0 mismatches, 2x38x4429x64 80.7 -> 76.7 us (predicted ~72; target 73;
// ops-prologues-1765206.json). After 1765206 the v-copy kernel (the default) drops its bounds test and zero fill (its
// 2H rows are even and a warp takes one slot per step, so every row exists) and its v-role branch (v never goes through
// its slots): row loop 106 -> 84 SASS instructions (scripts/sass-loops.sh); predicted 76.7 -> ~73 us. The half-warp
// kernels also find the token's batch and position by a FastDivU32 made on the host (p.seq; the full-warp ones keep the
// division: their 8-row variant spills with it). On the H200 at 132f46f: this file's 256 tests passed (tests.json),
// 2x38x4429x64 75.5 us (ops.json; target 72.8 = 1.2 x its 60.7 us floor: not met). At eb1307d the 4-warp variant
// (DIFUSE_QK_SD35_WARPS=4 now) was the default and the file's 257 tests passed with it (gpu-tests-eb1307d.json), but it
// ran slower (79.9 vs 75.6 us, knob-sweeps/eb1307d/): the 8-warp kernel is the default again, its PTX 132f46f's.
// On the H200 at f7a86a5 the v rows staged with q and k and copied out of shared memory after the slots
// (DIFUSE_QK_SD35_VCOPY_SMEM=1 then) ran exact (this file's 259 tests) and faster: 72.7 vs 75.6 us (4 warps: 73.2;
// knob-sweeps/f7a86a5/, bench-f7a86a5.log); it is the default since 61e66e7, where this file's 259 tests passed and
// compute-sanitizer was clean (gpu-tests-61e66e7.json, sanitizer-61e66e7.log; 73.4 vs 76.2 with
// DIFUSE_QK_SD35_VCOPY_SMEM=0, knob-sweeps/61e66e7/). The lean slots (DIFUSE_QK_SD35_LEAN=1, 13 % fewer
// instructions) were the default at f1e1d95 (275 tests passed, sanitizer clean) and ran no faster (73.8 vs 73.7);
// the default is 61e66e7's kernel again (PTX unchanged), 276 tests passed at 1195fc2 (gpu-tests-1195fc2.json).
// 2x38x4429x64 is 73.4-73.8 us against a target of 73.2 (1.2 x its 61.0 us floor in those runs): not met.
// DIFUSE_QK_SD35_OUT_SMEM=1 (OSMEM below, only where q_out and k_out are 16-byte aligned as v_out must be: its
// copy-out stores 16 bytes to every role's rows; the q and k rows written back to shared memory and all 3H rows copied out
// in 16-byte vectors; test_rows_out_of_shared_memory_variant; the default kernels' PTX unchanged): exact on the H200
// at 5d35cbc (gpu-tests-5d35cbc.json), sanitizer clean there, and no faster: 2x38x4429x64 72.7 / 73.5 us (fused)
// against 73.1 / 73.4 for the default in the same run (knob-sweeps/5d35cbc/, ops.json of that run). Kept for
// measurement only.
// DIFUSE_QK_BULK=1|2 (BULK below; the rows staged by the bulk copy engine, one copy per role on an mbarrier; =2 with
// OSMEM's write-back and one 128-byte bulk store per row; test_bulk_copy_variant; the default kernels' PTX unchanged):
// exact on the H200 at 951f281 (gpu-tests-951f281.json), memcheck and racecheck clean at 546c39e
// (sanitizer-bulk-546c39e.txt), slower: 2x38x4429x64 76.9 / 79.6 us vs 72.5, fused 77.5 / 80.7 vs 73.1
// (knob-sweeps/951f281/). Kept for measurement only.
#include "rope/qk_norm_sd35.h"
#include "rope/rows_per_warp_knob.h"
#include "rope/staged_token_rows.cuh"
#include "rope/token_rows.cuh"

#include <cuda_runtime.h>

#include <atomic>
#include <limits>

#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "norm/diffusers_head_norm.h"
#include "norm/rms_norm_diffusers.h"
#include "rope/head_views.h"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "qk_norm_sd35", "cuda", "bit_exact",
    "SD3.5 joint attention: diffusers RMSNorm(q), RMSNorm(k) per head on the BHSD views of both streams, "
    "cat([image, context], dim=2) of q, k, v",
    "verified bit-exact on H200 at 1195fc2 (torch 2.11.0+cu130, sm_90)", 90, 90,
    "per-head diffusers QK RMSNorm + BHSD joint concat in one launch"}};

constexpr int kWarps = 8;

struct Stream : StreamViews {  // [B, H, S, D] views
  int64_t S = 0;
  float factor = 0.f;  // aten's mean factor for this stream's norms
};

struct Params {
  Stream img, ctx;
  uint16_t* out[3] = {nullptr, nullptr, nullptr};
  int64_t S = 0;  // joint tokens
  int H = 0, D = 0, V = 0;
  float eps = 1e-6f;
  detail::FastDivU32 heads;  // row -> (role, head) without a division instruction
  detail::FastDivU32 seq;    // token -> (batch, joint position)
};

// Warp w of a token's block owns rows w, w + 8, ... of its 3H head rows (row r: role r / H, head r % H), R at a
// time. What depends only on the token (TokenRows, the weights, the output base) is computed once per block.
// DFIX: head_dim fixed at compile time (64, SD3.5's) or 0 (runtime): the mean's per-element fetch loop and its
// width checks fold away; the same arithmetic.
template <int E, int R, int MIN_BLOCKS, int DFIX = 0>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) qk_norm_sd35_kernel(const Params p) {
  using norm::HeadRun;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const unsigned S = static_cast<unsigned>(p.S);  // B * S < 2^31 (predicate)
  const int64_t b = blockIdx.x / S;
  const int64_t sj = blockIdx.x % S;
  const bool in_img = sj < p.img.S;
  const int64_t s = in_img ? sj : sj - p.img.S;
  const bool on = lane < p.V;

  const Stream& st = in_img ? p.img : p.ctx;
  const TokenRows tr(st.t[0], st.t[1], st.t[2], b, s);
  const uint16_t* w0 = st.w[0];
  const uint16_t* w1 = st.w[1];
  const float factor = st.factor;
  const HeadRun<E> wq = (w0 != nullptr && on) ? norm::load_run<E>(w0, lane) : norm::zero_run<E>();
  const HeadRun<E> wk = (w1 != nullptr && on) ? norm::load_run<E>(w1, lane) : norm::zero_run<E>();
  const int64_t out_token = (b * p.H * p.S + sj) * p.D;  // output row of head h: out_token + h * S * D
  const int64_t out_head = p.S * p.D;

  const int rows = 3 * p.H;
  for (int base = warp; base < rows; base += kWarps * R) {
    HeadRun<E> x[R];
    uint32_t role_of[R], head_of[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int r = base + q * kWarps;
      role_of[q] = role_and_head(p.heads, r, rows, head_of[q]);
      x[q] = (role_of[q] < 3 && on) ? norm::load_run<E>(tr.row(role_of[q], head_of[q]), lane) : norm::zero_run<E>();
    }
    float rstd[R];
    norm::head_rstd<E, R>(x, lane, DFIX ? DFIX : p.D, factor, p.eps, rstd);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const uint32_t role = role_of[q];  // 0 q, 1 k, 2 v (copied as is), 3 past the end
      if (role > 2) continue;  // uniform across the warp
      const HeadRun<E> y = role < 2 ? norm::diffusers_norm_run<E>(x[q], rstd[q], (role == 0 ? w0 : w1) != nullptr,
                                                                  norm::select_run<E>(role == 0, wq, wk))
                                    : x[q];
      uint16_t* o = by_role(role, p.out[0], p.out[1], p.out[2]);
      if (on) norm::store_run<E>(o + out_token + head_of[q] * out_head, lane, y);
    }
  }
}

// head_dim 64 on half a warp (the default there; DIFUSE_QK_LANES_PER_ROW=32 for the full-warp kernel): two rows
// per warp instruction (a slot; row 2 slot + seg, seg = the half), span lane u holding elements u, u + 16, u + 32,
// u + 48 of its row as 2-byte loads, which is aten's element-to-lane map folded onto 16 lanes
// (norm::head64_span_lane_sum): no shuffle to gather a lane's elements and a 4-level tree, where the full-warp
// kernel spends 2 gather shuffles and a 5-level tree per row and loads a 128-byte row per warp instruction (ncu at
// 3e989f7: issue-bound, 0.83 warp instructions per scheduler and cycle, DRAM 28 %). v rows are copied as raw bits
// (NaN payloads kept). The same arithmetic per row as qk_norm_sd35_kernel.
// STAGED (the default where it applies; rows 16-byte aligned, the token's 3H rows within 48 KB): the block
// first copies its token's rows into shared memory with cp.async (8 copies of 16 bytes per row, all in flight at
// once), row r at element 64 r, then reads them from there.
// VCOPY (with STAGED; the default where v_out is 16-byte aligned, DIFUSE_QK_VCOPY=0 turns it off): only the
// q and k rows are staged and go through the slots; the v rows, which the eager chain only concatenates, are copied
// global to global in 16-byte vectors by the whole block while the staging copies are in flight (8 threads per
// row): a third of the rows no longer pay the loads, the sum, the tree and 2-byte stores of a normalised row.
// WARPS: warps per token's block, 8 (4 for the staged v-copy kernel under DIFUSE_QK_SD35_WARPS=4: what every warp
// spends once per block, ~155 SASS instructions before the row loop and the staging and v-copy loops' setup, is then
// spread over twice the rows; slower on the H200 all the same). Which warp takes which row only.
// VSMEM (with VCOPY; the default, DIFUSE_QK_SD35_VCOPY_SMEM=0 turns it off): the v rows are staged with the q and k
// rows and copied from shared memory to the output after the warp's slots (copy_staged_rows_out), not global to global
// before the barrier; they still skip the slots.
// OSMEM (with VSMEM; DIFUSE_QK_SD35_OUT_SMEM=1, for measurement): the slots write each normalised q and k element
// back over its staged input (the same lane, the same shared-memory half-word) instead of to global memory, and
// after a second barrier the whole block copies all 3H rows out in 16-byte vectors (copy_staged_rows_out): a half
// warp's 2-byte stores reach L2 as 32-byte pieces of two rows per instruction (4 per 128-byte row; FLUX's
// half-warp rows, 8 bytes per lane, write a whole 128-byte line per half warp), the copy as whole lines. Also no
// output address per slot. The same bits (stores only).
// BULK (DIFUSE_QK_BULK=1|2, for measurement; with VSMEM, each role's head rows of a token contiguous, as the
// transposed views of SD3.5's projections are): the token's 3H rows staged by the bulk copy engine, one copy per
// role issued by thread 0 and completing on an mbarrier (bulk_stage_token_rows), not 16-byte cp.async copies by every
// thread. BULK = 2 (with OSMEM): the rows written back as OSMEM does, then each of the 3H rows stored to its output
// row by one bulk copy (128 bytes; a thread per row) instead of the block's 16-byte vectors. Copies only.
template <int R, int MIN_BLOCKS, bool STAGED = false, bool VCOPY = false, int WARPS = kWarps, bool VSMEM = false,
          bool LEAN = false, bool OSMEM = false, int BULK = 0>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) qk_norm_sd35_half_warp64(const Params p) {
  static_assert(!VCOPY || STAGED, "the v copy rides on the staged kernel's 16-byte aligned rows");
  static_assert(!VCOPY || R == 1, "VCOPY's rows need no bounds test only with one slot per warp and step");
  static_assert(!VSMEM || VCOPY, "VSMEM copies the v rows the VCOPY kernel keeps out of its slots");
  static_assert(!LEAN || VSMEM, "LEAN trims the VSMEM kernel's slots");
  static_assert(!OSMEM || (VSMEM && !LEAN), "OSMEM writes the VSMEM kernel's slots back to shared memory");
  static_assert(BULK == 0 || VSMEM, "the bulk staging stages all 3H rows, as VSMEM does");
  static_assert(BULK != 2 || OSMEM, "the bulk stores copy out the rows OSMEM writes back");
  constexpr int D = 64;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int u = lane % 16, seg = lane / 16;
  uint32_t sj32;  // B * S < 2^31 (predicate): blockIdx.x < 2^31, as FastDivU32 needs
  const int64_t b = p.seq.divmod(blockIdx.x, sj32);
  const int64_t sj = sj32;
  const bool in_img = sj < p.img.S;
  const int64_t s = in_img ? sj : sj - p.img.S;

  const Stream& st = in_img ? p.img : p.ctx;
  const TokenRows tr(st.t[0], st.t[1], st.t[2], b, s);
  // Weights at this lane's elements j and j + 1 (j = 0, 2) packed as bf16 pairs (registers: 40 at 6 blocks per
  // SM); an absent weight is 1 (norm::diffusers_rms_bits).
  uint32_t wq[2], wk[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t one = 0x3f80u;  // bf16 1.0
    wq[j] = st.w[0] != nullptr ? st.w[0][u + 32 * j] | (uint32_t{st.w[0][u + 32 * j + 16]} << 16) : one | (one << 16);
    wk[j] = st.w[1] != nullptr ? st.w[1][u + 32 * j] | (uint32_t{st.w[1][u + 32 * j + 16]} << 16) : one | (one << 16);
  }
  const int64_t out_token = (b * p.H * p.S + sj) * D + u;  // this lane's first element of head 0's output row
  const int64_t out_head = p.S * D;
  // LEAN: the q and k output bases of this lane, and the head stride in bytes (head * S * D < 2^30 elements: each
  // stream's B * H * S * D <= 2^29), so a row's address is one 32 x 32 -> 64-bit multiply-add
  char* const out_q = reinterpret_cast<char*>(p.out[0] + out_token);
  char* const out_k = reinterpret_cast<char*>(p.out[1] + out_token);
  const uint32_t out_head_bytes = static_cast<uint32_t>(out_head * sizeof(uint16_t));

  const int rows = (VCOPY ? 2 : 3) * p.H;  // the rows that go through the slots
  // STAGED: the token's rows, row r at 16-byte chunk 8 r. 128-byte aligned for BULK, whose `bar` it followed 16 B
  // past a line (timed so at 951f281; kBulkStagingAlign); the other variants have no static shared memory before it.
  extern __shared__ __align__(128) uint4 staged64[];
  if constexpr (BULK > 0) {
    __shared__ uint64_t bar;
    bulk_stage_token_rows<128>(staged64, tr, p.H, 3, &bar);
    __syncthreads();  // the barrier's initialisation
    detail::mbar_wait(&bar, 0);
  } else if constexpr (STAGED) {
    // 8 copies of 16 bytes per 64-element row
    stage_token_rows<8, WARPS * 32>(staged64, tr, p.H, VCOPY && !VSMEM ? 2 : 3);
    if constexpr (VCOPY && !VSMEM)  // head h's v row to output row (b, h, sj): head stride S * D
      copy_v_rows<8, WARPS * 32>(tr.row(2, 0), tr.sh[2], p.out[2] + (b * p.H * p.S + sj) * D, out_head, p.H);
    norm::cp_async_wait_all();
    __syncthreads();
  }
  const int slots = (rows + 1) / 2;
  for (int base = warp; base < slots; base += WARPS * R) {
    uint32_t raw[R][4];  // the bits, zero-extended (a 16-bit array costs a byte-permute per element)
    float x[R][4];
    uint32_t role_of[R], head_of[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int r = 2 * (base + q * WARPS) + seg;
      // VCOPY (R == 1): rows = 2H is even and base < slots = H, so r < rows: no bounds test, no zero fill
      if constexpr (LEAN || OSMEM) {  // r < 2H: k's rows are r >= H, no divider
        role_of[q] = r >= p.H ? 1u : 0u;
        head_of[q] = static_cast<uint32_t>(r - (role_of[q] ? p.H : 0));
      } else {
        role_of[q] = VCOPY ? p.heads.divmod(static_cast<uint32_t>(r), head_of[q])
                           : role_and_head(p.heads, r, rows, head_of[q]);
      }
      const uint16_t* row = (STAGED ? reinterpret_cast<const uint16_t*>(staged64 + 8 * r)
                                    : tr.row(role_of[q] < 3 ? role_of[q] : 0, head_of[q])) + u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        raw[q][j] = VCOPY || role_of[q] < 3 ? row[16 * j] : 0u;
        x[q][j] = num::bf16_to_float(static_cast<uint16_t>(raw[q][j]));
      }
    }
    float rstd[R];
    norm::head64_rstd_half_warp<R, LEAN>(x, st.factor, p.eps, rstd);  // every slot: the shuffles need the whole warp
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const uint32_t role = role_of[q];  // 0 q, 1 k, 2 v (copied as is, raw bits), 3 past the end
      if (!VCOPY && role > 2) continue;  // no shuffle follows: a half warp may skip alone (VCOPY: role 0 or 1)
      // STAGED: p.out[role] is one indexed constant load where the selects cost ~8 instructions per row
      uint16_t* o = OSMEM ? reinterpret_cast<uint16_t*>(staged64 + 8 * (2 * (base + q * WARPS) + seg)) + u
                    : LEAN ? reinterpret_cast<uint16_t*>((role ? out_k : out_q) +
                                                         static_cast<uint64_t>(head_of[q]) * out_head_bytes)
                           : (STAGED ? p.out[role] : by_role(role, p.out[0], p.out[1], p.out[2])) + out_token +
                                 head_of[q] * out_head;
      if (VCOPY || role < 2) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t wpair = role == 0 ? wq[j / 2] : wk[j / 2];
          o[16 * j] = norm::diffusers_rms_bits(x[q][j], rstd[q], j % 2 ? num::bf16_hi(wpair) : num::bf16_lo(wpair));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) o[16 * j] = static_cast<uint16_t>(raw[q][j]);
      }
    }
  }
  if constexpr (BULK == 2) {  // every slot's q and k rows written back: then each of the 3H rows by one bulk copy
    detail::fence_proxy_async_smem();
    __syncthreads();
#pragma unroll
    for (int role = 0; role < 3; ++role)
      for (int h = static_cast<int>(threadIdx.x); h < p.H; h += WARPS * 32)
        detail::bulk_store(p.out[role] + (out_token - u) + h * out_head, staged64 + 8 * (role * p.H + h), 128);
    detail::bulk_commit();
    detail::bulk_wait_reads();
    return;
  }
  if constexpr (OSMEM) {  // every slot's q and k rows written back: then all 3H rows out, one role at a time
    __syncthreads();
#pragma unroll
    for (int role = 0; role < 3; ++role)
      copy_staged_rows_out<8, WARPS * 32, true>(staged64 + 8 * role * p.H, p.out[role] + (out_token - u), out_head, p.H);
    return;
  }
  // VSMEM: the v rows (staged rows 2H .. 3H - 1) out after the slots, so that none of the copy's registers is live in
  // the row loop (before it, the loop spilled)
  if constexpr (VSMEM)
    copy_staged_rows_out<8, WARPS * 32>(staged64 + 8 * 2 * p.H, p.out[2] + (out_token - u), out_head, p.H);
}

}  // namespace

detail::Support can_use_qk_norm_sd35(const QkNormSd35Args& a) {
  using namespace heads;
  detail::Support s;
  const char* layout = "[B, heads, S, head_dim] (the transposed views)";
  bool shapes = require_view(s, a.q, "q", layout);
  shapes = require_view(s, a.k, "k", layout) && shapes;
  shapes = require_view(s, a.v, "v", layout) && shapes;
  shapes = require_view(s, a.q_ctx, "q_ctx", layout) && shapes;
  shapes = require_view(s, a.k_ctx, "k_ctx", layout) && shapes;
  shapes = require_view(s, a.v_ctx, "v_ctx", layout) && shapes;
  if (!shapes) return s;

  const int64_t B = a.q.sizes[0], H = a.q.sizes[1], S1 = a.q.sizes[2], D = a.q.sizes[3];
  const int64_t S2 = a.q_ctx.sizes[2];
  const int dev = a.q.device;
  require_head_dim(s, D);
  const int E = norm::head_lane_elems(static_cast<int>(D));
  const int64_t img[4] = {B, H, S1, D}, ctx[4] = {B, H, S2, D};
  require_stream(s, {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}}, img, dev,
                 "k and v must have q's shape and device " + detail::describe(a.q), E);
  require_stream(s, {{&a.q_ctx, "q_ctx"}, {&a.k_ctx, "k_ctx"}, {&a.v_ctx, "v_ctx"}}, ctx, dev,
                 "q_ctx, k_ctx and v_ctx must be [" + std::to_string(B) + ", " + std::to_string(H) + ", S_ctx, " +
                     std::to_string(D) + "] alike on q's device", E);
  require_norm_rows(s, "image", B * H * S1, D);
  require_norm_rows(s, "context", B * H * S2, D);
  const int64_t S = S1 + S2;
  DIFUSE_REQUIRE(s, B * S <= int64_t{2147483647}, "at most 2^31 - 1 joint tokens in the batch");
  DIFUSE_REQUIRE(s, H >= 1 && H <= 4096, "heads must be in [1, 4096], got " + std::to_string(H));
  require_weight(s, a.q_weight, "q_weight", D, dev);
  require_weight(s, a.k_weight, "k_weight", D, dev);
  require_weight(s, a.q_ctx_weight, "q_ctx_weight", D, dev);
  require_weight(s, a.k_ctx_weight, "k_ctx_weight", D, dev);
  const std::initializer_list<const difuse_tensor_view*> inputs = {
      &a.q, &a.k, &a.v, &a.q_ctx, &a.k_ctx, &a.v_ctx, &a.q_weight, &a.k_weight, &a.q_ctx_weight, &a.k_ctx_weight};
  const int64_t joint[4] = {B, H, S, D};
  require_joint_outputs(s, a.q_out, a.k_out, a.v_out, joint, dev, inputs);
  return s;
}

void qk_norm_sd35(const QkNormSd35Args& a, cudaStream_t stream) {
  const detail::Support s = can_use_qk_norm_sd35(a);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_sd35"));
  const int64_t B = a.q.sizes[0], H = a.q.sizes[1], D = a.q.sizes[3];
  const auto stream_of = [&](const difuse_tensor_view& q, const difuse_tensor_view& k, const difuse_tensor_view& v,
                             const difuse_tensor_view& wq, const difuse_tensor_view& wk) {
    Stream st;
    static_cast<StreamViews&>(st) = stream_views(q, k, v, wq, wk, 2, 1);
    st.S = q.sizes[2];
    st.factor = norm::diffusers_mean_factor(B * H * st.S, D);
    return st;
  };
  Params p{};
  p.img = stream_of(a.q, a.k, a.v, a.q_weight, a.k_weight);
  p.ctx = stream_of(a.q_ctx, a.k_ctx, a.v_ctx, a.q_ctx_weight, a.k_ctx_weight);
  p.out[0] = static_cast<uint16_t*>(a.q_out.data);
  p.out[1] = static_cast<uint16_t*>(a.k_out.data);
  p.out[2] = static_cast<uint16_t*>(a.v_out.data);
  p.S = p.img.S + p.ctx.S;
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
  const dim3 grid(static_cast<unsigned>(blocks)), block(kWarps * 32);
  // Rows a warp loads before reducing: at head_dim 64 a row is 128 bytes, so 2 rows per warp keep, by count, ~12 KB
  // in flight per SM (48 warps x 2 x 128 B). 2 x 38 x 4429 x 64 on the H200: 248.6 us with per-row divisions,
  // 184.2 us without (6408223; 3x the floor); DIFUSE_QK_ROWS_PER_WARP=4|8 select variants with more loads in
  // flight and fewer resident blocks (same arithmetic per row): 189.5 and 197.4 us there, so 2 stays.
  const int knob = rows_per_warp_knob();
  const int per_warp = knob >= 8 ? 8 : knob >= 4 ? 4 : 2;
  // head_dim 64 (SD3.5's) by default on half a warp, 2 slots of two rows per warp (4 with DIFUSE_QK_ROWS_PER_WARP
  // >= 4). H200 at daa91f6 (knob-sweeps/): 2x38x4429x64 99.6 us vs 162.1 on full warps, 1x 52.4 vs 84.9.
  // DIFUSE_QK_LANES_PER_ROW=32 (for measurement) keeps the full-warp kernels.
  static const int lanes_knob = detail::positive_env_knob("DIFUSE_QK_LANES_PER_ROW");
  // Default where it applies: the staged kernel (H200 at 66f5a3b, knob-sweeps/: 2x38x4429x64 95.0 us vs 100.0
  // per-row, 1x 50.0 vs 52.5). DIFUSE_QK_UNSTAGED=1, or either knob above, keeps the per-row kernels.
  static const int unstaged_knob = detail::positive_env_knob("DIFUSE_QK_UNSTAGED");
  const size_t staged_bytes = static_cast<size_t>(3) * p.H * 64 * sizeof(uint16_t);
  // The v copies are the default where v_out is 16-byte aligned (H200 at 5f8295d, knob-sweeps/: 2x38x4429x64
  // 80.7 us vs 94.5 with v staged, 1x 44.1 vs 49.4); DIFUSE_QK_VCOPY=0 (for measurement) stages v as well.
  static const int vcopy_knob = detail::env_knob_or("DIFUSE_QK_VCOPY", 1);
  if (lanes_knob != 32 && knob == 0 && unstaged_knob != 1 && p.D == 64 && staged_bytes <= 48 * 1024 &&
      head_rows_aligned16({&p.img, &p.ctx})) {
    if (vcopy_knob != 0 && detail::aligned(p.out[2], 16)) {  // v rows copied, not staged: 2H rows in shared memory
      // 8 warps per token, 8 blocks per SM. DIFUSE_QK_SD35_WARPS=4 (for measurement): 4 warps per token, 16 blocks
      // per SM (the same 64 warps per SM; 9.7 KB per block at 38 heads), which halves the per-block instructions
      // per row and was predicted 75.5 -> ~69 us at 2x38x4429x64, but measured 79.9 vs 75.6 (H200 at eb1307d,
      // knob-sweeps/; it was the default at eb1307d, where this file's 257 tests passed with it).
      // v staged with q and k (3H rows in shared memory, 14.6 KB at 38 heads) and copied out after the slots
      // (copy_staged_rows_out): at 38 heads 48 of a block's 256 threads no longer wait two DRAM round trips in turn for
      // their v copies before the barrier. Data movement only. Predicted 2x38x4429x64 75.6 -> ~72 us; measured 72.7
      // vs 75.6 (4 warps: 73.2; H200 at f7a86a5, knob-sweeps/f7a86a5/), so it is the default;
      // DIFUSE_QK_SD35_VCOPY_SMEM=0 (for measurement) keeps the global-to-global v copies before the barrier.
      static const int warps_knob = detail::positive_env_knob("DIFUSE_QK_SD35_WARPS");
      static const int vsmem_knob = detail::env_knob_or("DIFUSE_QK_SD35_VCOPY_SMEM", 1);
      // DIFUSE_QK_SD35_LEAN=1 (for measurement; with VSMEM on 8 warps, where eps >= FLT_MIN, as SD3.5's 1e-6): per
      // slot, k's rows found by a compare instead of the head divider, the output row's address as one multiply-add
      // from per-role bases, the tree's steps as a butterfly (no broadcast shuffle), rsqrtf without its subnormal
      // scaling (eps >= FLT_MIN makes RN(mean + eps) normal): the same bits, row loop 89 -> 74 SASS instructions
      // (134 -> 118 before it). Predicted ~73 -> ~71 us at 2x38x4429x64 (ncu at e383706 had the kernel near
      // issue-bound); measured 73.8 vs 73.7 (fused 73.5 vs 73.0; H200 at f1e1d95, where it was the default and this
      // file's 275 tests passed): 13 % fewer instructions, no faster, so the kernel is no longer issue-bound.
      static const int lean_knob = detail::positive_env_knob("DIFUSE_QK_SD35_LEAN");
      // DIFUSE_QK_SD35_OUT_SMEM=1 (for measurement; with VSMEM on 8 warps; before LEAN): the normalised q and k rows
      // written back to shared memory and copied out with the v rows in 16-byte vectors after a second barrier
      // (OSMEM above). ncu at 1195fc2 (1x38x4429x64): DRAM 62 % vs FLUX's 72 %, issue 0.81 per scheduler, and the
      // lean slots' 13 % fewer instructions bought nothing, so what the stores look like to L2 is the next suspect:
      // the default's 2-byte stores reach it as 4 pieces of 32 bytes per 128-byte row, 304 write requests per
      // 38-head token where the copy makes 114 whole lines. Predicted 2x38x4429x64 73.5 -> ~68 us if that is the
      // limit (FLUX's 2x at 89 % of its floor), unchanged if not.
      static const int osmem_knob = detail::positive_env_knob("DIFUSE_QK_SD35_OUT_SMEM");
      const size_t bytes = staged_bytes / 3 * 2;
      // DIFUSE_QK_BULK=1|2 (for measurement): the staging (and with =2 the stores) by the bulk copy engine (BULK above)
      static const int bulk_knob = detail::positive_env_knob("DIFUSE_QK_BULK");
      const bool bulk = bulk_knob >= 1 && vsmem_knob != 0 && head_rows_contiguous({&p.img, &p.ctx}, 64) &&
                        staged_bytes + kBulkStagingAlign <= 48 * 1024 && detail::aligned(p.out[0], 16) &&
                        detail::aligned(p.out[1], 16);
      if (bulk && bulk_knob >= 2)
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true, 8, true, false, true, 2>>(
            p, grid, block, staged_bytes, a.q.device, stream);
      else if (bulk)
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true, 8, true, false, false, 1>>(
            p, grid, block, staged_bytes, a.q.device, stream);
      else if (vsmem_knob != 0 && warps_knob == 4)
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 16, true, true, 4, true>>(p, grid, dim3(4 * 32),
                                                                                       staged_bytes, a.q.device,
                                                                                       stream);
      else if (vsmem_knob != 0 && osmem_knob == 1 && detail::aligned(p.out[0], 16) &&
               detail::aligned(p.out[1], 16))  // copy_staged_rows_out stores 16 bytes to every role's rows
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true, 8, true, false, true>>(
            p, grid, block, staged_bytes, a.q.device, stream);
      else if (vsmem_knob != 0 && lean_knob == 1 && p.eps >= std::numeric_limits<float>::min())
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true, 8, true, true>>(p, grid, block, staged_bytes,
                                                                                            a.q.device, stream);
      else if (vsmem_knob != 0)
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true, 8, true>>(p, grid, block, staged_bytes,
                                                                                      a.q.device, stream);
      else if (warps_knob == 4)
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 16, true, true, 4>>(p, grid, dim3(4 * 32), bytes,
                                                                                 a.q.device, stream);
      else
        norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true, true>>(p, grid, block, bytes, a.q.device,
                                                                             stream);
    } else {  // most shared memory: 8 blocks of ~15 KB per SM
      norm::launch_max_shared<qk_norm_sd35_half_warp64<1, 8, true>>(p, grid, block, staged_bytes, a.q.device,
                                                                     stream);
    }
  } else if (lanes_knob != 32 && p.D == 64) {
    if (knob >= 4)
      qk_norm_sd35_half_warp64<4, 4><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_sd35_half_warp64<2, 6><<<grid, block, 0, stream>>>(p);
  } else if (E == 4) {
    if (per_warp == 8)
      qk_norm_sd35_kernel<4, 8, 2><<<grid, block, 0, stream>>>(p);
    else if (per_warp == 4)
      qk_norm_sd35_kernel<4, 4, 4><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_sd35_kernel<4, 2, 6><<<grid, block, 0, stream>>>(p);
  } else {
    if (per_warp == 8)
      qk_norm_sd35_kernel<2, 8, 3><<<grid, block, 0, stream>>>(p);
    else if (per_warp == 4)
      qk_norm_sd35_kernel<2, 4, 5><<<grid, block, 0, stream>>>(p);
    else if (p.D == 64)  // SD3.5's head_dim, fixed at compile time
      qk_norm_sd35_kernel<2, 2, 6, 64><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_sd35_kernel<2, 2, 6><<<grid, block, 0, stream>>>(p);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
