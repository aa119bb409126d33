// stream_copy — the streaming ceiling the benchmarks measure each op against (not an op; no eager chain, no gate).
//
// What it is: dst = src in 16-byte vectors, each thread loading `U` vectors (coalesced: vector u of a block's chunk
// at u * blockDim + threadIdx) before it stores them, over a one-pass grid (a block per chunk of U * blockDim
// vectors) or the resident blocks striding over the chunks, with the default cache policy or evict-first
// (ld/st.global.cs): 64 variants. Four more move the bytes with the bulk copy engine instead (sm_90's TMA, non-tensor
// form, core/bulk_copy.cuh): a one-warp block per chunk of 4, 8, 16 or 32 KB, whose lane 0 loads the chunk into shared
// memory with one bulk copy, waits on an mbarrier and stores it with one bulk copy (variants 64-67). Three more
// (68-70, twentieth session) run the streamed norms' schedule with no arithmetic (norm/stream_rows.cuh: one block
// per SM, a producer lane bulk-copying rows of 3072 or 6144 bytes into a ring of up to 48 slots, 24 consumer warps of
// one row each): each warp stores its row from registers (16-byte vectors, every load of the row before its
// stores, as the norms' epilogues) or, ring3072_w24_bulk, by one bulk copy from the slot. They say whether that
// schedule alone reaches the ceiling at the norms' narrow rows (1536 bf16 = 3072 bytes), where every streamed norm
// runs at ~1.23x stream_us. It does not (H200 at 9da6d1b, scripts/stream-variants.py, stream-variants-9da6d1b.json):
// at 201.3 MB, 1x32760x1536's bytes, 58.0 us (stg), 58.5 (bulk), 56.3 (6144-byte rows) against 50.5 for the fastest
// one-pass vector copy, whose resident-grid forms take 54.1-57.7; the streamed rms_norm took 62.0 in the same call.
// The schedule (resident blocks, rows strided over them), not the arithmetic, costs most of the gap. At 50.3 MB:
// 17.6 / 17.2 / 16.9 against 16.0. Exact copies at 9da6d1b (test_stream_copy.py, every variant, gpu-tests-9da6d1b.json).
// A one-pass form (blocks of 128 contiguous rows) measured 57.5 at 201 MB at bfef2d5 (not a record: that run stopped
// at a 2-blocks-per-SM form that did not finish, cause not found; both removed). `bench ops` times
// all of them at each record's byte count (rotating buffers like the op's inputs, the same CUDA-event harness),
// re-times the fastest and records it as stream_us: what a kernel that does nothing but move those bytes needs at
// that size in this harness.
//
// Guards (every violation reported): non-NULL 16-byte aligned pointers, nbytes > 0 and % 16 == 0, no overlap,
// variant in range. Verified on the H200 at 26d5552: tests/gpu/test_stream_copy.py (every variant, sizes with partial
// chunks, the bytes after the end untouched; gpu-tests-26d5552.json) and the native smoke test's probe case under
// memcheck, racecheck and initcheck (sanitizer-26d5552.txt). First stream_us column: ops.json at 26d5552.
// The bulk variants: every variant's test passed at 951f281 (gpu-tests-951f281.json), the smoke case under memcheck
// and racecheck at 546c39e (sanitizer-bulk-546c39e.txt). They were the fastest in 3 of ops.json's 66 records at
// 951f281, all under 40 MB and within the run-to-run spread of the vector variants; from ~50 MB up a one-pass grid of
// one 16-byte vector per thread stays the ceiling.
// Twenty-first session: ring variants 71-74 take rows from a grid-wide counter (norm::stream_produce_grabbed; grabs
// of 4 from the counter only, 8 and 16 with a static first grab, guided), 75-78 issue the strided rows from 2, 4 or
// 8 producer lanes in step (6144-byte rows with 4). At 201 MB (stream-variants-846df26.json): 58.6 / 58.1 / 58.5 /
// 61.6 grabbed, 58.2 / 56.6 / 56.3 / 56.5 with lanes, against 58.4 for the one-lane ring and 50.6 for the one-pass
// copy. ring6144_w24_stg (37 slots, 24 warps) hung at 47d0889 (one `full` barrier per slot: norm/stream_rows.cuh);
// with two it ran at 846df26. Every variant copies exactly at 918066b and 47d0889 (gpu-tests-*.json); memcheck and
// racecheck of the smoke test's probe case (every variant) clean at dc1ac5a (sanitizer-knobs-dc1ac5a.txt: the
// grabbed variants of that commit). Written after the last H200 call of that session: variants 79-83, one pass of
// blocks of 128, 64 or 32 contiguous rows at 1-3 blocks per SM (bfef2d5's forms on the fixed protocol), and 84-87,
// warp rings (stream_copy_warp_ring_kernel: each warp its own slots and rows). The grabbed variants take their
// counter from core/grab_counter.h like the streamed norms (until then a __device__ global of this file).
// Twenty-second session, at 201 MB (stream-variants-97817d7.json, one run, 3 reps): none of them reaches the
// one-pass copy (50.5 us). One-pass rings 59.5 (r128) / 55.2 (w12_r64) / 56.6 (w12_p4_r64) / 54.0 (w12_r32) / 55.7
// (w8_r32), warp rings 54.2 / 54.7 / 55.3 / 55.0, against 57.3 for the strided one-lane ring and 55.0 with 4 lanes.
// At 50 MB the best ring (ring6144_w24_stg_p4, 16.6) and warp ring (16.7) against 15.5. Every ring and warp ring ran
// without a hang there, and racecheck of the smoke test's probe case is clean at 45a2975 (racecheck-probe-45a2975.log,
// after the producer lanes' waits were made per step: norm/stream_rows.cuh).
#include "probe/stream_copy.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "core/bulk_copy.cuh"
#include "core/device.h"
#include "core/error.h"
#include "core/grab_counter.h"
#include "norm/row_staging.cuh"
#include "norm/stream_rows.cuh"

namespace difuse::probe {

namespace {

constexpr int kUnrolls[] = {1, 2, 4, 8};
constexpr int kThreads[] = {128, 256, 512, 1024};
constexpr int kVectorVariants = 4 * 4 * 2 * 2;
constexpr int kBulkChunks[] = {4096, 8192, 16384, 32768};
// The ring variants (the streamed norms' schedule without arithmetic). grab: rows taken from the grid's row counter
// (norm::StreamGrab: first, least, most, divisor; most = 0: rows strided over the blocks). At dc1ac5a
// (stream-variants-dc1ac5a.json; every grab from the counter, none static first) fixed grabs of 1, 2 and 4 rows took
// 78.1, 59.7 and 53.5 us at 201 MB against 57.9 strided: the producer waits on the counter's round trip, so grabs must
// not be small. At 918066b (a static first grab, and an integer division per grab on the producer's path) grabs of 4,
// 8, 16 and guided ones took 60.9, 55.4, 55.8 and 57.3. lanes: producer lanes in step (norm::stream_produce, bounded
// by norm::stream_producer_lanes). rows_per_block > 0: one pass of blocks of that many contiguous rows, min_blocks
// of them per SM (each with its share of the SM's shared memory), the hardware handing out the next block as one
// retires; 0: one resident block per SM, rows strided (the norms). The one-pass forms were tried at bfef2d5: 57.5 us
// with 128 rows per block, and the 2-blocks-per-SM form (37 slots for 12 warps) hung, as the one-barrier ring did.
struct RingVariant {
  int row_bytes;
  bool bulk_store;
  norm::StreamGrab grab;
  int lanes, warps, min_blocks;
  int64_t rows_per_block;
};
constexpr norm::StreamGrab kStrided{0, 0, 0, 1};
constexpr RingVariant kRings[] = {
    {3072, false, kStrided, 1, 24, 1, 0},         {3072, true, kStrided, 1, 24, 1, 0},
    {6144, false, kStrided, 1, 24, 1, 0},         {3072, false, {0, 4, 4, 1}, 1, 24, 1, 0},
    {3072, false, {8, 8, 8, 1}, 1, 24, 1, 0},     {3072, false, {16, 16, 16, 1}, 1, 24, 1, 0},
    {3072, false, {8, 2, 32, 2}, 1, 24, 1, 0},    {3072, false, kStrided, 2, 24, 1, 0},
    {3072, false, kStrided, 4, 24, 1, 0},         {3072, false, kStrided, 8, 24, 1, 0},
    {6144, false, kStrided, 4, 24, 1, 0},         {3072, false, kStrided, 1, 24, 1, 128},
    {3072, false, kStrided, 1, 12, 2, 64},        {3072, false, kStrided, 4, 12, 2, 64},
    {3072, false, kStrided, 1, 12, 2, 32},        {3072, false, kStrided, 1, 8, 3, 32}};
constexpr int kRingVariants = sizeof(kRings) / sizeof(kRings[0]);
constexpr int kRingMaxSlots = 48;  // and their ring's most slots
constexpr int kRingMaxVectors = 6144 / 16 / 32;  // 16-byte vectors per lane of the widest ring row
// Warp rings (twenty-first session, after the last H200 call; first run at 97817d7: 54.2-55.3 us at 201 MB, see
// above): no producer warp and no shared ring.
// Each warp owns kWarpSlots slots of its own and a run of `rows_per_warp` contiguous rows; its lane 0 keeps up to
// kWarpSlots row copies in flight (a bulk copy per row into the warp's next slot, completing on that slot's
// mbarrier) while the warp reads the oldest landed row into registers and stores it. 8 warps per block, one pass
// (the hardware hands out blocks as others retire; 48 KB of slots per block at 3 KB rows and 2 slots: 4 blocks per SM).
// The question: is a schedule without the resident ring's single producer nearer the one-pass copy's 50.6 us at 201 MB?
struct WarpRingVariant {
  int row_bytes, slots, rows_per_warp;  // row_bytes <= 3072 (kWarpRingMaxVectors)
};
constexpr WarpRingVariant kWarpRings[] = {{3072, 2, 4}, {3072, 2, 8}, {3072, 2, 16}, {3072, 3, 8}};
constexpr int kWarpRingVariants = sizeof(kWarpRings) / sizeof(kWarpRings[0]);
constexpr int kWarpRingWarps = 8;
constexpr int kWarpRingMaxSlots = 3;
constexpr int kVariants = kVectorVariants + 4 + kRingVariants + kWarpRingVariants;

template <int U, bool CS>
__global__ void __launch_bounds__(1024) stream_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                           int64_t n) {
  const int64_t chunk = int64_t(U) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * chunk; base < n; base += int64_t(gridDim.x) * chunk) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x + threadIdx.x;
      if (i < n) v[u] = CS ? __ldcs(src + i) : src[i];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x + threadIdx.x;
      if (i < n) {
        if (CS)
          __stcs(dst + i, v[u]);
        else
          dst[i] = v[u];
      }
    }
  }
}

// One chunk of C bytes per one-warp block (the last chunk may be shorter, a multiple of 16): lane 0 alone issues the
// bulk load, waits for its bytes, issues the bulk store and waits for the store's reads of shared memory.
template <int C>
__global__ void __launch_bounds__(32) stream_copy_bulk_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                                              int64_t nbytes) {
  __shared__ alignas(128) uint8_t buf[C];
  __shared__ uint64_t bar;
  if (threadIdx.x != 0) return;
  const int64_t off = int64_t(blockIdx.x) * C;
  const uint32_t bytes = static_cast<uint32_t>(nbytes - off < C ? nbytes - off : C);
  detail::mbar_init(&bar, 1);
  detail::fence_mbarrier_init();
  detail::mbar_arrive_expect_tx(&bar, bytes);
  detail::bulk_load(buf, src + off, bytes, &bar);
  detail::mbar_wait(&bar, 0);
  detail::bulk_store(dst + off, buf, bytes);
  detail::bulk_commit();
  detail::bulk_wait_reads();
}

// The ring variants: rows of row_bytes (the last one shorter, a multiple of 16). !GRAB: rows_per_block 0, row r in
// block r % gridDim.x's ring (the streamed norms' schedule); rows_per_block R > 0, block b's rows [b R, (b + 1) R).
// GRAB: each block's producer takes its next rows from the grid's counter whenever it has filled the previous ones
// (norm::stream_produce_grabbed), so a block that streams faster takes more rows.
template <bool BULK_STORE, bool GRAB, int MAXW, int MINB>
__global__ void __launch_bounds__(32 + 32 * MAXW, MINB)
    stream_copy_ring_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t nbytes, int row_bytes,
                            int slots, norm::StreamGrab grab, norm::StreamGrabCounter* counter, int producer_lanes,
                            int full_barriers, int64_t rows_per_block) {
  extern __shared__ uint4 ring_slots[];
  __shared__ uint64_t full[2 * kRingMaxSlots], empty[kRingMaxSlots];
  __shared__ int64_t slot_row[GRAB ? kRingMaxSlots : 1];
  const int64_t rows = (nbytes + row_bytes - 1) / row_bytes;
  const int V = row_bytes / 16;
  const int groups = static_cast<int>(blockDim.x) / 32 - 1;
  const bool one_pass = rows_per_block > 0;
  const int64_t begin = one_pass ? int64_t(blockIdx.x) * rows_per_block : blockIdx.x;
  const int64_t end = one_pass ? (begin + rows_per_block < rows ? begin + rows_per_block : rows) : rows;
  const int64_t stride = one_pass ? 1 : gridDim.x;
  norm::stream_init_barriers(full, empty, slots, 32);
  if (threadIdx.x < 32) {
    const auto issue = [&](int64_t row, int s, uint64_t* bar) {
      const int64_t left = nbytes - row * row_bytes;
      const uint32_t bytes = static_cast<uint32_t>(left < row_bytes ? left : row_bytes);
      detail::mbar_arrive_expect_tx(bar, bytes);
      detail::bulk_load(ring_slots + static_cast<int64_t>(s) * V, src + row * row_bytes, bytes, bar);
    };
    if constexpr (GRAB) {
      if (threadIdx.x == 0)
        norm::stream_produce_grabbed(rows, grab, slots, groups, full, empty, full_barriers, slot_row, counter, issue);
    } else if (static_cast<int>(threadIdx.x) < producer_lanes) {
      norm::stream_produce_rows(begin, end, stride, slots, full, empty, full_barriers, issue, producer_lanes);
    }
    return;
  }
  const int c = static_cast<int>(threadIdx.x) / 32 - 1, lane = static_cast<int>(threadIdx.x) % 32;
  int s = c % slots;
  uint32_t use = static_cast<uint32_t>(c / slots);
  for (int64_t row = GRAB ? 0 : begin + c * stride; GRAB || row < end; row += groups * stride) {
    norm::stream_wait_full(full, s, use, full_barriers);
    if constexpr (GRAB) {
      row = slot_row[s];
      if (row < 0) break;  // the producer's end mark: no more rows for this consumer
    }
    const int64_t left = nbytes - row * row_bytes;
    const int bytes = static_cast<int>(left < row_bytes ? left : row_bytes);
    const uint4* sx = ring_slots + static_cast<int64_t>(s) * V;
    if constexpr (BULK_STORE) {  // the slot is only read, by the copy engine: done once its reads are
      if (lane == 0) {
        detail::bulk_store(dst + row * row_bytes, sx, static_cast<uint32_t>(bytes));
        detail::bulk_commit();
        detail::bulk_wait_reads();
      }
      __syncwarp();
    } else {
      uint4* const d = reinterpret_cast<uint4*>(dst + row * row_bytes);
      const int n = bytes / 16;
      uint4 v[kRingMaxVectors];
#pragma unroll
      for (int u = 0; u < kRingMaxVectors; ++u)
        if (lane + 32 * u < n) v[u] = sx[lane + 32 * u];
#pragma unroll
      for (int u = 0; u < kRingMaxVectors; ++u)
        if (lane + 32 * u < n) d[lane + 32 * u] = v[u];
    }
    norm::stream_release(empty, s, use, groups, slots, false);  // the slot was only read
  }
}

// Warp w of block b copies rows [(b W + w) R, (b W + w + 1) R) through its `slots` slots (see kWarpRings). Each slot's
// uses are all this warp's, in order, so one mbarrier per slot and the use's parity are unambiguous.
constexpr int kWarpRingMaxVectors = 3072 / 16 / 32;  // 16-byte vectors per lane of a warp ring's rows (<= 3072 B)
__global__ void __launch_bounds__(32 * kWarpRingWarps)
    stream_copy_warp_ring_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t nbytes,
                                 int row_bytes, int slots, int rows_per_warp) {
  extern __shared__ __align__(128) uint4 warp_slots[];  // on a 128-byte line (it followed `full` 64 B past one)
  __shared__ uint64_t full[kWarpRingWarps * kWarpRingMaxSlots];
  const int w = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int V = row_bytes / 16;
  const int64_t rows = (nbytes + row_bytes - 1) / row_bytes;
  const int64_t begin = (int64_t(blockIdx.x) * kWarpRingWarps + w) * rows_per_warp;
  const int64_t end = begin + rows_per_warp < rows ? begin + rows_per_warp : rows;
  uint4* const mine = warp_slots + static_cast<int64_t>(w) * slots * V;
  uint64_t* const bars = full + w * kWarpRingMaxSlots;
  if (lane == 0) {
    for (int k = 0; k < slots; ++k) detail::mbar_init(&bars[k], 1);
    detail::fence_mbarrier_init();
  }
  __syncwarp();
  const auto issue = [&](int64_t row, int k) {
    const int64_t left = nbytes - row * row_bytes;
    const uint32_t bytes = static_cast<uint32_t>(left < row_bytes ? left : row_bytes);
    detail::mbar_arrive_expect_tx(&bars[k], bytes);
    detail::bulk_load(mine + static_cast<int64_t>(k) * V, src + row * row_bytes, bytes, &bars[k]);
  };
  if (lane == 0)
    for (int k = 0; k < slots && begin + k < end; ++k) issue(begin + k, k);
  int k = 0;
  uint32_t use = 0;
  for (int64_t row = begin; row < end; ++row) {
    detail::mbar_wait(&bars[k], use & 1u);
    const int64_t left = nbytes - row * row_bytes;
    const int n = static_cast<int>(left < row_bytes ? left : row_bytes) / 16;
    const uint4* sx = mine + static_cast<int64_t>(k) * V;
    uint4* const d = reinterpret_cast<uint4*>(dst + row * row_bytes);
    uint4 v[kWarpRingMaxVectors];
#pragma unroll
    for (int u = 0; u < kWarpRingMaxVectors; ++u)
      if (lane + 32 * u < n) v[u] = sx[lane + 32 * u];
    detail::fence_proxy_async_smem();  // this warp's reads of the slot before the copy engine refills it
    __syncwarp();
    if (lane == 0 && row + slots < end) issue(row + slots, k);
#pragma unroll
    for (int u = 0; u < kWarpRingMaxVectors; ++u)
      if (lane + 32 * u < n) d[lane + 32 * u] = v[u];
    if (++k == slots) k = 0, ++use;
  }
}

using RingKernel = void (*)(const uint8_t*, uint8_t*, int64_t, int, int, norm::StreamGrab, norm::StreamGrabCounter*,
                            int, int, int64_t);

RingKernel pick_ring(const RingVariant& r) {
  if (r.bulk_store) return stream_copy_ring_kernel<true, false, 24, 1>;
  if (r.grab.most > 0) return stream_copy_ring_kernel<false, true, 24, 1>;
  if (r.min_blocks == 3) return stream_copy_ring_kernel<false, false, 8, 3>;
  if (r.min_blocks == 2) return stream_copy_ring_kernel<false, false, 12, 2>;
  return stream_copy_ring_kernel<false, false, 24, 1>;
}

using BulkKernel = void (*)(const uint8_t*, uint8_t*, int64_t);

BulkKernel pick_bulk(int chunk) {
  switch (chunk) {
    case 4096: return stream_copy_bulk_kernel<4096>;
    case 8192: return stream_copy_bulk_kernel<8192>;
    case 16384: return stream_copy_bulk_kernel<16384>;
    default: return stream_copy_bulk_kernel<32768>;
  }
}

using Kernel = void (*)(const uint4*, uint4*, int64_t);

template <int U>
Kernel pick_policy(bool evict_first) {
  return evict_first ? stream_copy_kernel<U, true> : stream_copy_kernel<U, false>;
}

Kernel pick(const StreamCopyVariant& v) {
  switch (v.vectors_per_thread) {
    case 1: return pick_policy<1>(v.evict_first);
    case 2: return pick_policy<2>(v.evict_first);
    case 4: return pick_policy<4>(v.evict_first);
    default: return pick_policy<8>(v.evict_first);
  }
}

}  // namespace

int stream_copy_variant_count() { return kVariants; }

StreamCopyVariant stream_copy_variant(int index) {
  if (index < 0 || index >= kVariants)
    throw detail::Failure(DIFUSE_ERR_INVALID_ARGUMENT, "stream_copy: variant " + std::to_string(index) +
                                                           " outside [0, " + std::to_string(kVariants) + ")");
  if (index >= kVectorVariants + 4 + kRingVariants) {
    const WarpRingVariant& r = kWarpRings[index - kVectorVariants - 4 - kRingVariants];
    StreamCopyVariant v{0, 32 * kWarpRingWarps, false, false, 0};
    v.warp_ring_row_bytes = r.row_bytes;
    v.warp_ring_slots = r.slots;
    v.warp_ring_rows = r.rows_per_warp;
    return v;
  }
  if (index >= kVectorVariants + 4) {
    const RingVariant& r = kRings[index - kVectorVariants - 4];
    StreamCopyVariant v{0, 32 + 32 * r.warps, r.rows_per_block == 0, false, 0, r.row_bytes, r.bulk_store};
    v.ring_grab = r.grab.most;
    v.ring_guided = r.grab.least != r.grab.most;
    v.ring_grab_all = r.grab.most > 0 && r.grab.first == 0;
    v.ring_producer_lanes = r.lanes;
    v.ring_rows_per_block = r.rows_per_block;
    return v;
  }
  if (index >= kVectorVariants) return {0, 32, false, false, kBulkChunks[index - kVectorVariants]};
  return {kUnrolls[index % 4], kThreads[(index / 4) % 4], (index / 16) % 2 == 1, index / 32 == 1, 0};
}

std::string stream_copy_variant_name(int index) {
  const StreamCopyVariant v = stream_copy_variant(index);
  if (v.ring_row_bytes > 0)
    return "ring" + std::to_string(v.ring_row_bytes) + "_w" + std::to_string((v.threads_per_block - 32) / 32) +
           (v.ring_bulk_store ? "_bulk" : "_stg") +
           (v.ring_grab == 0 ? "" : v.ring_guided ? "_guided" : "_grab" + std::to_string(v.ring_grab)) +
           (v.ring_grab_all ? "_all" : "") +
           (v.ring_producer_lanes > 1 ? "_p" + std::to_string(v.ring_producer_lanes) : "") +
           (v.ring_rows_per_block > 0 ? "_r" + std::to_string(v.ring_rows_per_block) : "");
  if (v.warp_ring_row_bytes > 0)
    return "wring" + std::to_string(v.warp_ring_row_bytes) + "_s" + std::to_string(v.warp_ring_slots) + "_r" +
           std::to_string(v.warp_ring_rows);
  if (v.bulk_bytes > 0) return "bulk" + std::to_string(v.bulk_bytes) + "_t32_onepass";
  return "u" + std::to_string(v.vectors_per_thread) + "_t" + std::to_string(v.threads_per_block) +
         (v.resident_grid ? "_resident" : "_onepass") + (v.evict_first ? "_evict_first" : "_default");
}

void stream_copy(void* dst, const void* src, int64_t nbytes, int index, cudaStream_t stream) {
  detail::Support s;
  const auto d = reinterpret_cast<uintptr_t>(dst), a = reinterpret_cast<uintptr_t>(src);
  if (dst == nullptr) s.violations.push_back("dst is NULL");
  if (src == nullptr) s.violations.push_back("src is NULL");
  if (d % 16 != 0) s.violations.push_back("dst is not 16-byte aligned");
  if (a % 16 != 0) s.violations.push_back("src is not 16-byte aligned");
  if (nbytes <= 0 || nbytes % 16 != 0)
    s.violations.push_back("nbytes = " + std::to_string(nbytes) + " is not a positive multiple of 16");
  if (nbytes > 0 && d < a + uint64_t(nbytes) && a < d + uint64_t(nbytes))
    s.violations.push_back("dst and src overlap");
  if (index < 0 || index >= kVariants)
    s.violations.push_back("variant " + std::to_string(index) + " outside [0, " + std::to_string(kVariants) + ")");
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_INVALID_ARGUMENT, s.message("stream_copy"));

  const StreamCopyVariant v = stream_copy_variant(index);
  if (v.warp_ring_row_bytes > 0) {
    static std::atomic<uint64_t> opted_in, carveout_set;
    int device = 0;
    DIFUSE_CUDA_CHECK(cudaGetDevice(&device));
    const int smem = kWarpRingWarps * v.warp_ring_slots * v.warp_ring_row_bytes;
    norm::opt_in_shared_memory(stream_copy_warp_ring_kernel, device, kWarpRingWarps * kWarpRingMaxSlots * 6144,
                               opted_in);
    norm::prefer_max_shared_carveout(stream_copy_warp_ring_kernel, device, carveout_set);
    const int64_t rows = (nbytes + v.warp_ring_row_bytes - 1) / v.warp_ring_row_bytes;
    const int64_t per_block = int64_t{kWarpRingWarps} * v.warp_ring_rows;
    stream_copy_warp_ring_kernel<<<static_cast<unsigned>((rows + per_block - 1) / per_block), 32 * kWarpRingWarps,
                                   static_cast<size_t>(smem), stream>>>(static_cast<const uint8_t*>(src),
                                                                        static_cast<uint8_t*>(dst), nbytes,
                                                                        v.warp_ring_row_bytes, v.warp_ring_slots,
                                                                        v.warp_ring_rows);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (v.ring_row_bytes > 0) {
    const int ri = index - kVectorVariants - 4;
    const RingVariant& r = kRings[ri];
    const RingKernel kernel = pick_ring(r);
    static std::atomic<int> budgets[kRingVariants][detail::kMaxDevices];  // 0: not read yet
    static std::atomic<uint64_t> opted_in[kRingVariants], carveout_set[kRingVariants];
    int device = 0;
    DIFUSE_CUDA_CHECK(cudaGetDevice(&device));
    int budget = norm::stream_smem_budget(kernel, device, budgets[ri]);
    if (r.min_blocks > 1) {  // a share of the SM's shared memory (each block also keeps 1 KB reserved, and its static)
      int per_sm = 0;
      DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
      cudaFuncAttributes attr{};
      DIFUSE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
      budget = std::min(budget, per_sm / r.min_blocks - 1024 - static_cast<int>(attr.sharedSizeBytes));
    }
    const int slots = std::min(kRingMaxSlots, budget / r.row_bytes);
    const int64_t rows = (nbytes + r.row_bytes - 1) / r.row_bytes;
    const int warps = std::min(r.warps, slots);
    norm::opt_in_shared_memory(kernel, device, budget, opted_in[ri]);
    norm::prefer_max_shared_carveout(kernel, device, carveout_set[ri]);
    const int64_t blocks = r.rows_per_block > 0 ? (rows + r.rows_per_block - 1) / r.rows_per_block
                                                : std::min<int64_t>(detail::sm_count(device), rows);
    norm::StreamGrabCounter* counter = nullptr;  // the grabbed variants': the streamed norms' counters (grab_counter.h)
    if (r.grab.most > 0 && (counter = detail::grab_counter(device, stream)) == nullptr)
      throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, "stream_copy: variant " + stream_copy_variant_name(index) +
                                                        " needs a row counter and none is free (see the log)");
    kernel<<<static_cast<unsigned>(blocks), 32 + 32 * warps, static_cast<size_t>(slots) * r.row_bytes, stream>>>(
        static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), nbytes, r.row_bytes, slots, r.grab, counter,
        norm::stream_producer_lanes(r.lanes, slots, warps), norm::stream_full_barriers_for(slots, warps),
        r.rows_per_block);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (v.bulk_bytes > 0) {
    const int64_t grid = (nbytes + v.bulk_bytes - 1) / v.bulk_bytes;
    if (grid > 0x7fffffff)
      throw detail::Failure(DIFUSE_ERR_INVALID_ARGUMENT, "stream_copy: nbytes = " + std::to_string(nbytes) +
                                                             " needs more than 2^31 - 1 chunks of " +
                                                             std::to_string(v.bulk_bytes) + " bytes");
    pick_bulk(v.bulk_bytes)<<<static_cast<unsigned>(grid), 32, 0, stream>>>(static_cast<const uint8_t*>(src),
                                                                          static_cast<uint8_t*>(dst), nbytes);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const Kernel kernel = pick(v);
  const int64_t n = nbytes / 16, chunk = int64_t(v.vectors_per_thread) * v.threads_per_block;
  int64_t grid = (n + chunk - 1) / chunk;
  if (v.resident_grid) {  // the SM count and each variant's blocks per SM asked once per device
    static std::atomic<int> blocks_per_sm[kVariants][detail::kMaxDevices];  // 0: not asked yet
    int device = 0;
    DIFUSE_CUDA_CHECK(cudaGetDevice(&device));
    std::atomic<int>& cached = blocks_per_sm[index][device & 63];
    int per_sm = cached.load(std::memory_order_acquire);
    if (per_sm == 0) {
      DIFUSE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, v.threads_per_block, 0));
      per_sm = std::max(per_sm, 1);
      cached.store(per_sm, std::memory_order_release);
    }
    grid = std::min<int64_t>(grid, int64_t(detail::sm_count(device)) * per_sm);
  }
  grid = std::min<int64_t>(grid, 0x7fffffff);
  kernel<<<static_cast<unsigned>(grid), v.threads_per_block, 0, stream>>>(static_cast<const uint4*>(src),
                                                                          static_cast<uint4*>(dst), n);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::probe
