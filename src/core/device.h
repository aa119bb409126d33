// Makes a CUDA device current for a scope and restores the previous one (checked calls); a device's SM count, read
// once per device.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "core/error.h"

namespace difuse::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DIFUSE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      DIFUSE_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // best effort: destructors do not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// The SM count of `device`, read with one checked runtime call the first time each device asks (launchers that size
// a grid to the GPU call this on every launch). Devices 0..63; racing first calls read the same value.
inline int sm_count(int device) {
  static std::atomic<int> cached[64];  // 0: not read yet
  const int d = device & 63;
  int sms = cached[d].load(std::memory_order_acquire);
  if (sms == 0) {
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[d].store(sms, std::memory_order_release);
  }
  return sms;
}

}  // namespace difuse::detail
