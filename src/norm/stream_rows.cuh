// The streamed row schedule's shared pieces (norm/layernorm_modulate.cu's grln_streamed_rows and
// layernorm_streamed_rows, norm/rms_norm_modulate.cu's rms_norm_modulate_streamed, norm/rms_norm.cu's
// rms_norm_streamed, the probe's ring variants): one block per SM, warp 0's lane 0 (or its first lanes, in step)
// the producer that bulk-copies the block's rows (blockIdx.x + k x gridDim.x) into slot k % slots of a ring in shared
// memory (the copy engine completes one of the slot's two `full` mbarriers, by the use's parity; its one barrier
// under DIFUSE_STREAM_FULL_BARRIERS=1 where the slots are a multiple of the groups), consumer groups
// that take rows k = c, c + groups, ... and release their slot on its `empty` mbarrier after a proxy fence. Copy and
// synchronisation code only: the kernels keep their own arithmetic. The ring's indices and parities are
// norm/stream_ring.h's, run on a CPU model of the protocol in tests/cpu/test_stream_ring.cpp. Since the twenty-first
// session (846df26) two `full` barriers per slot: the streamed kernels ran exact with them in the whole GPU suite at
// 97817d7 (tests.json: 3,384 passed, 0 failed, 0 skipped), and racecheck of the smoke test is clean at 45a2975 with
// one producer lane and with four (racecheck-default-45a2975.log, racecheck-knobs-45a2975.log). Twenty-fourth
// session: the barrier count is a kernel parameter (`fulls`, stream_full_barriers_for), 2 unless the knob above.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "core/bulk_copy.cuh"
#include "core/device.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "core/grab_counter.h"
#include "norm/stream_ring.h"

namespace difuse::norm {

// Slot s's fills alternate between two `full` mbarriers, full[2s] for its even uses and full[2s + 1] for its odd ones
// (twenty-first session). Why: a slot's consumer is the group of its fill (fill k: group k % groups), and where slots
// is not a multiple of groups that is another group each time round the ring, which may reach its wait for the slot's
// use u while use u - 1's bytes are still landing (copies complete out of order). With one barrier per slot, use u - 1
// in flight and use u - 2 complete look alike to a parity wait (use u's parity is u - 2's): the consumer read the
// slot early and released it twice, and the ring deadlocked (H200 at 47d0889: the probe's ring6144_w24_stg, 37 slots
// for 24 warps, hung at 201 MB; at bfef2d5 a 37-slot form had hung too). On its own barrier each use u is phase u / 2,
// whose predecessor (use u - 2) has completed before use u - 1 could be issued: the parity is unambiguous. The
// producer's waits on `empty` never were ambiguous (it waits for use u - 1's release only after use u - 2's).
// The indices and parities are norm/stream_ring.h's (CPU-tested on a model of the protocol).
// `fulls` (stream_full_barriers on the host): 2, or under DIFUSE_STREAM_FULL_BARRIERS=1 one barrier per slot where the
// slots are a multiple of the groups (each group owns its slots there, and one barrier's parity is unambiguous).
__device__ __forceinline__ uint64_t* stream_full_bar(uint64_t* full, int s, uint32_t use, int fulls) {
  return &full[stream_full_index(s, use, fulls)];
}
// A consumer's wait for use `use` of slot s (all its bytes landed).
__device__ __forceinline__ void stream_wait_full(uint64_t* full, int s, uint32_t use, int fulls) {
  detail::mbar_wait(stream_full_bar(full, s, use, fulls), stream_full_parity(use, fulls));
}

// One thread initialises the ring's mbarriers (full, two per slot: the producer's arrival and the copies' bytes;
// empty: the `consumer_threads` arrivals of a consumer group) and makes them visible to the copy engine; then the
// block barrier. `full` holds 2 x slots barriers.
__device__ __forceinline__ void stream_init_barriers(uint64_t* full, uint64_t* empty, int slots, int consumer_threads) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      detail::mbar_init(&full[2 * s], 1);
      detail::mbar_init(&full[2 * s + 1], 1);
      detail::mbar_init(&empty[s], static_cast<uint32_t>(consumer_threads));
    }
    detail::fence_mbarrier_init();
  }
  __syncthreads();
}

// The producer: fills slot k % slots with the block's k-th row (begin + k x stride, below end) once the consumer of
// row k - slots has released it;
// issue(row, slot, bar) arrives on `bar` with the row's byte count and starts its copies there. Called by lane 0 of
// the producer warp (lanes = 1, the defaults) or by its lanes 0 .. lanes - 1 together (twenty-first session; lanes
// from stream_producer_lanes): lane j makes fills j, j + lanes, ... (slot k % slots, use k / slots, as one lane
// would), one step of `lanes` fills at a time, and the lanes wait for each other after each step (__syncwarp): in
// the CPU model of the protocol free-running lanes race. Within a step every lane waits on the `empty` barriers of
// all the step's fills, not only its own, before it issues its copy (twenty-second session): ptxas issues the lanes'
// bulk copies as one uniform UBLKCP per lane in an ELECT loop that the whole warp runs (SASS: ELECT, R2UR, UBLKCP,
// BRA.U.ANY), and compute-sanitizer's racecheck counts each of them to lane 0, whose own wait was on another slot:
// with lanes = 4 it reported lane 0's copies as racing the consumers' reads and writes of the slot (H200 at 97817d7:
// WAW in grln_streamed_rows, WAR in the probe's ring; sanitizer-knobs-97817d7-cut.log.gz, sanitizer-97817d7-cut.log.gz). A __syncwarp between the waits and
// the copies alone did not help (9a34777: racecheck-knobs-9a34777-cut.log.gz; racecheck does not order lanes
// through it). Racecheck of the smoke test at 45a2975, 4 lanes on every streamed kernel: 0 hazards. With every lane's own acquire
// of every slot of the step, a copy is ordered after its slot's release whichever lane it is counted to; the waits
// of the slots already released cost a few instructions per fill. The __syncwarp between the waits and the copies
// stays: without it a lane still waiting on a slot whose copy another lane already issued could find that slot's
// `empty` barrier a phase further on and wait forever (the CPU model deadlocks so). Why: at 3 KB rows one lane's loop (~50 SASS instructions of
// dependent scalar work and mbarrier operations per row) is near the ~0.2 us per row a block must sustain at
// 1x32760x1536 (the probe's ring at 201 MB: 58.4 us with one lane, 56.6 with 4, 56.3 with 8; stream-variants-846df26.json).
template <class Issue>
__device__ __forceinline__ void stream_produce_rows(int64_t begin, int64_t end, int64_t stride, int slots,
                                                    uint64_t* full, uint64_t* empty, int fulls, Issue issue,
                                                    int lanes = 1) {
  if (lanes == 1) {
    int s = 0;
    uint32_t use = 0;  // how many times slot s has been filled before
    for (int64_t row = begin; row < end; row += stride) {
      if (use > 0) detail::mbar_wait(&empty[s], stream_empty_parity(use));
      issue(row, s, stream_full_bar(full, s, use, fulls));
      stream_advance(s, use, 1, slots);
    }
    return;
  }
  const int j = static_cast<int>(threadIdx.x) & 31;
  const unsigned mask = lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
  int s0 = 0;         // the step's first fill: slot s0,
  uint32_t use0 = 0;  // use use0
  for (int64_t first = begin; first < end; first += lanes * stride) {  // the same steps for every lane
    int s = s0, mine_s = s0;
    uint32_t use = use0, mine_use = use0;
    for (int i = 0; i < lanes; ++i) {  // every lane waits for every fill of the step (see above)
      if (first + i * stride < end && use > 0) detail::mbar_wait(&empty[s], stream_empty_parity(use));
      if (i == j) mine_s = s, mine_use = use;
      stream_advance(s, use, 1, slots);
    }
    __syncwarp(mask);  // every lane's waits before any lane's copy (see above)
    const int64_t row = first + j * stride;
    if (row < end) issue(row, mine_s, stream_full_bar(full, mine_s, mine_use, fulls));
    s0 = s, use0 = use;
    __syncwarp(mask);
  }
}

// The streamed kernels' rows: blockIdx.x, blockIdx.x + gridDim.x, ... below `rows` (stream_produce_rows).
template <class Issue>
__device__ __forceinline__ void stream_produce(int64_t rows, int slots, uint64_t* full, uint64_t* empty, int fulls,
                                               Issue issue, int lanes = 1) {
  stream_produce_rows(blockIdx.x, rows, gridDim.x, slots, full, empty, fulls, issue, lanes);
}

// A grid-wide row counter for stream_produce_grabbed (core/grab_counter.h: who may use which).
using StreamGrabCounter = detail::GrabCounter;

// How stream_produce_grabbed shares the rows out: block b's first grab is rows [b * first, (b + 1) * first) without
// the counter (so no block waits on an atomic before its first copy); after that each grab takes
// clamp((rows - position) / (divisor * gridDim.x), least, most) rows from the counter (guided: large grabs while
// many rows remain, small ones near the end; least == most: a fixed size).
struct StreamGrab {
  int first, least, most, divisor;
};

// The producer of a grid that shares its rows out dynamically (twenty-first session): it fills the ring's slots in
// the order stream_produce does, writing each slot's row into slot_row[s] before the arrival that publishes the slot
// (the arrival releases, the consumer's wait acquires), and asks the counter for its next grab as soon as it knows
// the current one (the atomic's latency hides behind the current grab's rows). When its grabs run past `rows` it
// fills each of the `groups` consumers' next slot with the end mark -1 (an arrival without bytes), so consumer c,
// which takes fills c, c + groups, ..., reads exactly one end mark. Needs groups <= slots. Which block handles a row
// changes from launch to launch; a row's arithmetic does not depend on it.
template <class Issue>
__device__ __forceinline__ void stream_produce_grabbed(int64_t rows, StreamGrab grab, int slots, int groups,
                                                       uint64_t* full, uint64_t* empty, int fulls, int64_t* slot_row,
                                                       StreamGrabCounter* counter, Issue issue) {
  const int64_t base = static_cast<int64_t>(gridDim.x) * grab.first;  // rows the first grabs cover
  // no integer division on the producer's path (at 918066b one per grab cost more than the balance gained)
  const float share = 1.0f / static_cast<float>(grab.divisor * static_cast<int>(gridDim.x));
  const auto grab_size = [&](int64_t position) -> int64_t {
    if (grab.least == grab.most) return grab.most;
    const int k = static_cast<int>(static_cast<float>(rows - position) * share);
    return k < grab.least ? grab.least : k > grab.most ? grab.most : k;
  };
  int s = 0;
  uint32_t use = 0;  // how many times slot s has been filled before
  int64_t first = static_cast<int64_t>(blockIdx.x) * grab.first;
  int64_t end = first + grab.first < rows ? first + grab.first : rows;
  int64_t size = grab_size(base > end ? base : end);
  unsigned long long taken = atomicAdd(&counter->next, static_cast<unsigned long long>(size));
  for (;;) {
    for (int64_t row = first; row < end; ++row) {
      if (use > 0) detail::mbar_wait(&empty[s], stream_empty_parity(use));
      slot_row[s] = row;
      issue(row, s, stream_full_bar(full, s, use, fulls));
      if (++s == slots) s = 0, ++use;
    }
    first = base + static_cast<int64_t>(taken);
    if (first >= rows) break;
    end = first + size < rows ? first + size : rows;
    size = grab_size(end);
    taken = atomicAdd(&counter->next, static_cast<unsigned long long>(size));
  }
  for (int k = 0; k < groups; ++k) {
    if (use > 0) detail::mbar_wait(&empty[s], stream_empty_parity(use));
    slot_row[s] = -1;
    detail::mbar_arrive(stream_full_bar(full, s, use, fulls));
    if (++s == slots) s = 0, ++use;
  }
  if (atomicAdd(&counter->done, 1u) == gridDim.x - 1) {  // every producer has taken its last grab
    atomicExch(&counter->next, 0ull);
    atomicExch(&counter->done, 0u);
  }
}

// A consumer is done with slot s (every read and write of it by this thread): order them before the copy engine
// refills it, arrive on its `empty` barrier, and step to the group's next row's slot.
// proxy_fence: a fence.proxy.async before the arrival (SASS: MEMBAR.ALL.CTA, FENCE.VIEW.ASYNC.S). A consumer that
// wrote the slot (GRLN's h1, rms_norm_modulate's residual form) needs it: its generic-proxy stores must be ordered
// before the copy engine's (async-proxy) writes of the next row. A consumer that only read the slot may arrive
// without it, as CUTLASS's PipelineTmaAsync::consumer_release does: the arrival (release) and the producer's wait
// (acquire) before its copy order the reads (stream_read_fence_knob).
__device__ __forceinline__ void stream_release(uint64_t* empty, int& s, uint32_t& use, int groups, int slots,
                                               bool proxy_fence = true) {
  if (proxy_fence) detail::fence_proxy_async_smem();
  detail::mbar_arrive(&empty[s]);
  stream_advance(s, use, groups, slots);
}

// DIFUSE_STREAM_READ_FENCE=0|1 (read once; for measurement; twentieth session): whether the consumers that only read
// their slot (rms_norm_streamed, layernorm_streamed_rows, rms_norm_modulate_streamed's plain form) fence the async
// proxy before releasing it (stream_release's proxy_fence). 1 or unset: they do (every streamed kernel verified
// so far); 0: they do not. Why: ncu at 1ab086e (ncu/1ab086e/) shows the streamed rms_norm at 1x32760x1536 issuing
// 0.37 instructions per scheduler per cycle with 72% of its stalls on L1TEX scoreboards, 24 consumer warps no faster
// than 16, and the fence's MEMBAR.ALL.CTA once per row per warp after the row's stores. Measured at 06c367e
// (knob-sweeps/06c367e/, ncu/06c367e/): exact, and no faster anywhere (rms_norm 62.3 vs 62.2 us, Wan fp32 70.4 vs
// 71.2, layernorm_modulate 65.0 vs 65.0 at 1x32760x1536); ncu shows no membar stall either way (long_scoreboard
// 11.6 cycles per instruction with and without). Kept at 1.
inline bool stream_read_fence_knob() {
  static const int v = detail::env_knob_or("DIFUSE_STREAM_READ_FENCE", 1);
  return v != 0;
}

// DIFUSE_STREAM_GRAB (read once; for measurement; twenty-first session): how the streamed kernels that read it
// (rms_norm_streamed) share their rows out. Unset or 0: row r in block r % gridDim.x (stream_produce); "F": grabs of
// F rows from a grid-wide counter (stream_produce_grabbed, StreamGrab{F, F, F, 1}); "F,L,M,D" (or "F/L/M/D"): a
// first grab of F, then clamp(rows left / (D x blocks), L, M). Why: at 201 MB the probe's strided ring takes 57.9 us against 50.4 for
// a one-pass copy, 53.5 with grabs of 4 rows (stream-variants-dc1ac5a.json).
inline StreamGrab stream_grab_knob() {
  static const StreamGrab g = [] {
    StreamGrab r{0, 0, 0, 1};
    const char* e = detail::env_knob_text("DIFUSE_STREAM_GRAB");
    if (*e == 0) return r;
    int f = 0, l = 0, m = 0, d = 0;
    const int n = std::sscanf(e, "%d%*[,/]%d%*[,/]%d%*[,/]%d", &f, &l, &m, &d);  // "/" for the sweep stage's entries
    if (n == 1 && f > 0) r = {f, f, f, 1};
    if (n == 4 && f > 0 && l > 0 && m >= l && d > 0) r = {f, l, m, d};
    return r;
  }();
  return g;
}

// DIFUSE_STREAM_PRODUCER_LANES=K (read once; for measurement; twenty-first session): the lanes of the producer warp
// that issue the ring's copies (stream_produce's `lanes`; 1 to 8, then at most stream_producer_lanes allows for the
// ring) in every streamed kernel (rms_norm_streamed, layernorm_streamed_rows, grln_streamed_rows,
// rms_norm_modulate_streamed). Unset: 0, and each launcher takes its own default (`unset`): 8 for rms_norm_streamed
// (twenty-third session), 1 (lane 0 alone) for the others.
inline int stream_producer_lanes_knob(int unset = 1) {
  static const int v = [] {
    const int k = detail::positive_env_knob("DIFUSE_STREAM_PRODUCER_LANES");
    return k < 1 ? 0 : k > 8 ? 8 : k;
  }();
  return v > 0 ? v : unset;
}

// The `full` mbarriers per slot of a ring of `slots` slots and `groups` consumer groups (stream_full_barriers), for
// every streamed kernel and the probe's rings. DIFUSE_STREAM_FULL_BARRIERS=1 (read once; twenty-fourth session; its
// GPU knob cases pass at 5d3eadf, the sanitizer has not run it; no faster at aa41dda, rev-bench/aa41dda/fulls1/): one where the slots are a multiple of the groups, and the plain LayerNorms'
// ring up to 48 slots (owned_stream_rings); unset or any other value: two everywhere, the protocol of
// 02a2be4..9e826cd that the whole GPU suite and the sanitizer ran.
inline int stream_full_barriers_knob() {
  static const int knob = detail::env_knob_or("DIFUSE_STREAM_FULL_BARRIERS", 0);
  return knob;
}
inline bool owned_stream_rings() { return stream_full_barriers_knob() == 1; }
inline int stream_full_barriers_for(int slots, int groups) {
  return stream_full_barriers(slots, groups, stream_full_barriers_knob());
}

// The dynamic shared memory a streamed block of `kernel` may take on `device`: the opt-in maximum per block less the
// kernel's static shared memory, read once per device into `budgets` (one array per kernel).
template <class Kernel>
int stream_smem_budget(Kernel kernel, int device, std::atomic<int> (&budgets)[detail::kMaxDevices]) {
  int budget = budgets[detail::device_slot(device)].load(std::memory_order_acquire);
  if (budget == 0) {
    int optin = 0;
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attr{};
    DIFUSE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    budget = optin - static_cast<int>(attr.sharedSizeBytes);
    budgets[detail::device_slot(device)].store(budget, std::memory_order_release);
  }
  return budget;
}

// The shape of a launch whose consumers are single warps (rms_norm_streamed, rms_norm_modulate_streamed): `slots`
// ring slots of slot_bytes beside fixed_bytes of staged rows within `budget` (at most max_slots), `warps` consumer
// warps (knob <= 1: default_warps; at most max_warps and the slots), one block per SM and no more than `rows`,
// capped at max_blocks where that is > 0 (the tests' knob). ok(): the ring holds at least two rows.
struct StreamWarpLaunch {
  int slots = 0, warps = 0;
  int64_t blocks = 0;
  bool ok() const { return slots >= 2 && warps >= 1; }
  int threads() const { return 32 + 32 * warps; }  // the producer warp, then the consumers
};
inline StreamWarpLaunch stream_warp_launch(int budget, int64_t fixed_bytes, int64_t slot_bytes, int max_slots, int knob,
                                           int default_warps, int max_warps, int64_t rows, int device,
                                           int max_blocks) {
  StreamWarpLaunch l;
  l.slots = static_cast<int>(std::min<int64_t>(max_slots, (budget - fixed_bytes) / slot_bytes));
  l.warps = std::min(std::min(knob <= 1 ? default_warps : knob, max_warps), l.slots);
  l.blocks = std::min<int64_t>(detail::sm_count(device), rows);
  if (max_blocks > 0) l.blocks = std::min<int64_t>(l.blocks, max_blocks);
  return l;
}

}  // namespace difuse::norm
