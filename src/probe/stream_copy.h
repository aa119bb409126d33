// stream_copy: the speed of light of a plain streaming kernel at a given size, for the benchmarks (not an op).
//
// `bench ops` holds each fused op against the time the best of these copy kernels needs to move the same bytes
// (half read, half written) in the same run and harness: stream_us. The driver's device-to-device copy (copy_us)
// is slower than our own kernels at small sizes (bench/results/h200/NOTES.md, "copy_us"), so it bounds nothing
// there; a bound below stream_us is below what any kernel that moves those bytes reaches in this harness.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace difuse::probe {

struct StreamCopyVariant {
  int vectors_per_thread;  // 16-byte vectors each thread loads before it stores them (1, 2, 4, 8)
  int threads_per_block;   // 128, 256, 512, 1024
  bool resident_grid;      // false: one pass (a block per chunk); true: the resident blocks, grid-stride
  bool evict_first;        // ld.global.cs / st.global.cs instead of the default cache policy
  int bulk_bytes;          // > 0: the bulk copy engine instead, a one-warp block per chunk of this many bytes
  int ring_row_bytes = 0;  // > 0: the streamed norms' ring schedule instead, rows of this many bytes (ring variants)
  bool ring_bulk_store = false;  // ring variants: the rows stored by bulk copies from their slots, not from registers
  int ring_grab = 0;  // ring variants: > 0, blocks take rows from a grid-wide counter (not strided), at most this many
  bool ring_guided = false;    // ring_grab > 0: grabs shrink as the rows run out (else all of ring_grab rows)
  bool ring_grab_all = false;  // ring_grab > 0: every grab from the counter (else each block's first grab static)
  int ring_producer_lanes = 1;  // ring variants, strided rows: lanes of the producer warp issuing copies together
  int64_t ring_rows_per_block = 0;  // ring variants: > 0, one pass of blocks of this many rows (else resident blocks)
  int warp_ring_row_bytes = 0;  // > 0: a warp ring instead (each warp its own slots and contiguous rows, no producer)
  int warp_ring_slots = 0, warp_ring_rows = 0;  // warp rings: slots per warp, rows per warp
};

int stream_copy_variant_count();
// Throws Failure(DIFUSE_ERR_INVALID_ARGUMENT) outside [0, stream_copy_variant_count()).
StreamCopyVariant stream_copy_variant(int index);
// "u4_t256_onepass_default" ("bulk8192_t32_onepass" for the bulk copies, "ring3072_w24_stg" or
// "ring3072_w24_stg_grab8", "ring3072_w24_stg_p4" for the ring variants): the variant's parameters, for records.
std::string stream_copy_variant_name(int index);

// dst[0, nbytes) = src[0, nbytes) on `stream` with variant `index`. Every precondition is checked first and all
// violations reported (Failure, DIFUSE_ERR_INVALID_ARGUMENT): non-NULL 16-byte aligned pointers, nbytes > 0 and a
// multiple of 16, ranges that do not overlap, a valid variant. The current device runs it.
void stream_copy(void* dst, const void* src, int64_t nbytes, int index, cudaStream_t stream);

}  // namespace difuse::probe
