// Grid-wide row counters for the streamed kernels that share their rows out dynamically
// (norm/stream_rows.cuh: stream_produce_grabbed).
//
// A counter is zero before a launch and the launch's last producer sets it back to zero, so two launches must never
// use one counter at the same time. grab_counter() hands out counters so that they do not:
// - a launch on a stream that is not capturing takes that stream's counter (launches on one stream are ordered);
// - a launch being captured into a CUDA graph takes a counter of its own, never handed out again (replays of one
//   graph are ordered; two instantiations of one graph replayed at once on two streams would share it: not done by
//   torch.cuda.graph or torch.compile);
// - nullptr where none can be had: no pool yet while the stream captures (cudaMalloc is not allowed then), or the
//   pool used up. The caller then runs the static row split (same bits, slower); the first such time is logged.
#pragma once

#include <cuda_runtime_api.h>

namespace difuse::detail {

struct GrabCounter {
  unsigned long long next;  // rows taken after the blocks' first grabs
  unsigned int done;        // producers finished
  unsigned int pad;
};

GrabCounter* grab_counter(int device, cudaStream_t stream);

}  // namespace difuse::detail
