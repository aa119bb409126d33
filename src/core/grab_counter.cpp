// Grid-wide row counters: one per stream, one per captured launch (grab_counter.h).
#include "core/grab_counter.h"

#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <unordered_map>

#include "core/device.h"
#include "core/error.h"
#include "core/gate.h"

namespace difuse::detail {

namespace {

constexpr int kPoolCounters = 4096;  // per device: 64 KB

struct Pool {
  GrabCounter* counters = nullptr;
  int used = 0;
  std::unordered_map<cudaStream_t, GrabCounter*> by_stream;
  bool logged = false;
};

std::mutex g_mu;
Pool g_pools[64];

GrabCounter* none(Pool& pool, const std::string& why) {
  if (!pool.logged) {
    pool.logged = true;
    BitExactGate::log_line("difuse: streamed kernels split their rows statically (same bits, slower): " + why);
  }
  return nullptr;
}

}  // namespace

GrabCounter* grab_counter(int device, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err == cudaErrorStreamCaptureImplicit || err == cudaErrorStreamCaptureUnsupported) {
    (void)cudaGetLastError();  // the legacy stream while another stream captures in global mode: treat as capturing
    status = cudaStreamCaptureStatusActive;
  } else {
    DIFUSE_CUDA_CHECK(err);
  }
  const bool capturing = status != cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(g_mu);
  Pool& pool = g_pools[device_slot(device)];
  if (!capturing) {
    const auto it = pool.by_stream.find(stream);
    if (it != pool.by_stream.end()) return it->second;
  }
  if (pool.counters == nullptr) {
    if (capturing) return none(pool, "the first launch was being captured into a CUDA graph, so no counters exist");
    void* mem = nullptr;
    DIFUSE_CUDA_CHECK(cudaMalloc(&mem, sizeof(GrabCounter) * kPoolCounters));
    DIFUSE_CUDA_CHECK(cudaMemset(mem, 0, sizeof(GrabCounter) * kPoolCounters));
    DIFUSE_CUDA_CHECK(cudaDeviceSynchronize());
    pool.counters = static_cast<GrabCounter*>(mem);
  }
  if (pool.used == kPoolCounters)
    return none(pool, "all " + std::to_string(kPoolCounters) + " row counters are taken (one per stream and per "
                      "captured launch)");
  GrabCounter* const c = pool.counters + pool.used++;
  if (!capturing) pool.by_stream.emplace(stream, c);
  return c;
}

}  // namespace difuse::detail
