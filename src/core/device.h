// Makes a CUDA device current for a scope and restores the previous one (checked calls); a device's SM count, read
// once per device (or the benchmarks' SM partition's).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "core/error.h"
#include "core/tensor.h"

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

// The per-device caches (SM counts, kernel attributes, shared-memory budgets, counter pools) hold devices 0..63:
// `device` as their index, or an INVALID_ARGUMENT failure for one outside (it would alias another device's entry).
inline int device_slot(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                  "CUDA device " + std::to_string(device) + " is outside the devices 0..63 difuse supports");
  return device;
}

// The SM count launchers size their grids for on `device` instead of the device's own, 0 for none: set only by the
// benchmarks' SM partition (probe/sm_partition.h, `bench ops --sms N`), whose kernels run on that many SMs.
inline std::atomic<int>& launch_sm_override(int device) {
  static std::atomic<int> counts[kMaxDevices];
  return counts[device_slot(device)];
}

// The SM count of the device itself, read with one checked runtime call the first time each device asks. Devices
// 0..63; racing first calls read the same value.
inline int device_sm_count(int device) {
  static std::atomic<int> cached[kMaxDevices];  // 0: not read yet
  const int d = device_slot(device);
  int sms = cached[d].load(std::memory_order_acquire);
  if (sms == 0) {
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[d].store(sms, std::memory_order_release);
  }
  return sms;
}

// The SM count launchers that size a grid to the GPU use (they call this on every launch): the benchmarks' override
// above where set, else the device's own.
inline int sm_count(int device) {
  const int partition = launch_sm_override(device).load(std::memory_order_acquire);
  return partition > 0 ? partition : device_sm_count(device);
}

}  // namespace difuse::detail
