// Makes a CUDA device current for a scope and restores the previous one (checked calls).
#pragma once

#include <cuda_runtime_api.h>

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

}  // namespace difuse::detail
