// The staged attention-prologue kernels' shared pieces (qk_norm_rope, qk_norm_rope_qwen, qk_norm_sd35; the default
// where rows are 16-byte aligned): a block copies all of its token's head rows into shared memory with cp.async,
// every copy in flight at once, before its per-row arithmetic (unchanged) reads them from there; the pipelined
// variants overlap the next token's copies with the current token's arithmetic; the bulk variants
// (bulk_stage_token_rows; Qwen-Image's default since bb10c7e) stage the same layout with one bulk copy per role.
// Index and copy code only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "core/bulk_copy.cuh"
#include "core/fast_div.h"
#include "core/tensor.h"
#include "norm/row_staging.cuh"
#include "rope/token_rows.cuh"

namespace difuse::rope {

// Issues the copies of a token's `roles` x H head rows (row r = role * H + head, CHUNKS 16-byte chunks each) into
// dst, chunk c of row r at dst[r * CHUNKS + c]; the block's THREADS threads share them. The caller waits
// (cp_async_wait_all) and synchronises the block.
// Thread t always copies chunk t % CHUNKS, of heads t / CHUNKS, + THREADS / CHUNKS, ... of each role, walking
// source and destination by fixed steps: ~6 instructions per copy, where dividing each chunk index into role,
// head and part and selecting the role's base and stride cost ~30 (a third of a FLUX prologue block's
// instructions went to staging). The same copies, only issued by other threads.
template <int CHUNKS, int THREADS>
__device__ __forceinline__ void stage_token_rows(uint4* dst, const TokenRows& tr, int H, int roles) {
  static_assert(THREADS % CHUNKS == 0, "each thread keeps one chunk position");
  constexpr int kHeadsPerPass = THREADS / CHUNKS;
  const int part = static_cast<int>(threadIdx.x) % CHUNKS;
  const int first = static_cast<int>(threadIdx.x) / CHUNKS;
#pragma unroll
  for (int role = 0; role < 3; ++role) {  // unrolled: tr's arrays indexed by constants stay in registers
    if (role >= roles) break;
    const int64_t step = kHeadsPerPass * tr.sh[role];
    const uint16_t* src = tr.at[role] + first * tr.sh[role] + part * 8;
    uint4* d = dst + (role * H + first) * CHUNKS + part;
#pragma unroll 1  // a few copies per thread and role; unrolled, the three roles' loops bloat the kernel and spill
    for (int head = first; head < H; head += kHeadsPerPass, src += step, d += kHeadsPerPass * CHUNKS)
      norm::cp_async(d, src, true);
  }
}

// The DIFUSE_QK_BULK kernels' dynamic shared memory (the staged rows) is declared __align__(128) and starts on a
// 128-byte line: at 951f281, with the default 16-byte alignment, it followed their `bar` mbarrier 16 B past a line,
// so every bulk copy into it straddled lines (staged Qwen-Image txt512 50.8 us against the cp.async kernel's 49.4,
// SD3.5 2x38x4429x64 76.9 against 72.5). The streamed LayerNorms' rings, aligned the same way at 5d3eadf, took
// layernorm_modulate 1x32760x5120 from 184.4 to 179.7 us (rev-bench/aa41dda/). ptxas counts the padding in the
// static shared memory (128 B); the host guards leave kBulkStagingAlign bytes for it under the 48 KB default.
constexpr size_t kBulkStagingAlign = 128;

// The bulk-copy staging (the DIFUSE_QK_BULK kernels): thread 0 initialises `bar` and issues one bulk copy per role of
// the token's H head rows, which lie contiguous in global memory (head stride = ROW_BYTES / 2 elements; 16-byte
// aligned), to dst + role * H * ROW_BYTES: the layout stage_token_rows makes. The caller synchronises the block
// (which also publishes the barrier's initialisation) before every thread waits on `bar` with parity 0.
template <int ROW_BYTES>
__device__ __forceinline__ void bulk_stage_token_rows(uint4* dst, const TokenRows& tr, int H, int roles, uint64_t* bar) {
  if (threadIdx.x != 0) return;
  const uint32_t bytes = static_cast<uint32_t>(H) * ROW_BYTES;
  detail::mbar_init(bar, 1);
  detail::fence_mbarrier_init();
  detail::mbar_arrive_expect_tx(bar, static_cast<uint32_t>(roles) * bytes);
#pragma unroll
  for (int role = 0; role < 3; ++role)
    if (role < roles) detail::bulk_load(reinterpret_cast<char*>(dst) + role * bytes, tr.at[role], bytes, bar);
}

// Host: every present q, k, v view of the streams has each token's head rows contiguous (head stride `row_elems`),
// as bulk_stage_token_rows' one copy per role needs; absent views fail it.
inline bool head_rows_contiguous(std::initializer_list<const StreamViews*> streams, int64_t row_elems) {
  for (const StreamViews* st : streams)
    for (const HeadView& v : st->t)
      if (v.data == nullptr || v.sh != row_elems) return false;
  return true;
}

// A token's v rows (which the eager chains only concatenate) copied global to global in 16-byte vectors by the
// whole block, CHUNKS vectors per row: head h's row from src + h * src_head to dst + h * dst_head (elements; rows
// 16-byte aligned). The v-copy variants (DIFUSE_QK_VCOPY=1) call it beside the staging copies, so v rows skip the
// shared memory and the per-row arithmetic.
template <int CHUNKS, int THREADS>
__device__ __forceinline__ void copy_v_rows(const uint16_t* src, int64_t src_head, uint16_t* dst, int64_t dst_head,
                                            int heads) {
  static_assert((CHUNKS & (CHUNKS - 1)) == 0, "a power of two: the row and part by shift and mask");
  for (unsigned c = threadIdx.x; c < static_cast<unsigned>(CHUNKS * heads); c += THREADS) {
    const unsigned head = c / CHUNKS, part = c % CHUNKS;
    *reinterpret_cast<uint4*>(dst + head * dst_head + 8 * part) =
        *reinterpret_cast<const uint4*>(src + head * src_head + 8 * part);
  }
}

// Rows already in shared memory copied out by the whole block after its barrier (qk_norm_sd35's default: its v rows,
// staged with q and k, after the warps' slots; under DIFUSE_QK_SD35_OUT_SMEM=1 also the normalised q and k rows,
// which the slots wrote back in place): `heads` rows at src (CHUNKS 16-byte vectors per row, row h at
// src + h * CHUNKS) to dst + h * dst_head (elements; 16-byte aligned). copy_v_rows' global loads make a thread with
// k vectors wait k DRAM round trips in turn before the barrier (its store needs its load; 48 of 256 threads take 2
// at SD3.5's 38 heads); here the rows' loads are the staging's cp.async copies, all in flight at once, and a
// vector's wait is a shared-memory load. The same copies.
// ROLLED: the loop kept a loop (three roles' unrolled copies spill the qk_norm_sd35 kernel under
// DIFUSE_QK_SD35_OUT_SMEM=1); the same copies.
template <int CHUNKS, int THREADS, bool ROLLED = false>
__device__ __forceinline__ void copy_staged_rows_out(const uint4* src, uint16_t* dst, int64_t dst_head, int heads) {
  static_assert(THREADS % CHUNKS == 0, "each thread keeps one chunk position");
  constexpr int kHeadsPerPass = THREADS / CHUNKS;
  const int part = static_cast<int>(threadIdx.x) % CHUNKS;
  const int first = static_cast<int>(threadIdx.x) / CHUNKS;
  const int64_t step = kHeadsPerPass * dst_head;
  uint16_t* d = dst + first * dst_head + 8 * part;
  if constexpr (ROLLED) {
#pragma unroll 1
    for (int head = first; head < heads; head += kHeadsPerPass, d += step)
      *reinterpret_cast<uint4*>(d) = src[head * CHUNKS + part];
  } else {
    for (int head = first; head < heads; head += kHeadsPerPass, d += step)
      *reinterpret_cast<uint4*>(d) = src[head * CHUNKS + part];
  }
}

// One block per token (blockIdx.x): STAGED, stage(token, smem) issues its copies, the block waits for them and
// synchronises; then run(token, smem).
template <bool STAGED, class Stage, class Run>
__device__ __forceinline__ void block_token(uint4* smem, Stage stage, Run run) {
  if constexpr (STAGED) {
    stage(blockIdx.x, smem);
    norm::cp_async_wait_all();
    __syncthreads();
  }
  run(blockIdx.x, smem);
}

// The pipelined token loop (DIFUSE_QK_PIPELINED=1): a block takes tokens blockIdx.x, + gridDim.x, ... (tokens <
// 2^31) with two shared buffers of `buffer` 16-byte vectors from smem; stage(token, dst) issues the cp.async copies
// of a token's rows and tables into dst, run(token, src) computes it from src. The next token's copies are in
// flight (their own cp.async group) while the current token is computed.
template <class Stage, class Run>
__device__ __forceinline__ void pipelined_tokens(unsigned tokens, int buffer, uint4* smem, Stage stage, Run run) {
  unsigned token = blockIdx.x;
  if (token < tokens) stage(token, smem);
  norm::cp_async_commit();
  for (int i = 0; token < tokens; ++i, token += gridDim.x) {
    const unsigned next = token + gridDim.x;  // no wrap: tokens < 2^31 and gridDim.x <= tokens
    if (next < tokens) stage(next, smem + ((i + 1) & 1) * buffer);
    norm::cp_async_commit();
    norm::cp_async_wait_group<1>();  // this thread's copies of `token` have landed
    __syncthreads();                 // and every thread's
    run(token, smem + (i & 1) * buffer);
    __syncthreads();  // the buffer is staged into again two iterations on
  }
}

// Host: launches a pipelined kernel, kernel(p, tokens), over `tokens` (< 2^31) tokens with two buffers of
// buffer_bytes each: a grid of the resident blocks (at most `cap` when cap >= 2, DIFUSE_QK_PIPELINED=N for tests),
// the largest shared-memory carveout set once per device through `carveout_set`.
template <class Kernel, class P>
void launch_pipelined(Kernel kernel, const P& p, int64_t tokens, size_t buffer_bytes, int cap, int threads,
                      int device, cudaStream_t stream, std::atomic<uint64_t>& carveout_set) {
  norm::prefer_max_shared_carveout(kernel, device, carveout_set);
  int64_t blocks = std::min(tokens, norm::resident_blocks(kernel, threads, 2 * buffer_bytes, device));
  if (cap >= 2) blocks = std::min<int64_t>(blocks, cap);
  kernel<<<static_cast<unsigned>(blocks), threads, 2 * buffer_bytes, stream>>>(p, static_cast<unsigned>(tokens));
}

// Host: every present q, k, v view of the streams has 16-byte aligned rows (pointer, batch, sequence and head
// strides), as stage_token_rows' 16-byte copies need.
inline bool head_rows_aligned16(std::initializer_list<const StreamViews*> streams) {
  for (const StreamViews* st : streams)
    for (const HeadView& v : st->t)
      if (v.data != nullptr && (!detail::aligned(v.data, 16) || v.sb % 8 != 0 || v.ss % 8 != 0 || v.sh % 8 != 0))
        return false;
  return true;
}

}  // namespace difuse::rope
