// Device and launch helpers shared by the row kernels that stage rows in shared memory
// (layernorm_modulate, rms_norm, the staged attention prologues): cp.async copies, the row-group barrier, the
// shared-memory opt-in and carveout.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/device.h"
#include "core/error.h"

namespace difuse::norm {

// One asynchronous global -> shared copy of 16 bytes (L1 bypassed) or 8 bytes.
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool bytes16) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (bytes16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Asks L2 for `bytes` (a multiple of 16) from a 16-byte aligned global address: one instruction, no registers, no
// wait (sm_90's bulk prefetch); a later load of that range then finds it in L2 instead of DRAM.
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}

// Issues the copies of a block's `nrows` rows (row rr starting at row(rr), 16-byte aligned, CHUNKS 16-byte pieces)
// into smem, row rr at piece CHUNKS * rr; the block's THREADS threads share them, thread t always piece t % CHUNKS
// (no division per copy). The caller waits (cp_async_wait_all) and synchronises. The staged per-head norms'
// prologue (rms_norm, rms_norm_diffusers).
template <int CHUNKS, int THREADS, class RowPtr>
__device__ __forceinline__ void stage_block_rows(uint4* smem, int nrows, RowPtr row) {
  static_assert(THREADS % CHUNKS == 0, "each thread keeps one piece position");
  const int part = static_cast<int>(threadIdx.x) % CHUNKS;
#pragma unroll 1
  for (int rr = static_cast<int>(threadIdx.x) / CHUNKS; rr < nrows; rr += THREADS / CHUNKS)
    cp_async(smem + CHUNKS * rr + part, row(rr) + 8 * part, true);
}

// Closes this thread's group of cp.async copies issued since the last commit (an empty group where none were).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight (the newest ones).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Barrier among the threads of one row: a warp for G = 32, the block otherwise.
template <int G>
__device__ __forceinline__ void row_sync() {
  if constexpr (G == 32)
    __syncwarp();
  else
    __syncthreads();
}

// Sets one attribute of a kernel once per device (bit per device ordinal in `done`).
template <class Kernel>
void set_attribute_once(Kernel kernel, int device, cudaFuncAttribute attr, int value, std::atomic<uint64_t>& done) {
  const uint64_t bit = uint64_t{1} << detail::device_slot(device);
  if (done.load(std::memory_order_acquire) & bit) return;
  DIFUSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, attr, value));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

// Raises a kernel's dynamic shared-memory limit to `bytes`, once per device.
template <class Kernel>
void opt_in_shared_memory(Kernel kernel, int device, int bytes, std::atomic<uint64_t>& done) {
  set_attribute_once(kernel, device, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes, done);
}

// Prefers the largest shared-memory carveout for a kernel (L1 gets the rest), once per device: for kernels whose
// occupancy is set by their staged rows.
template <class Kernel>
void prefer_max_shared_carveout(Kernel kernel, int device, std::atomic<uint64_t>& done) {
  set_attribute_once(kernel, device, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared,
                     done);
}

// Launches Kernel(p) with the largest shared-memory carveout preferred, set once per device for that kernel (one
// static per instantiation): the staged kernels, whose occupancy their shared memory sets.
template <auto Kernel, class P>
void launch_max_shared(const P& p, dim3 grid, dim3 block, size_t smem, int device, cudaStream_t stream) {
  static std::atomic<uint64_t> carveout_set{0};
  prefer_max_shared_carveout(Kernel, device, carveout_set);
  Kernel<<<grid, block, smem, stream>>>(p);
}

// Blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident on device `device` at once:
// its SMs times the blocks per SM the occupancy calculator allows, at least one per SM. For grids that loop over
// their work (one wave, no block waiting for a slot). The SM count is read once per device and each (kernel,
// device, threads, smem) answer once, so a repeated launch makes no runtime call. The answers are keyed by the
// kernel itself: kernels of one signature (one instantiation of this template) differ in registers and so in
// blocks per SM.
template <class Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t smem, int device) {
  struct Entry {
    const void* kernel;
    int device, threads;
    size_t smem;
    int per_sm;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;  // a few entries: one per staged kernel and shape class launched
  const void* const k = reinterpret_cast<const void*>(kernel);
  const int sms = detail::sm_count(device);
  int per_sm = -1;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : cache)
      if (e.kernel == k && e.device == device && e.threads == threads && e.smem == smem) per_sm = e.per_sm;
    if (per_sm < 0) {
      DIFUSE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      cache.push_back({k, device, threads, smem, per_sm});
    }
  }
  return static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
}

}  // namespace difuse::norm
