// sm_partition — a stream whose kernels run on fewer of the GPU's SMs, for the benchmarks (not an op; no eager
// chain, no gate).
//
// Why: the issues' bounds are H200 numbers, and some sessions get only an H100. The H200 moves 4.26 TB/s with 132
// SMs, the H100 3.01 TB/s with 132: each H200 SM must keep ~1.42x the bytes in flight an H100 SM does for the same
// share of the bandwidth. A kernel whose loads in flight per SM fall short runs slower than the streaming ceiling on
// the H200 while it reaches it on the H100 (at f59b89a the prologues ran at 1.08-1.19x stream_us on the H200 and at
// 1.02-1.09x on the H100). On an H100 limited to ~93 SMs each SM must carry what an H200 SM carries, so the ratio of
// a kernel to the streaming probe there is a proxy for its ratio on the H200 (`bench ops --sms N`), to be checked
// against the H200's own records before it is trusted, and never a substitute for them.
//
// How: a CUDA green context holding the SMs (driver API, fetched through cudaGetDriverEntryPointByVersion, so
// libdifuse still links only the runtime) and one stream of it; kernels launched into that stream with the runtime
// API run on those SMs only. The green context lives until the process exits. Launchers that size a grid to the GPU
// read detail::sm_count(), which set_launch_sm_count() makes answer the partition's count instead of the device's.
#pragma once

#include <cuda_runtime_api.h>

namespace difuse::probe {

struct SmPartitionStream {
  cudaStream_t stream = nullptr;
  int sms = 0;  // SMs the driver gave the partition: at least the count asked for (its granularity rounds up)
};

// A green context of at least `sms` SMs of `device` and a non-blocking stream in it. Throws
// Failure(DIFUSE_ERR_INVALID_ARGUMENT) for sms outside [1, the device's SMs], Failure(DIFUSE_ERR_UNSUPPORTED) when the
// driver lacks green contexts (CUDA 12.5), Failure(DIFUSE_ERR_CUDA) naming the driver call that failed.
SmPartitionStream create_sm_partition_stream(int device, int sms);

// From now on the launchers of `device` size their grids for `sms` SMs; 0 restores the device's own count. Throws
// Failure(DIFUSE_ERR_INVALID_ARGUMENT) for a negative count or one above the device's SMs.
void set_launch_sm_count(int device, int sms);

}  // namespace difuse::probe
