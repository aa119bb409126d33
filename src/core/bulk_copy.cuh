// The bulk copy engine (sm_90's TMA in its non-tensor form, plain sm_90 PTX, no sm_90a): one thread moves a
// contiguous range of up to 1 MB between global and shared memory with one instruction. Loads complete on an
// mbarrier (the bytes are counted as they land); stores are grouped per thread and waited on for their reads of
// shared memory before that memory is reused or the block exits. Copy code only: no arithmetic on the bytes.
//
// Rules the callers keep (PTX ISA 8.0, cp.async.bulk): addresses 16-byte aligned, sizes multiples of 16; the
// mbarrier initialised by one thread, then fence_mbarrier_init and a block barrier before any copy completes on it;
// shared memory written by ordinary stores and then read by a bulk store needs fence_proxy_async in each writing
// thread before the barrier that precedes the bulk store.
#pragma once

#include <cstdint>

namespace difuse::detail {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: the barrier expects `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes an mbarrier's initialisation visible to the copy engine (the thread that initialised it; then a barrier).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// This thread's arrival on `bar`, announcing `bytes` more to land on it in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

// Waits until the phase of parity `parity` of `bar` has completed (every arrival made, every byte landed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_u32(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (done == 0);
}

// This thread's plain arrival on `bar` (no bytes announced).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Global -> shared, `bytes` (a multiple of 16; both addresses 16-byte aligned), completing on `bar`.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Shared -> global, `bytes` (a multiple of 16; both addresses 16-byte aligned), in this thread's open bulk group.
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_u32(smem_src)),
               "r"(bytes)
               : "memory");
}

// Closes this thread's bulk group of stores.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until every committed bulk group of this thread has finished reading shared memory (the writes to global
// memory complete on their own; the grid's end orders them before the next kernel).
__device__ __forceinline__ void bulk_wait_reads() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Orders this thread's ordinary shared-memory writes before later bulk-copy (async proxy) reads of them.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace difuse::detail
